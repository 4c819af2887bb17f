"""Soak: many flow runs in one process, each provisioning a GPU profile and letting it idle out.

After each run, prints this process's open file descriptors, threads, child processes
(less multiprocessing's resource tracker) and RSS. Run standalone::

    PREFECT_API_URL=... GPU_TASKS_EMULATED_GPUS=2 python tests/faults/soak_script.py --runs 20 --json

Without ``--json`` it prints one line per run. ``tests/faults/test_soak.py`` runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import psutil

IDLE_TIMEOUT = 0.3  # the profile's cluster closes this long after its last task
IDLE_WAIT = 30.0  # the flow waits at most this long after its tasks for the cluster to idle out inside it


def figures() -> dict[str, Any]:
    """This process's fds, threads, child processes (less the resource tracker) and RSS (MB)."""
    me = psutil.Process()
    children = 0
    for p in me.children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(p.cmdline()):
                children += 1
        except psutil.Error:
            continue
    return {
        "fds": me.num_fds(),
        "threads": me.num_threads(),
        "children": children,
        "rss_mb": round(me.memory_info().rss / 2**20, 1),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the flows; returns (and prints) one figures row per run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="print all rows as one JSON list at the end")
    args = parser.parse_args(argv)
    os.environ.setdefault("GPU_TASKS_EMULATED_GPUS", "2")

    from prefect import flow, task

    from gpu_tasks import ProfileTaskRunner, ResourceProfile, profile

    @task(tags=[profile("half")])
    def square(i: int) -> int:
        return i * i

    @flow(
        task_runner=ProfileTaskRunner(
            profiles=[ResourceProfile(name="half", gpus=0.5, idle_timeout=IDLE_TIMEOUT)]
        )
    )
    def soak_run() -> dict[str, Any]:
        from prefect.context import FlowRunContext

        total = sum(f.result() for f in square.map(range(4)))
        runner = FlowRunContext.get().task_runner
        deadline = time.monotonic() + IDLE_WAIT
        while runner.status()["half"]["state"] != "closed" and time.monotonic() < deadline:
            time.sleep(0.02)
        return {"total": total, "state_after_idle": runner.status()["half"]["state"]}

    rows = []
    for run in range(1, args.runs + 1):
        t0 = time.monotonic()
        out = soak_run()
        assert out["total"] == 14, out
        row = {"run": run, "seconds": round(time.monotonic() - t0, 2), **out, **figures()}
        rows.append(row)
        if not args.json:
            print(json.dumps(row), flush=True)
    if args.json:
        print(json.dumps(rows), flush=True)
    return rows


if __name__ == "__main__":
    main()
    sys.exit(0)
