"""Device-seconds held versus busy: ProfileTaskRunner against one static Dask cluster.

    python -m bench.held_busy [--repeats 3] [--stage-seconds 1.0] [--json out.json]

The mixed pipeline (CPU ingest, GPU ETL, CPU step, GPU training, CPU evaluation) on
two emulated devices, through

- ``ProfileTaskRunner``: a cluster per GPU profile, provisioned at its first task and
  closed after ``--idle-timeout`` seconds idle; held time per device comes from the
  runner's ledger (from the moment the devices were leased to the moment they were
  given back, start-up included);
- the static setup a user builds today: one ``DaskTaskRunner`` whose cluster has a
  CPU worker and one worker per GPU (``{"GPU": 1}`` resources, its own
  ``CUDA_VISIBLE_DEVICES``), GPU stages routed with ``dask.annotate(resources=...)``;
  it holds every device from the cluster's start to the flow's end.

Busy time is measured by the tasks themselves: the union, per device, of the
intervals GPU-stage task bodies ran. On emulated devices the stage "kernels" are
``time.sleep``: device time that does not compete for this machine's two cores,
so the figure measures scheduling, not CPU contention.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from bench.common import machine, setup, spread, write_json
from gpu_tasks.ledger import union_seconds  # the ledger's own union of busy intervals

STAGES = {  # stage -> (profile, tasks, seconds per task at --stage-seconds 1)
    "ingest": ("cpu", 1, 4.0),
    "etl": ("gpu-etl", 4, 4.0),
    "prepare": ("cpu", 1, 4.0),
    "train": ("gpu-train", 2, 8.0),
    "evaluate": ("cpu", 1, 2.0),
}
GPU_STAGES = ("etl", "train")
_STATIC_CLUSTER_STARTED: list[float] = []


def _work(stage: str, part: int, seconds: float) -> dict[str, Any]:
    """A stage's task body: hold the device for ``seconds``; report where and when."""
    from gpu_tasks import current_allocation

    alloc = current_allocation()
    devices = (
        list(alloc.devices)
        if alloc.in_profile
        else [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    )
    start = time.time()
    time.sleep(seconds)
    return {
        "stage": stage,
        "part": part,
        "devices": devices,
        "start": start,
        "end": time.time(),
        "pid": os.getpid(),
    }


def _pipeline(scale: float, annotate: bool) -> Any:
    """The mixed pipeline as a Prefect flow body; GPU stages annotated for the static setup."""
    import contextlib

    import dask
    from prefect import task

    from gpu_tasks import profile

    work = task(_work, name="stage")

    def stage(name: str, upstream: list[Any]) -> list[Any]:
        prof, n, seconds = STAGES[name]
        t = work.with_options(name=name, tags=[profile(prof)])
        gpu = annotate and name in GPU_STAGES
        with dask.annotate(resources={"GPU": 1}) if gpu else contextlib.nullcontext():
            futures = [t.submit(name, i, seconds * scale, wait_for=upstream) for i in range(n)]
        return futures

    def body() -> list[dict[str, Any]]:
        futures: list[Any] = []
        upstream: list[Any] = []
        for name in STAGES:
            upstream = stage(name, upstream)
            futures += upstream
        return [f.result() for f in futures]

    return body


def static_cluster(n_gpus: int) -> Any:
    """The static cluster: a CPU worker and one worker per GPU, all started up front."""
    from distributed import Nanny, Scheduler, SpecCluster

    _STATIC_CLUSTER_STARTED.append(time.time())
    opts = {"host": "127.0.0.1", "dashboard_address": None, "silence_logs": 30}
    workers = {"cpu": {"cls": Nanny, "options": {**opts, "nthreads": 1, "env": {"CUDA_VISIBLE_DEVICES": ""}}}}
    for i in range(n_gpus):
        workers[f"gpu-{i}"] = {
            "cls": Nanny,
            "options": {
                **opts,
                "nthreads": 1,
                "resources": {"GPU": 1},
                "env": {"CUDA_VISIBLE_DEVICES": str(i)},
            },
        }
    return SpecCluster(
        workers=workers,
        scheduler={"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard": False}},
        silence_logs=30,
    )


