"""Per-task overhead: the same N trivial tasks through four task runners, in one run.

    python -m bench.overhead [--n 100 1000] [--repeats 3] [--json out.json]

Times ``inc.map(range(N))`` through Prefect's ThreadPoolTaskRunner, prefect-dask's
DaskTaskRunner and ProfileTaskRunner (a CPU profile: threads in the flow process;
and a ``gpus=0.25`` profile on emulated devices: Dask worker processes). Eight warm-up
tasks first in every flow bring up every worker, so cluster start-up (cold start,
measured apart) is not counted as per-task overhead.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from bench.common import machine, setup, spread, write_json

THREADS = "ThreadPoolTaskRunner"
DASK = "DaskTaskRunner"
PROFILE_CPU = "ProfileTaskRunner, CPU profile"
PROFILE_GPU = "ProfileTaskRunner, gpus=0.25 profile"
WARM_TASKS = 8  # enough to bring up every worker: 2 emulated devices x 4 quarter-device slots


def runners(n_gpu: int) -> dict[str, tuple[Callable[[], Any], str | None]]:
    """Label -> (runner factory, profile tag or None); labels are stable keys of the results."""
    from prefect.task_runners import ThreadPoolTaskRunner
    from prefect_dask import DaskTaskRunner

    from gpu_tasks import ProfileTaskRunner, ResourceProfile

    cpu = ResourceProfile(name="cpu", cpus=0.25)  # 8 threads on a 2-core machine, as the thread pool
    return {
        THREADS: (lambda: ThreadPoolTaskRunner(max_workers=8), None),
        DASK: (
            lambda: DaskTaskRunner(
                cluster_kwargs={
                    "n_workers": 2,
                    "threads_per_worker": 2,
                    "processes": True,
                    "dashboard_address": None,
                    "host": "127.0.0.1",
                }
            ),
            None,
        ),
        PROFILE_CPU: (lambda: ProfileTaskRunner(profiles=[cpu], idle_timeout=600), None),
        PROFILE_GPU: (
            lambda: ProfileTaskRunner(
                profiles=[cpu, ResourceProfile(name="quarter", gpus=0.25, max_workers=n_gpu)],
                default="cpu",
                idle_timeout=600,
            ),
            "quarter",
        ),
    }


def run(sizes: list[int], repeats: int) -> dict[str, Any]:
    """ms per task for each runner and N: ``{"ms_per_task": {str(N): {label: [..]}}}``."""
    from prefect import flow, task

    from gpu_tasks import profile
    from gpu_tasks._server import embedded_server

    @task
    def inc(x: int) -> int:
        return x + 1

    results: dict[str, dict[str, list[float]]] = {}
    with embedded_server():
        for label, (make, tag) in runners(2).items():
            tagged = inc.with_options(tags=[profile(tag)]) if tag else inc

            # the loop's values bound now (once runs within this iteration anyway)
            def once(n: int, make: Any = make, tagged: Any = tagged, label: str = label) -> float:
                @flow(task_runner=make(), log_prints=False)
                def overhead_flow() -> tuple[float, list[int]]:
                    # provisioning (every worker: a profile grows one worker at a time as tasks
                    # queue) is cold start, measured apart, not per-task overhead
                    [f.result() for f in tagged.map(range(WARM_TASKS))]
                    t0 = time.perf_counter()
                    values = [f.result() for f in tagged.map(range(n))]
                    return time.perf_counter() - t0, values

                seconds, values = overhead_flow()
                if values != [i + 1 for i in range(n)]:
                    raise RuntimeError(f"{label}: wrong results")
                return seconds * 1000 / n

            once(20)  # warm-up: imports and Prefect's first-flow costs are not per-task overhead
            for n in sizes:
                times = [once(n) for _ in range(repeats)]
                results.setdefault(str(n), {})[label] = times
                print(f"  N={n:<6} {label:42s} median {spread(times)['median']:8.2f} ms/task", flush=True)
    return {"sizes": sizes, "repeats": repeats, "machine": machine(), "ms_per_task": results}


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
