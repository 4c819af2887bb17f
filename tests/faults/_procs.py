"""Helpers for fault tests: run a flow script as a user would, find its processes, read the server's
records."""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.procs import ctrl_c, kill_marked, marked, wait_gone

__all__ = ["clean_env", "ctrl_c", "db_rows", "kill_marked", "marked", "server_task_run", "wait_gone"]


def clean_env(marker: str, **extra: str) -> dict[str, str]:
    """This environment less gpu-tasks and Prefect API settings, plus a marker every child inherits."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k == "GPU_TASKS_LEASE_DIR" or not k.startswith(("GPU_TASKS_", "PREFECT_API_URL"))
    }
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    env["GPU_TASKS_TEST_MARKER"] = marker
    env.update(extra)
    return env


def db_rows(db: Path, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    """Rows of ``sql`` in a stopped Prefect server's SQLite database."""
    con = sqlite3.connect(str(db))
    try:
        return list(con.execute(sql, args))
    finally:
        con.close()


def settled(run: dict[str, Any]) -> bool:
    """Whether a task run has a final state."""
    return run.get("state_type") not in ("RUNNING", "PENDING", "SCHEDULED")


def server_task_run(
    task_run_id: Any, want: Callable[[dict[str, Any]], bool] = settled, timeout: float = 20.0
) -> dict[str, Any]:
    """The task run as the test server recorded it, once ``want`` holds (states arrive as events)."""
    from prefect_api import api

    deadline = time.monotonic() + timeout
    run: dict[str, Any] = {}
    while time.monotonic() < deadline:
        status, run = api("GET", f"/task_runs/{task_run_id}")
        if status == 200 and want(run):
            return run
        time.sleep(0.25)
    return run