def busy_by_device(tasks: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """GPU-stage task intervals per device."""
    out: dict[str, list[tuple[float, float]]] = {}
    for t in tasks:
        if t["stage"] in GPU_STAGES:
            for d in t["devices"]:
                out.setdefault(d, []).append((t["start"], t["end"]))
    return out


def run_profile(scale: float, idle_timeout: float) -> dict[str, Any]:
    """One run through ProfileTaskRunner; holds from its ledger, busy from the tasks."""
    from prefect import flow
    from prefect.context import FlowRunContext

    from gpu_tasks import ProfileTaskRunner, ResourceProfile

    profiles = [
        ResourceProfile(name="cpu", cpus=1),
        ResourceProfile(name="gpu-etl", gpus=1, idle_timeout=idle_timeout),
        ResourceProfile(name="gpu-train", gpus=1, idle_timeout=idle_timeout),
    ]
    runner = ProfileTaskRunner(profiles=profiles, default="cpu")
    body = _pipeline(scale, annotate=False)
    box: dict[str, Any] = {}

    @flow(task_runner=runner, name="held-vs-busy-profile")
    def f() -> list[dict[str, Any]]:
        box["runner"] = FlowRunContext.get().task_runner
        return body()

    t0 = time.time()
    tasks = f()
    t1 = time.time()
    holds = [
        {
            "device": d,
            "profile": row.profile,
            "start": row.provisioned_at,
            "end": row.closed_at,
            "reason": row.reason,
        }
        for row in box["runner"].ledger
        for d in row.devices
    ]
    idle_tails = sum(
        idle_timeout for row in box["runner"].ledger for _ in row.devices if "idle" in row.reason
    )
    return _account("ProfileTaskRunner", t0, t1, tasks, holds, idle_tails)


def run_static(scale: float, n_gpus: int) -> dict[str, Any]:
    """One run through the static DaskTaskRunner; it holds every device for the cluster's life."""
    from prefect import flow
    from prefect_dask import DaskTaskRunner

    runner = DaskTaskRunner(cluster_class=static_cluster, cluster_kwargs={"n_gpus": n_gpus})
    body = _pipeline(scale, annotate=True)
    _STATIC_CLUSTER_STARTED.clear()

    @flow(task_runner=runner, name="held-vs-busy-static")
    def f() -> list[dict[str, Any]]:
        return body()

    t0 = time.time()
    tasks = f()
    t1 = time.time()  # the runner closed its cluster on leaving the flow
    started = _STATIC_CLUSTER_STARTED[0]
    holds = [
        {"device": str(i), "profile": "static", "start": started, "end": t1, "reason": "flow ended"}
        for i in range(n_gpus)
    ]
    return _account("static DaskTaskRunner", t0, t1, tasks, holds, 0.0)


def _account(
    setup_name: str,
    t0: float,
    t1: float,
    tasks: list[dict[str, Any]],
    holds: list[dict[str, Any]],
    idle_tails: float,
) -> dict[str, Any]:
    busy = busy_by_device(tasks)
    held_s = sum(h["end"] - h["start"] for h in holds)
    busy_s = sum(union_seconds(v) for v in busy.values())
    # (the static cluster may run CPU stages on a GPU worker; they do not use its device)
    misplaced = [t for t in tasks if t["stage"] in GPU_STAGES and not t["devices"]]
    if misplaced:
        raise RuntimeError(f"{setup_name}: GPU stages ran without a device: {misplaced}")
    return {
        "setup": setup_name,
        "flow_s": t1 - t0,
        "held_s": held_s,
        "busy_s": busy_s,
        "held_over_busy": held_s / busy_s,
        "idle_tail_s": idle_tails,
        "held_less_idle_tails_over_busy": (held_s - idle_tails) / busy_s,
        "t0": t0,
        "holds": holds,
        "tasks": tasks,
    }


def run(repeats: int, scale: float, idle_timeout: float) -> dict[str, Any]:
    """Both setups ``repeats`` times, alternating, against one Prefect server."""
    from gpu_tasks._server import embedded_server
    from gpu_tasks.devices import discover

    n_gpus = len(discover().devices)
    runs: list[dict[str, Any]] = []
    with embedded_server():
        for i in range(repeats):
            for one in (lambda: run_profile(scale, idle_timeout), lambda: run_static(scale, n_gpus)):
                r = one()
                r["repeat"] = i
                runs.append(r)
                print(
                    f"  {r['setup']:24s} held {r['held_s']:6.1f} device-s, busy {r['busy_s']:6.1f}, "
                    f"held/busy {r['held_over_busy']:.2f}, flow {r['flow_s']:.1f}s",
                    flush=True,
                )
    summary = {}
    for name in ("ProfileTaskRunner", "static DaskTaskRunner"):
        mine = [r for r in runs if r["setup"] == name]
        summary[name] = {
            k: spread([r[k] for r in mine])
            for k in ("held_over_busy", "held_less_idle_tails_over_busy", "held_s", "busy_s", "flow_s")
        }
    return {
        "repeats": repeats,
        "stage_seconds": scale,
        "idle_timeout": idle_timeout,
        "gpus": n_gpus,
        "stages": {k: {"profile": p, "tasks": n, "seconds": s * scale} for k, (p, n, s) in STAGES.items()},
        "machine": machine(),
        "runs": runs,
        "summary": summary,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stage-seconds", type=float, default=1.0, help="multiplies every stage's duration")
    parser.add_argument("--idle-timeout", type=float, default=1.0, help="GPU profiles' idle timeout")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    setup()
    write_json(args.json, run(args.repeats, args.stage_seconds, args.idle_timeout))


if __name__ == "__main__":
    main()
