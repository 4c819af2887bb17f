"""Per-task overhead: the same N trivial tasks through each task runner, in one run.

    python -m bench.overhead [--n 100 1000] [--repeats 3] [--json out.json]

Times ``inc.map(range(N))`` through Prefect's ThreadPoolTaskRunner, prefect-dask's
DaskTaskRunner, prefect-ray's RayTaskRunner (plain tasks, and ``num_gpus=0.25`` tasks
with worker processes reused, on a local Ray cluster with two emulated GPUs; skipped,
with the reason, without the ``bench`` extra) and ProfileTaskRunner (a CPU profile:
threads in the flow process; and a ``gpus=0.25`` profile on emulated devices: Dask
worker processes). One flow per runner and N: eight warm-up tasks first bring up every
worker, then the timed repeats run one after another in that flow, so cluster start-up
(cold start, measured apart) is not counted as per-task overhead; each repeat starts
once Prefect's server has recorded every task run before it (its writes lag behind) and
gone idle (it stores the events and logs after the runs); for
ProfileTaskRunner the timing then also waits for its warm pool to be refilled (the
processes it starts to replace those the warm-up bound import Prefect, CPU that is
start-up, not per-task cost).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from bench.common import RAY, machine, ray_missing, ray_skipped, setup, spread, write_json

THREADS = "ThreadPoolTaskRunner"
DASK = "DaskTaskRunner"
RAY_GPU = "RayTaskRunner, num_gpus=0.25 (max_calls=0)"
PROFILE_CPU = "ProfileTaskRunner, CPU profile"
PROFILE_GPU = "ProfileTaskRunner, gpus=0.25 profile"
WARM_TASKS = 8  # enough to bring up every worker: 2 emulated devices x 4 quarter-device slots


class Runner(NamedTuple):
    """How one row's flows run: a fresh task runner per flow, and how its tasks are submitted."""

    make: Callable[[], Any]
    tag: str | None = None  # a gpu-tasks profile's tag on the tasks
    around: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext  # wraps the map


def runners(n_gpu: int) -> dict[str, Runner]:
    """Label -> how its flows run; labels are stable keys of the results. The Ray rows are
    left out when Ray is not installed (:func:`bench.common.ray_missing` says why)."""
    from prefect.task_runners import ThreadPoolTaskRunner

    from gpu_tasks import ProfileTaskRunner, ResourceProfile

    cpu = ResourceProfile(name="cpu", cpus=0.25)  # 8 threads on a 2-core machine, as the thread pool
    out = {
        THREADS: Runner(lambda: ThreadPoolTaskRunner(max_workers=8)),
        DASK: Runner(
            lambda: _dask_task_runner()(
                cluster_kwargs={
                    "n_workers": 2,
                    "threads_per_worker": 2,
                    "processes": True,
                    "dashboard_address": None,
                    "host": "127.0.0.1",
                }
            ),
        ),
        PROFILE_CPU: Runner(lambda: ProfileTaskRunner(profiles=[cpu], idle_timeout=600)),
        PROFILE_GPU: Runner(
            lambda: ProfileTaskRunner(
                profiles=[cpu, ResourceProfile(name="quarter", gpus=0.25, max_workers=n_gpu)],
                default="cpu",
                idle_timeout=600,
            ),
            tag="quarter",
        ),
    }
    if ray_missing() is None:
        from bench.ray_peer import local_ray, remote_options

        # Ray runs one task per worker process (at 1 CPU each by default): 4 logical CPUs run
        # 4 at once, as DaskTaskRunner's 2 workers x 2 threads; the same cluster has the
        # emulated GPUs, packed four num_gpus=0.25 tasks to a GPU. A task that asks for GPUs
        # gets max_calls=1 from Ray unless told otherwise: its worker process exits after it,
        # so every GPU task would start a process (cold start, measured apart; seconds per
        # task here). max_calls=0 (no limit) keeps the workers, as the other rows do.
        make_ray = lambda: local_ray(num_cpus=4, num_gpus=n_gpu)  # noqa: E731
        out[RAY] = Runner(make_ray)
        out[RAY_GPU] = Runner(make_ray, around=lambda: remote_options(num_gpus=0.25, max_calls=0))
    order = (THREADS, DASK, RAY, RAY_GPU, PROFILE_CPU, PROFILE_GPU)  # the peers first, as in the report
    return {label: out[label] for label in order if label in out}


