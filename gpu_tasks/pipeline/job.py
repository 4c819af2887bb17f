"""``gpu-tasks example run``: the ETL -> train pipeline once, on an embedded Prefect server.

Without ``PREFECT_API_URL`` a Prefect server is started for the run on 127.0.0.1
(and stopped after it: :func:`gpu_tasks.prefect_api.server.embedded_server`). Devices are
emulated only where ``GPU_TASKS_EMULATED_GPUS`` is set (``gpu-tasks example run --emulate``,
:func:`gpu_tasks.devices.emulation.ensure_devices`).
"""

from __future__ import annotations

import time
from typing import Any

from gpu_tasks.prefect_api.server import embedded_server


def run_pipeline(
    scale: int = 1,
    num_rounds: int = 60,
    seed: int = 0,
    limit: int | None = None,
    data_dir: str | None = None,
) -> dict[str, Any]:
    """Run the pipeline flow once and return its summary (plus wall time and server URL)."""
    from gpu_tasks.devices.discovery import discover
    from gpu_tasks.pipeline.flow import etl_train

    source = discover().source
    with embedded_server() as url:
        t0 = time.monotonic()
        out = etl_train(scale=scale, num_rounds=num_rounds, seed=seed, limit=limit, data_dir=data_dir)
        out["seconds"] = round(time.monotonic() - t0, 2)
    out["clusters"] = closed_clusters(out)
    out["prefect_api_url"] = url
    out["device_source"] = source
    return out


def closed_clusters(out: dict[str, Any]) -> dict[str, Any]:
    """Each profile's clusters after the runner closed them (its final ledger), in place of the
    flow's own snapshot taken before they closed."""
    import uuid

    from gpu_tasks.reporting.ledger import ended_ledger

    rows = ended_ledger(uuid.UUID(out["flow_run_id"]))
    if rows is None:  # the runner did not end in this process: keep the flow's snapshot
        return dict(out["clusters"])
    clusters: dict[str, Any] = {}
    for row in sorted(rows, key=lambda r: r.provisioned_at):
        c = clusters.setdefault(
            row.profile,
            {"state": "closed", "lifetimes": 0, "devices": [], "held_s": 0.0, "busy_s": 0.0, "tasks": 0},
        )
        c["lifetimes"] += 1
        c["devices"] = sorted(set(c["devices"]) | set(row.devices))
        c["held_s"] = round(c["held_s"] + row.held_seconds, 3)
        c["busy_s"] = round(c["busy_s"] + row.busy_seconds, 3)
        c["tasks"] += row.tasks
        c["reason"] = row.reason  # the last close's
    return clusters
