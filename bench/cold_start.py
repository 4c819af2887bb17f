"""Cold start: from a profile's first submit to its task starting.

    python -m bench.cold_start [--repeats 3] [--json out.json]

Measured, each ``--repeats`` times, on one emulated device:

- **fresh**: the first task of a ``gpus=1`` profile in a new flow run (the cluster
  starts for it);
- **re-provision**: the first task after that profile's cluster was closed for
  being idle (same flow run);
- **warm**: a task submitted while the cluster is up (for reference);
- **DaskTaskRunner**: the first task of a flow on prefect-dask's runner with one
  worker process (it starts its cluster at the first submit, as gpu-tasks does);
- **RayTaskRunner**: the first task of a flow on prefect-ray's runner, a local Ray
  cluster with one CPU and one (emulated) GPU, the task asking for the GPU
  (``remote_options(num_gpus=1)``). prefect-ray starts its cluster (``ray.init``) when
  the flow starts, before any submit, so its first task waits for both: ``ray.init``,
  then submit to task body. Skipped, with the reason, without the ``bench`` extra;
- **by hand**: ``LocalCluster(n_workers=1)`` + ``Client`` + ``client.submit`` of a
  plain function, and of Prefect's task engine (what a runner must at least pay).

Where the time goes, for the gpu-tasks cases (``runner.status()["startup"]``):
preparing with no device held (waiting for a warm worker process of the pool, which
the runner starts at its first submit, and starting the profile's scheduler), waiting
for the device lease, binding warm processes to the device and starting their Dask
workers, and the rest, from workers being up to the task body running (the Prefect
task engine's first run in that process: context, creating the task run through the
API). ``lease_to_body_s``, the last two, is measured directly: from the lease (the
ledger's ``provisioned_at``) to the task body's clock, the time a device is held before
the task that leased it starts. ``before_lease_other_s`` is the rest before the lease:
handing the task to its profile and, on re-provision, waiting for the idle cluster's
close to end (its processes exit before its device is given back).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from bench.common import machine, ray_skipped, setup, spread, write_json


def _started() -> dict[str, Any]:
    return {"t": time.time(), "pid": os.getpid()}


def gpu_tasks_cases(idle_timeout: float, cuda: dict[str, Any] | None = None) -> dict[str, Any]:
    """fresh, re-provision and warm latencies through ProfileTaskRunner, with breakdowns
    (``cuda``: the profile's CUDA options, e.g. an RMM pool, as ``scripts/gpu-check`` measures)."""
    from prefect import flow, task
    from prefect.context import FlowRunContext

    from gpu_tasks import ProfileTaskRunner, ResourceProfile, profile

    gpu = ResourceProfile(name="gpu", gpus=1, max_workers=1, idle_timeout=idle_timeout, cuda=cuda or {})
    started = task(_started, name="started", tags=[profile("gpu")])

    def timed() -> dict[str, Any]:
        runner = FlowRunContext.get().task_runner
        t0 = time.time()
        body = started.submit().result()
        status = runner.status()["gpu"]
        total = body["t"] - t0
        startup = status.get("startup") or {}
        return {"total_s": total, **startup, "pid": body["pid"], "body_at": body["t"]}

    def closed(runner: Any) -> None:
        deadline = time.monotonic() + 60
        while runner.status()["gpu"]["state"] != "closed":
            if time.monotonic() > deadline:
                raise RuntimeError("the idle cluster was not closed within 60s")
            time.sleep(0.05)

    @flow(task_runner=ProfileTaskRunner(profiles=[gpu]), name="cold-start")
    def f() -> dict[str, Any]:
        runner = FlowRunContext.get().task_runner
        fresh = timed()
        t0 = time.time()
        warm = started.submit().result()["t"] - t0
        closed(runner)
        again = timed()
        if again["pid"] == fresh["pid"]:
            raise RuntimeError("re-provisioning reused the old worker process")
        # the ledger's rows, one per cluster life (written once its close ends): when its
        # device was leased (wall clock)
        deadline = time.monotonic() + 60
        while len(leased := [row.provisioned_at for row in runner.ledger if row.profile == "gpu"]) < 2:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the ledger has {len(leased)} of the 2 cluster lives within 60s")
            time.sleep(0.05)
        return {"fresh": fresh, "reprovision": again, "warm": {"total_s": warm}, "leased_at": leased}

    out = f()
    leased = out.pop("leased_at")
    for case, leased_at in zip(("fresh", "reprovision"), leased, strict=True):
        row = out[case]
        row["lease_to_body_s"] = row.pop("body_at") - leased_at
        row["prepare_s"] = row.get("prepare_s", 0.0)
        row["engine_first_task_s"] = row["lease_to_body_s"] - row["start_workers_s"]
        # before the lease, besides preparing and the device wait: handing the task to the
        # profile, and (re-provision) waiting for the idle cluster's close to end
        row["before_lease_other_s"] = max(
            0.0, row["total_s"] - row["lease_to_body_s"] - row["prepare_s"] - row["wait_devices_s"]
        )
    return out


def dask_task_runner_case() -> float:
    """First task of a flow on prefect-dask's DaskTaskRunner (one worker process)."""
    from prefect import flow, task
    from prefect_dask import DaskTaskRunner

    started = task(_started, name="started")
    runner = DaskTaskRunner(
        cluster_kwargs={
            "n_workers": 1,
            "threads_per_worker": 1,
            "processes": True,
            "dashboard_address": None,
            "host": "127.0.0.1",
        }
    )

    @flow(task_runner=runner, name="cold-start-dask")
    def f() -> float:
        t0 = time.time()
        return started.submit().result()["t"] - t0

    return f()


def ray_task_runner_case() -> dict[str, float]:
    """First task of a flow on prefect-ray's RayTaskRunner: ``ray.init`` at the flow's start,
    then from submit to the task body."""
    from prefect import flow, task
    from prefect.context import FlowRunContext

    from bench.ray_peer import local_ray, remote_options

    started = task(_started, name="started")

    @flow(task_runner=local_ray(num_cpus=1, num_gpus=1), name="cold-start-ray")
    def f() -> dict[str, float]:
        runner = FlowRunContext.get().task_runner
        t0 = time.time()
        with remote_options(num_gpus=1):
            first = started.submit().result()["t"] - t0
        return {"total_s": runner.init_s + first, "init_s": runner.init_s, "first_task_s": first}

    return f()


def by_hand_case() -> dict[str, float]:
    """LocalCluster + Client by hand: a plain function, then Prefect's engine, as first tasks."""
    from distributed import Client, LocalCluster

    t0 = time.time()
    with (
        LocalCluster(
            n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None
        ) as cluster,
        Client(cluster) as client,
    ):
        up = time.time()
        plain = client.submit(_started, pure=False).result()["t"]
        t1 = time.time()
        imported = client.submit(_import_engine, pure=False).result()
    return {
        "cluster_s": up - t0,
        "total_s": plain - t0,
        "first_submit_s": plain - up,
        "import_task_engine_s": imported,
        "second_call_s": t1 - plain,
    }


def _import_engine() -> float:
    t0 = time.perf_counter()
    import prefect.task_engine  # noqa: F401

    return time.perf_counter() - t0


def run(repeats: int, idle_timeout: float) -> dict[str, Any]:
    from gpu_tasks.prefect_api.server import embedded_server

    rows: dict[str, list[dict[str, Any]]] = {
        "fresh": [],
        "reprovision": [],
        "warm": [],
        "dask": [],
        "ray": [],
        "by_hand": [],
    }
    skipped = ray_skipped()
    if skipped:
        del rows["ray"]
    with embedded_server():
        for _ in range(repeats):
            out = gpu_tasks_cases(idle_timeout)
            for case in ("fresh", "reprovision", "warm"):
                rows[case].append(out[case])
            rows["dask"].append({"total_s": dask_task_runner_case()})
            if "ray" in rows:
                rows["ray"].append(ray_task_runner_case())
            rows["by_hand"].append(by_hand_case())
            print("  " + ", ".join(f"{k} {v[-1]['total_s']:.2f}s" for k, v in rows.items()), flush=True)
    summary = {
        case: {k: spread([r[k] for r in v]) for k in v[0] if k.endswith("_s")} for case, v in rows.items()
    }
    return {
        "repeats": repeats,
        "idle_timeout": idle_timeout,
        "machine": machine(),
        "runs": rows,
        "summary": summary,
        "skipped": skipped,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--idle-timeout", type=float, default=0.5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    setup()
    write_json(args.json, run(args.repeats, args.idle_timeout))


if __name__ == "__main__":
    main()
