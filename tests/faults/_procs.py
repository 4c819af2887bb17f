"""Helpers for fault tests: run a flow script as a user would, find its processes, read the server's records."""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import psutil


def clean_env(marker: str, **extra: str) -> dict[str, str]:
    """This environment less gpu-tasks and Prefect API settings, plus a marker every child inherits."""
    env = {k: v for k, v in os.environ.items()
           if k == "GPU_TASKS_LEASE_DIR" or not k.startswith(("GPU_TASKS_", "PREFECT_API_URL"))}
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    env["GPU_TASKS_TEST_MARKER"] = marker
    env.update(extra)
    return env


def marked(marker: str) -> list[psutil.Process]:
    """Live processes whose environment carries ``GPU_TASKS_TEST_MARKER=marker``."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get("GPU_TASKS_TEST_MARKER") == marker:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def wait_gone(marker: str, timeout: float) -> tuple[float, list[str]]:
    """Seconds until no marked process is left (or ``timeout``), and the command lines of any left."""
    t0 = time.monotonic()
    while True:
        left = marked(marker)
        if not left or time.monotonic() - t0 >= timeout:
            break
        time.sleep(0.1)
    lines = []
    for p in left:
        try:
            lines.append(" ".join(p.cmdline())[:160])
        except psutil.Error:
            continue
    return time.monotonic() - t0, lines


def kill_marked(marker: str) -> None:
    """SIGKILL whatever a failed test left behind."""
    for p in marked(marker):
        try:
            p.kill()
        except psutil.Error:
            continue


def db_rows(db: Path, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    """Rows of ``sql`` in a stopped Prefect server's SQLite database."""
    con = sqlite3.connect(str(db))
    try:
        return list(con.execute(sql, args))
    finally:
        con.close()
