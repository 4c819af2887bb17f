"""Device-seconds held versus busy: ProfileTaskRunner against a static Dask cluster and Ray.

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
  it holds every device from the cluster's start to the flow's end;
- prefect-ray's ``RayTaskRunner`` on a local Ray cluster started with the devices as
  its GPUs (``num_gpus``) and a CPU per device plus one, GPU stages submitted inside
  ``remote_options(num_gpus=1)``. Ray hands its GPUs to tasks, but the cluster keeps
  them from ``ray.init`` (the flow's start) to ``ray.shutdown()`` (its end): a local
  Ray cluster never gives a GPU back while it runs, so it holds every device for its
  whole life, as the static cluster does. Skipped, with the reason, without the
  ``bench`` extra.

Busy time is measured by the tasks themselves: the union, per device, of the
intervals GPU-stage task bodies ran. On emulated devices the stage "kernels" are
``time.sleep``: device time that does not compete for this machine's two cores,
so the figure measures scheduling, not CPU contention.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

from bench.common import RAY, machine, ray_skipped, setup, spread, write_json
from gpu_tasks.reporting.ledger import union_seconds  # the ledger's own union of busy intervals

STAGES = {  # stage -> (profile, tasks, seconds per task at --stage-seconds 1)
    "ingest": ("cpu", 1, 4.0),
    "etl": ("gpu-etl", 4, 4.0),
    "prepare": ("cpu", 1, 4.0),
    "train": ("gpu-train", 2, 8.0),
    "evaluate": ("cpu", 1, 2.0),
}
GPU_STAGES = ("etl", "train")
PROFILE, STATIC = "ProfileTaskRunner", "static DaskTaskRunner"
_STATIC_CLUSTER_STARTED: list[float] = []


def _work(stage: str, part: int, seconds: float, after: list[Any] | None = None) -> dict[str, Any]:
    """A stage's task body: hold the device for ``seconds``; report where and when.

    ``after``: the upstream stage's results, unused: given only where the runner orders
    tasks by their arguments (see :func:`_pipeline`).
    """
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


def _pipeline(
    scale: float,
    gpu_route: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    upstream_as_argument: bool = False,
) -> Any:
    """The mixed pipeline as a Prefect flow body; GPU stages are submitted inside ``gpu_route()``
    (how a runner without profiles is told a task needs a GPU: Dask annotations, Ray options).

    Every stage is submitted at once, each task waiting for the stage before it: by
    ``wait_for=``, or with ``upstream_as_argument`` by taking the upstream futures as an
    argument. prefect-ray needs the latter: it gives Ray only a task's arguments as
    dependencies and waits for ``wait_for=`` futures inside the task, after Ray has started
    it and given it its GPU; a training task started that way holds a GPU while it waits,
    and two of them hold both while the ETL tasks they wait for queue for a GPU (a
    deadlock this benchmark ran into). prefect-dask makes ``wait_for=`` Dask dependencies.
    """
    from prefect import task

    from gpu_tasks import profile

    work = task(_work, name="stage")

    def stage(name: str, upstream: list[Any]) -> list[Any]:
        prof, n, seconds = STAGES[name]
        t = work.with_options(name=name, tags=[profile(prof)])
        with gpu_route() if name in GPU_STAGES else contextlib.nullcontext():
            after: dict[str, Any] = {"after": upstream} if upstream_as_argument else {"wait_for": upstream}
            futures = [t.submit(name, i, seconds * scale, **after) for i in range(n)]
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


def _run_flow(
    runner: Any, body: Callable[[], list[dict[str, Any]]], name: str, keep_runner: bool = True
) -> tuple[float, float, list[dict[str, Any]], Any]:
    """Run ``body`` as a flow on ``runner``: its start and end (the end after the runner closed
    its clusters, on leaving the flow), the tasks' reports, and (``keep_runner``) the runner
    instance the flow run entered (Prefect runs a copy of the one given), else None.

    Not with DaskTaskRunner: it pickles the flow run's context, this flow and its closure
    included, with every task, and a kept runner (its Dask client) cannot be pickled.
    """
    from prefect import flow
    from prefect.context import FlowRunContext

    entered: list[Any] = []

    @flow(task_runner=runner, name=name)
    def f() -> list[dict[str, Any]]:
        if keep_runner:
            entered.append(FlowRunContext.get().task_runner)
        return body()

    t0 = time.time()
    tasks = f()
    return t0, time.time(), tasks, entered[0] if entered else None


def run_profile(scale: float, idle_timeout: float) -> dict[str, Any]:
    """One run through ProfileTaskRunner; holds from its ledger, busy from the tasks."""

    from gpu_tasks import ProfileTaskRunner, ResourceProfile

    profiles = [
        ResourceProfile(name="cpu", cpus=1),
        ResourceProfile(name="gpu-etl", gpus=1, idle_timeout=idle_timeout),
        ResourceProfile(name="gpu-train", gpus=1, idle_timeout=idle_timeout),
    ]
    runner = ProfileTaskRunner(profiles=profiles, default="cpu")
    t0, t1, tasks, entered = _run_flow(runner, _pipeline(scale), "held-vs-busy-profile")
    holds = [
        {
            "device": d,
            "profile": row.profile,
            "start": row.provisioned_at,
            "end": row.closed_at,
            "reason": row.reason,
        }
        for row in entered.ledger
        for d in row.devices
    ]
    idle_tails = sum(idle_timeout for row in entered.ledger for _ in row.devices if "idle" in row.reason)
    return _account(PROFILE, t0, t1, tasks, holds, idle_tails)


def run_static(scale: float, n_gpus: int) -> dict[str, Any]:
    """One run through the static DaskTaskRunner; it holds every device for the cluster's life."""
    import dask
    from prefect_dask import DaskTaskRunner

    runner = DaskTaskRunner(cluster_class=static_cluster, cluster_kwargs={"n_gpus": n_gpus})
    body = _pipeline(scale, gpu_route=lambda: dask.annotate(resources={"GPU": 1}))
    _STATIC_CLUSTER_STARTED.clear()
    t0, t1, tasks, _ = _run_flow(runner, body, "held-vs-busy-static", keep_runner=False)
    return _account(STATIC, t0, t1, tasks, _whole_life(_STATIC_CLUSTER_STARTED[0], t1, n_gpus, "static"), 0.0)