def _dask_task_runner() -> Any:
    """prefect-dask's runner class, imported only for its row (the GPU machine has no prefect-dask)."""
    from prefect_dask import DaskTaskRunner

    return DaskTaskRunner


def _pool_refilled(timeout: float = 60.0) -> None:
    """Wait until gpu-tasks' warm pool has replaced the processes the warm-up bound: its refill
    imports Prefect in new processes, CPU that would otherwise be counted as per-task overhead."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    warm = getattr(ctx.task_runner if ctx else None, "warm_workers", None)
    if warm is None:
        return
    start = time.monotonic()
    while time.monotonic() < start + timeout:
        idle = warm()
        if idle and all(w["ready"] for w in idle):
            return
        if not idle and time.monotonic() > start + 2:
            return  # no pool (a CPU-only runner): waiting longer would only idle its flow
        time.sleep(0.05)


def _server_caught_up(expected: int, timeout: float = 180.0) -> None:
    """Wait until Prefect's server has recorded this flow run's ``expected`` task runs as completed.

    Its task-run recorder writes states from events, behind the runs themselves: a timed repeat
    that started while the server still wrote an earlier row's (or repeat's) backlog would share
    its CPU with that, and so each row and repeat starts with a server that has caught up.
    """
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    from gpu_tasks.prefect_api.server import count_task_runs

    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return
    done = {
        "task_runs": {
            "flow_run_id": {"any_": [str(ctx.flow_run.id)]},
            "state": {"type": {"any_": ["COMPLETED"]}},
        }
    }
    start = time.monotonic()
    with get_client(sync_client=True) as client:
        while count_task_runs(client, done) < expected:
            if time.monotonic() > start + timeout:
                raise RuntimeError(
                    f"Prefect's server recorded fewer than {expected} task runs in {timeout:g}s"
                )
            time.sleep(0.1)
    _said_wait(f"for Prefect's server to record {expected} task runs", time.monotonic() - start)
    _server_idle()


def _server_idle(timeout: float = 120.0, busy_below: float = 10.0) -> None:
    """Wait until this process's Prefect server (its uvicorn process) has used under ``busy_below``
    percent of a core in two half-second windows running (at most ``timeout``).

    Its task runs all ``Completed`` is not the end of its work: it still stores the map's events
    (the event persister, a service of its own) and logs for seconds afterwards, and a repeat that
    starts meanwhile shares the machine's cores with that backlog. The thread pool's single flow
    process leaves the server a core; a GPU profile's flow and worker processes take both cores, so
    the backlog slowed its rows most (a repeat at 5.6 ms per task against 3.1 ms after a quiet
    server, same flow and code)."""
    import psutil

    servers = [p for p in psutil.Process().children(recursive=True) if "uvicorn" in " ".join(_cmdline(p))]
    if not servers:
        return
    start = time.monotonic()
    quiet = 0
    with contextlib.suppress(psutil.Error):
        servers[0].cpu_percent()
        while quiet < 2 and time.monotonic() < start + timeout:
            time.sleep(0.5)
            quiet = quiet + 1 if servers[0].cpu_percent() < busy_below else 0
    _said_wait("for Prefect's server to go idle", time.monotonic() - start)


def _said_wait(what: str, seconds: float, why: str = "") -> None:
    """A wait of more than 2 s between timed repeats, on stderr (the gpu-check log shows where a
    run's time went, even when its limit stops it)."""
    if seconds > 2:
        print(f"    (waited {seconds:.1f} s {what}{why})", file=sys.stderr, flush=True)


# processes that outlive a row idle, by a word of their command line
KEPT_IDLE = ("resource_tracker", "uvicorn", "multiprocessing.forkserver")


def _machine_quiet(timeout: float = 60.0) -> None:
    """Wait until the previous row's processes (a local Ray cluster's) have gone and the CPUs are
    near idle, so that no row is timed while another row's processes stop (at most ``timeout``)."""

    import psutil

    start = time.monotonic()
    left: list[Any] = []
    busy = 0.0
    while time.monotonic() < start + timeout:
        left = leftovers()
        busy = psutil.cpu_percent(interval=0.5)
        if not left and busy < 25:
            _said_wait("for a quiet machine", time.monotonic() - start)
            return
        time.sleep(0.5)
    names = [" ".join(_cmdline(p))[:80] for p in left]
    why = f", in vain: CPUs {busy:.0f}% busy, left {names}"
    _said_wait("for a quiet machine", time.monotonic() - start, why)


def leftovers() -> list[Any]:
    """This process's descendants that an earlier row left running, less those kept idle on
    purpose (:data:`KEPT_IDLE`): the Prefect server (uvicorn) stays; multiprocessing's tracker
    outlives its pools; gpu-tasks' warm-pool fork server is kept after its pool closes (the
    processes forked from it still count)."""
    import psutil

    return [
        p
        for p in psutil.Process().children(recursive=True)
        if not any(word in " ".join(_cmdline(p)) for word in KEPT_IDLE)
    ]


def _cmdline(proc: Any) -> list[str]:
    try:
        return list(proc.cmdline())
    except Exception:  # gone, or not ours to read
        return []


def run(
    sizes: list[int],
    repeats: int,
    only: tuple[str, ...] | None = None,
    n_gpu: int = 2,
    quiet: bool = True,
) -> dict[str, Any]:
    """ms per task for each runner and N: ``{"ms_per_task": {str(N): {label: [..]}}}``; ``only``:
    these runners' labels alone; ``n_gpu``: devices the gpus=0.25 profile may use; ``quiet``: wait
    (up to 60 s) for a near-idle machine before each row (a rehearsal that times nothing does not)."""
    from prefect import flow, task

    from gpu_tasks import profile
    from gpu_tasks.prefect_api.server import embedded_server

    @task
    def inc(x: int) -> int:
        return x + 1

    results: dict[str, dict[str, list[float]]] = {}
    skipped = ray_skipped()
    with embedded_server():
        for label, r in runners(n_gpu).items():
            if only is not None and label not in only:
                continue
            tagged = inc.with_options(tags=[profile(r.tag)]) if r.tag else inc

            # the loop's values bound now (once runs within this iteration anyway)
            def once(
                n: int, repeats: int, r: Runner = r, tagged: Any = tagged, label: str = label
            ) -> list[float]:
                """ms per task of ``repeats`` maps of N tasks, in one flow (one cluster start)."""

                @flow(task_runner=r.make(), log_prints=False)
                def overhead_flow() -> list[float]:
                    # provisioning (every worker: a profile grows one worker at a time as tasks
                    # queue) is cold start, measured apart, not per-task overhead
                    out = []
                    with r.around():
                        [f.result() for f in tagged.map(range(WARM_TASKS))]
                        _pool_refilled()
                        for i in range(repeats):
                            _server_caught_up(WARM_TASKS + i * n)
                            t0 = time.perf_counter()
                            values = [f.result() for f in tagged.map(range(n))]
                            seconds = time.perf_counter() - t0
                            if values != [i + 1 for i in range(n)]:
                                raise RuntimeError(f"{label}: wrong results")
                            out.append(seconds * 1000 / n)
                    return out

                if quiet:
                    _machine_quiet()
                return overhead_flow()

            once(20, 1)  # warm-up: imports and Prefect's first-flow costs are not per-task overhead
            for n in sizes:
                times = once(n, repeats)
                results.setdefault(str(n), {})[label] = times
                print(f"  N={n:<6} {label:42s} median {spread(times)['median']:8.2f} ms/task", flush=True)
    return {
        "sizes": sizes,
        "repeats": repeats,
        "machine": machine(),
        "ms_per_task": results,
        "skipped": skipped,
    }


def summary(res: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """Per N and runner: spread, ratio to the thread pool and speed-up over DaskTaskRunner."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for n, by_label in res["ms_per_task"].items():
        med = {k: spread(v)["median"] for k, v in by_label.items()}
        out[n] = {
            k: {**spread(v), "vs_threads": med[k] / med[THREADS], "dask_speedup": med[DASK] / med[k]}
            for k, v in by_label.items()
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="write raw results here")
    args = parser.parse_args()
    setup()
    res = run(args.n, args.repeats)
    res["summary"] = summary(res)
    write_json(args.json, res)


if __name__ == "__main__":
    main()
