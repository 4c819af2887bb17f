"""Per-task overhead: the same N trivial tasks through three task runners, in one run.

    python bench/overhead.py [--n 500] [--repeats 3] [--json out.json]

Prints milliseconds per task for ThreadPoolTaskRunner, prefect-dask's DaskTaskRunner
and ProfileTaskRunner (CPU profile in the flow process, and an emulated-GPU profile
with worker processes), and the ratios between them. Uses a temporary Prefect
server on 127.0.0.1 (the test harness). Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")


def _runners(n_gpu: int) -> dict[str, Callable[[], Any]]:
    from prefect.task_runners import ThreadPoolTaskRunner
    from prefect_dask import DaskTaskRunner

    from gpu_tasks import ProfileTaskRunner, ResourceProfile

    return {
        "ThreadPoolTaskRunner(max_workers=8)": lambda: ThreadPoolTaskRunner(max_workers=8),
        "DaskTaskRunner(2 processes x 2 threads)": lambda: DaskTaskRunner(
            cluster_kwargs={"n_workers": 2, "threads_per_worker": 2, "processes": True,
                            "dashboard_address": "127.0.0.1:0", "host": "127.0.0.1"}
        ),
        "ProfileTaskRunner(cpu profile)": lambda: ProfileTaskRunner(
            profiles=[ResourceProfile(name="cpu", cpus=0.25)], idle_timeout=600
        ),
        f"ProfileTaskRunner(gpus=0.25 profile, {n_gpu} emulated devices)": lambda: ProfileTaskRunner(
            profiles=[ResourceProfile(name="cpu", cpus=0.25), ResourceProfile(name="q", gpus=0.25, max_workers=n_gpu)],
            default="cpu", idle_timeout=600,
        ),
    }


def run(n: int, repeats: int) -> dict[str, Any]:
    """Time ``inc.map(range(n))`` through each runner; returns the raw results."""
    from prefect import flow, task
    from prefect.testing.utilities import prefect_test_harness

    from gpu_tasks import profile

    os.environ.setdefault("GPU_TASKS_EMULATED_GPUS", "2")

    @task
    def inc(x: int) -> int:
        return x + 1

    results: dict[str, list[float]] = {}
    with prefect_test_harness():
        for label, make in _runners(2).items():
            tagged = inc.with_options(tags=[profile("q")]) if "gpus=" in label else inc
            for _ in range(repeats + 1):  # first round warms up (cluster start, imports)

                @flow(task_runner=make(), log_prints=False)
                def bench_flow() -> tuple[float, list[int]]:
                    warm = tagged.submit(0)
                    warm.result()  # provisioning is cold start, not per-task overhead
                    t0 = time.perf_counter()
                    futures = tagged.map(range(n))
                    values = [f.result() for f in futures]
                    return time.perf_counter() - t0, values

                seconds, values = bench_flow()
                assert values == [i + 1 for i in range(n)], label
                results.setdefault(label, []).append(seconds * 1000 / n)
            results[label] = results[label][1:]
            print(f"{label:60s} {statistics.median(results[label]):8.2f} ms/task", flush=True)
    return {
        "n": n, "repeats": repeats, "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "ms_per_task": results,
    }


def report(res: dict[str, Any]) -> str:
    """Markdown table with min/median/max and ratios against the thread pool and Dask."""
    med = {k: statistics.median(v) for k, v in res["ms_per_task"].items()}
    base = next(k for k in med if k.startswith("ThreadPool"))
    dask = next(k for k in med if k.startswith("DaskTaskRunner"))
    lines = [
        f"N = {res['n']} trivial tasks, {res['repeats']} repeats after one warm-up, {res['machine']}",
        "",
        "| runner | min ms/task | median | max | vs ThreadPool | DaskTaskRunner / this |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for k, v in res["ms_per_task"].items():
        lines.append(
            f"| {k} | {min(v):.2f} | {med[k]:.2f} | {max(v):.2f} | {med[k] / med[base]:.2f}x | {med[dask] / med[k]:.1f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="write raw results here")
    args = parser.parse_args()
    res = run(args.n, args.repeats)
    print()
    print(report(res))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)


if __name__ == "__main__":
    main()