def run_ray(scale: float, n_gpus: int) -> dict[str, Any]:
    """One run through prefect-ray's RayTaskRunner; its local cluster holds every device for its life."""
    from bench.ray_peer import local_ray, remote_options

    # a CPU per device for its GPU tasks (a Ray task takes 1 CPU by default) and one for the
    # CPU stages: the static cluster's three single-threaded workers
    runner = local_ray(num_cpus=n_gpus + 1, num_gpus=n_gpus)
    body = _pipeline(scale, gpu_route=lambda: remote_options(num_gpus=1), upstream_as_argument=True)
    t0, t1, tasks, ray = _run_flow(runner, body, "held-vs-busy-ray")
    return {
        **_account(RAY, t0, t1, tasks, _whole_life(ray.init_started, t1, n_gpus, "ray"), 0.0),
        "init_s": ray.init_s,
    }


def _whole_life(started: float, ended: float, n_gpus: int, label: str) -> list[dict[str, Any]]:
    """Holds of a cluster that keeps every device from its start to the flow's end."""
    return [
        {"device": str(i), "profile": label, "start": started, "end": ended, "reason": "flow ended"}
        for i in range(n_gpus)
    ]


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
    from gpu_tasks.devices.discovery import discover
    from gpu_tasks.prefect_api.server import embedded_server

    n_gpus = len(discover().devices)
    setups: dict[str, Callable[[], dict[str, Any]]] = {
        PROFILE: lambda: run_profile(scale, idle_timeout),
        STATIC: lambda: run_static(scale, n_gpus),
        RAY: lambda: run_ray(scale, n_gpus),
    }
    skipped = ray_skipped()
    for name in skipped:
        del setups[name]
    runs: list[dict[str, Any]] = []
    with embedded_server():
        for i in range(repeats):
            for one in setups.values():
                r = one()
                r["repeat"] = i
                runs.append(r)
                print(
                    f"  {r['setup']:24s} held {r['held_s']:6.1f} device-s, busy {r['busy_s']:6.1f}, "
                    f"held/busy {r['held_over_busy']:.2f}, flow {r['flow_s']:.1f}s",
                    flush=True,
                )
    summary = {}
    for name in setups:
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
        "skipped": skipped,
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
