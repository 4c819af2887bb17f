"""What gpu-tasks tells Prefect about clusters and task runs: events, and the dashboard link.

Events (best effort: never fail a run over one):

- ``gpu-tasks.cluster.<provisioned|scaled|closed|crashed>``, resource
  ``gpu-tasks.cluster.<flow run id>.<profile>``, related to the flow run;
- ``gpu-tasks.device.<leased|released>``, resource ``gpu-tasks.device.<host>.<address>``;
- ``gpu-tasks.task.<what>`` (``escalated``, ``slot-waited``, ``cache-hit``), resource
  ``gpu-tasks.task.<task run id>``.
"""

from __future__ import annotations

import logging
import re
import socket
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpu_tasks.clusters import ProfileCluster

logger = logging.getLogger(__name__)

# the device event that each cluster event implies for the devices it names
_DEVICE_EVENTS = {"provisioned": "leased", "scaled": "leased", "closed": "released", "crashed": "released"}


def _flow_run(flow_run_id: uuid.UUID | None) -> list[dict[str, str]]:
    if flow_run_id is None:
        return []
    return [{"prefect.resource.id": f"prefect.flow-run.{flow_run_id}", "prefect.resource.role": "flow-run"}]


def emit_cluster_event(
    what: str,
    cluster: ProfileCluster,
    flow_run_id: uuid.UUID | None,
    payload: dict[str, Any],
    devices: Sequence[str] | None = None,
) -> None:
    """``gpu-tasks.cluster.<what>`` about ``cluster`` (and the device events it implies)."""
    try:
        from prefect.events import emit_event

        name = cluster.profile.name
        devices = cluster.devices if devices is None else devices
        related = _flow_run(flow_run_id)
        emit_event(
            event=f"gpu-tasks.cluster.{what}",
            resource={
                "prefect.resource.id": f"gpu-tasks.cluster.{flow_run_id or 'local'}.{name}",
                "prefect.resource.name": name,
                "gpu-tasks.profile": name,
                "gpu-tasks.devices": ",".join(devices) or "-",
                "gpu-tasks.emulated": str(cluster.emulated).lower(),
                "gpu-tasks.kind": cluster.profile.kind,
            },
            related=related,
            payload=payload,
        )
        lease_event = _DEVICE_EVENTS.get(what)
        host = socket.gethostname()
        for address in devices if lease_event else ():
            # a remote profile's devices are <host>:<id> (gpu_tasks.allocation.Allocation.device_keys)
            where, _, device = address.rpartition(":") if ":" in address else (host, "", address)
            emit_event(
                event=f"gpu-tasks.device.{lease_event}",
                resource={
                    "prefect.resource.id": f"gpu-tasks.device.{where}.{device}",
                    "prefect.resource.name": f"gpu:{address}",
                    "gpu-tasks.profile": name,
                },
                related=related,
                payload={"profile": name},
            )
    except Exception:  # events are for watching; never fail the run over one
        logger.debug("could not emit gpu-tasks.cluster.%s", what, exc_info=True)


def emit_task_event(
    what: str,
    task_run_id: uuid.UUID,
    task_name: str,
    profile: str,
    flow_run_id: uuid.UUID | None,
    payload: dict[str, Any],
) -> None:
    """``gpu-tasks.task.<what>`` about one task run."""
    try:
        from prefect.events import emit_event

        related = [
            {"prefect.resource.id": f"prefect.task-run.{task_run_id}", "prefect.resource.role": "task-run"}
        ]
        emit_event(
            event=f"gpu-tasks.task.{what}",
            resource={
                "prefect.resource.id": f"gpu-tasks.task.{task_run_id}",
                "prefect.resource.name": task_name,
                "gpu-tasks.profile": profile,
            },
            related=related + _flow_run(flow_run_id),
            payload=payload,
        )
    except Exception:  # events are for watching; never fail the run over one
        logger.debug("could not emit gpu-tasks.task.%s", what, exc_info=True)


def publish_dashboard(cluster: ProfileCluster) -> None:
    """A link artifact to the cluster's Dask dashboard, when dashboards are on (best effort)."""
    link = cluster.dashboard_link
    if not link:
        return
    try:
        from prefect.artifacts import create_link_artifact

        name = cluster.profile.name
        create_link_artifact(
            link=link,
            link_text=f"Dask dashboard of profile {name!r}",
            key=f"dask-dashboard-{re.sub(r'[^a-z0-9-]', '-', name.lower())}",
        )
    except Exception:
        logger.warning("could not publish the dashboard link artifact", exc_info=True)
