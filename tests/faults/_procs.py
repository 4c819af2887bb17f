"""Helpers for fault tests: run a flow script as a user would, find its processes, read the server's
records."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.procs import ctrl_c, kill_marked, marked, terminal_signals, wait_gone

__all__ = [
    "AUTH",
    "SEEDED_SERVER",
    "authed_server",
    "authed_task_states",
    "clean_env",
    "ctrl_c",
    "terminal_signals",
    "db_rows",
    "free_port",
    "kill_marked",
    "marked",
    "migrated_db",
    "run_flow_script",
    "running_server",
    "seed_prefect_home",
    "server_task_run",
    "wait_gone",
]


# What a Prefect server of the tests skips at its start (tests/conftest.py sets it for the whole
# session): registering Prefect's block types in its database, 2.3 s of its 7.2 s of CPU, with the
# import of every Prefect collection's package that precedes it. Nothing in gpu-tasks or its tests
# reads a block type from the server. A run on a fresh home (``clean_env(fresh_home=True)``), as on a
# new machine, goes without it: registration on, as a user's first server start has it.
SEEDED_SERVER = {
    "PREFECT_SERVER_REGISTER_BLOCKS_ON_START": "false",
    "PREFECT_SERVER_MEMOIZE_BLOCK_AUTO_REGISTRATION": "false",  # else the collections still load
}


def migrated_db() -> Path:
    """A Prefect database as ``prefect server database upgrade -y`` leaves it, for this interpreter's
    Prefect: made once per host and Prefect release (about 7 s of CPU), under a lock, so the test
    processes share it."""
    import prefect

    where = Path(tempfile.gettempdir()) / f"gpu-tasks-test-prefect-db-{prefect.__version__}"
    db = where / "prefect.db"
    if db.exists():
        return db
    with open(f"{where}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if db.exists():  # made by another test process while this one waited
            return db
        home = Path(tempfile.mkdtemp(prefix=f"{where.name}-", dir=where.parent))
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
        done = subprocess.run(
            [str(Path(sys.executable).with_name("prefect")), "server", "database", "upgrade", "-y"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            raise RuntimeError(f"prefect server database upgrade failed: {done.stdout}{done.stderr}")
        home.rename(where)  # whole or not at all
    return db


def seed_prefect_home(home: Path) -> None:
    """Give a new PREFECT_HOME the migrated database (:func:`migrated_db`) a user's home has after
    its first server start: each server a test starts on a fresh home otherwise runs every migration
    again (about 4.6 s of CPU and 5 s of wall on the 2-core machine). An existing database is kept."""
    if (home / "prefect.db").exists():
        return
    home.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(migrated_db(), home / "prefect.db")


def clean_env(marker: str, fresh_home: bool = False, **extra: str) -> dict[str, str]:
    """This environment less gpu-tasks and Prefect API settings, plus a marker every child inherits.

    A ``PREFECT_HOME`` given in ``extra`` gets the migrated database (:func:`seed_prefect_home`)
    unless ``fresh_home`` (a run on a home with no database at all, as on a new machine: its server
    also registers Prefect's block types, :data:`SEEDED_SERVER`) or a database of its own is named
    (``PREFECT_API_DATABASE_CONNECTION_URL``)."""
    own_db = "PREFECT_API_DATABASE_CONNECTION_URL" in extra
    if "PREFECT_HOME" in extra and not (fresh_home or own_db):
        seed_prefect_home(Path(extra["PREFECT_HOME"]))
    env = {
        k: v
        for k, v in os.environ.items()
        if k in ("GPU_TASKS_LEASE_DIR", "GPU_TASKS_PRESENCE_DIR")
        or not k.startswith(("GPU_TASKS_", "PREFECT_API_URL"))
    }
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    if fresh_home:
        for k in SEEDED_SERVER:
            env.pop(k, None)
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
    return run.get("state_type") not in (None, "RUNNING", "PENDING", "SCHEDULED")


def server_task_run(
    task_run_id: Any, want: Callable[[dict[str, Any]], bool] = settled, timeout: float = 20.0
) -> dict[str, Any]:
    """The task run as the test server recorded it, once ``want`` holds (states arrive as events;
    a batched recorder writes the run and its state a moment later: 404, or no ``state`` yet)."""
    from prefect_api import api

    deadline = time.monotonic() + timeout
    run: dict[str, Any] = {}
    while time.monotonic() < deadline:
        status, run = api("GET", f"/task_runs/{task_run_id}")
        if status == 200 and run.get("state") and want(run):
            return run
        time.sleep(0.25)
    return run


AUTH = "gpu-tasks:s3cret"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running_server(command: list[str], env: dict[str, str], url: str) -> Iterator[None]:
    """A Prefect server process started with ``command``, once ``url``/health answers; stopped at the
    end of the block. It dies with this process too (Linux), so a test ended by its timeout (which
    ends the test process, skipping the block's end) leaves no server behind."""
    import subprocess

    import httpx

    from gpu_tasks.prefect_api.server import die_with_parent_hook

    server = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=die_with_parent_hook(),
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, "the Prefect server exited"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the Prefect server did not start"
            time.sleep(0.5)
        yield
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()


def run_flow_script(
    tmp_path: Path, name: str, source: str, marker: str, api_url: str, timeout: float, **env: str
) -> Any:
    """Write ``source`` to ``tmp_path/name`` and run it as a user would, reporting to ``api_url``, on one
    emulated H100 (``env`` adds to its environment); the ``CompletedProcess``."""
    import subprocess
    import sys

    script = tmp_path / name
    script.write_text(source)
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=clean_env(
            marker,
            PREFECT_API_URL=api_url,
            PREFECT_HOME=str(tmp_path / "flow-home"),
            GPU_TASKS_EMULATED_GPUS="H100:80GiB",
            **env,
        ),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@contextlib.contextmanager
def authed_server(tmp_path: Path, marker: str) -> Iterator[str]:
    """A ``prefect server start`` on 127.0.0.1 that requires ``AUTH`` (basic auth); its API URL.

    Checked to refuse requests without the credentials; stopped at the end of the block.
    """
    import sys

    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    command = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    env = clean_env(
        marker,
        PREFECT_HOME=str(tmp_path / "server-home"),
        PREFECT_SERVER_API_AUTH_STRING=AUTH,
        PREFECT_UI_ENABLED="false",
    )
    with running_server(command, env, url):
        # the server refuses requests without the credentials
        assert httpx.post(f"{url}/flow_runs/filter", json={}, timeout=10).status_code == 401
        yield url


def authed_task_states(
    url: str, flow_run_id: str, want: list[str], timeout: float = 30.0
) -> list[dict[str, Any]]:
    """The flow run's task runs on the authenticated server, once their state types are ``want`` (sorted)."""
    import httpx

    user, password = AUTH.split(":")
    deadline = time.monotonic() + timeout
    while True:
        runs: list[dict[str, Any]] = httpx.post(
            f"{url}/task_runs/filter",
            auth=(user, password),
            timeout=10,
            json={"flow_runs": {"id": {"any_": [flow_run_id]}}},
        ).json()
        if sorted(r["state_type"] for r in runs) == want or time.monotonic() > deadline:
            return runs
        time.sleep(0.5)
