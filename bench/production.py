"""The production Prefect server for the benchmarks (``--server production``): PostgreSQL and Redis
from Debian's packages (infra/postgres/up.sh, infra/redis/up.sh, as root), a fresh database, and
``prefect server start`` on 127.0.0.1 with its messaging on Redis streams (prefect-redis): the set-up
docs/operations.md describes ("A Prefect server that holds the load"), beside the embedded SQLite
server that ``gpu-tasks example run`` and a plain script start.

``GPU_TASKS_BENCH_SPLIT_SERVICES=0``: the server's API and services in one process (default: two).
``GPU_TASKS_BENCH_SERVER_LOG=FILE``: the server's log is copied there when it stops.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from bench.common import ROOT

SERVERS = ("embedded", "production")


def _up(script: str, env: dict[str, str]) -> dict[str, str]:
    """Run an infra up script; the ``KEY=value`` lines it printed."""
    out = subprocess.run([str(ROOT / script)], env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"{script} failed: {out.stderr[-2000:]}")
    return dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def production_server(split: bool | None = None) -> Iterator[str]:
    """PostgreSQL (a fresh database) and Redis up, a Prefect server on them; ``PREFECT_API_URL``
    set in this process for the block (the benchmark's flow processes inherit it). Yields the URL.

    ``split``: the server's services in a process of their own (default: ``GPU_TASKS_BENCH_SPLIT_SERVICES``,
    ``1`` unless set to ``0``)."""
    if split is None:
        split = os.environ.get("GPU_TASKS_BENCH_SPLIT_SERVICES", "1") != "0"
    if os.geteuid() != 0:
        raise SystemExit("--server production runs infra/postgres/up.sh and infra/redis/up.sh: run as root")
    db = f"bench_{uuid.uuid4().hex[:8]}"  # a fresh database, as the embedded server's is
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    with (
        _fresh_database(db) as database,
        tempfile.TemporaryDirectory(prefix="gpu-tasks-bench-server-") as home,
        _fresh_redis(home) as messaging,
    ):
        server_env = {
            **server_settings(),  # the documented batches; the environment may override them
            **{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_URL")},
            **messaging,
            "PREFECT_API_DATABASE_CONNECTION_URL": database,
            "PREFECT_HOME": home,
            "PREFECT_UI_ENABLED": "false",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        }
        log = open(Path(home) / "server.log", "wb")
        prefect = [sys.executable, "-m", "prefect", "server"]
        # the API in one process, the services that consume the event streams (task-run recorder,
        # event persister, triggers) in another: one process for both shares one interpreter lock,
        # and its API took events in more slowly while the services wrote them (docs/operations.md)
        api = [*prefect, "start", "--host", "127.0.0.1", "--port", str(port)] + (
            ["--no-services"] if split else []
        )
        procs = [subprocess.Popen(api, env=server_env, stdout=log, stderr=subprocess.STDOUT)]
        old = os.environ.get("PREFECT_API_URL")
        try:
            _wait_healthy(procs[0], url, Path(home) / "server.log")
            if split:
                services = [*prefect, "services", "start"]
                procs.append(subprocess.Popen(services, env=server_env, stdout=log, stderr=subprocess.STDOUT))
            how = "API and services in two processes" if split else "API and services in one process"
            print(f"production server: {url} (PostgreSQL database {db}, Redis messaging, {how})", flush=True)
            os.environ["PREFECT_API_URL"] = url
            yield url
        finally:
            if old is None:
                os.environ.pop("PREFECT_API_URL", None)
            else:
                os.environ["PREFECT_API_URL"] = old
            for proc in reversed(procs):
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            log.close()
            if keep := os.environ.get("GPU_TASKS_BENCH_SERVER_LOG"):  # the log outlives the server's home
                shutil.copyfile(Path(home) / "server.log", keep)


def server_settings() -> dict[str, str]:
    """``infra/prefect-server.env``: the production set-up's service batch sizes."""
    lines = (ROOT / "infra" / "prefect-server.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


def _pg_dir() -> Path:
    return Path(os.environ.get("PG_DIR", "/tmp/gpu-tasks-postgres"))  # infra/postgres/up.sh's default


def psql(sql: str) -> subprocess.CompletedProcess[str]:
    """``sql`` as PostgreSQL's superuser on infra/postgres's server (its PG_DIR and PG_PORT)."""
    port = os.environ.get("PG_PORT", "55432")
    return subprocess.run(
        ["runuser", "-u", "postgres", "--", "psql", "-h", str(_pg_dir()), "-p", port, "-U", "postgres"]
        + ["-qtA", "-c", sql],
        capture_output=True,
        text=True,
        timeout=120,
    )


@contextlib.contextmanager
def _fresh_database(db: str) -> Iterator[str]:
    """A database and role ``db`` of their own on infra/postgres's PostgreSQL (started if it was not
    running); yields the server's connection URL. Afterwards the database and role are dropped, and
    a PostgreSQL this call started is stopped: before, each run's database stayed (3.3 GB after one
    100,000-task run of both runners, 185 MB after a 10,000-task run) and PostgreSQL kept running."""
    was_up = (_pg_dir() / "data" / "postmaster.pid").exists()
    env = {**os.environ, "PG_DB": db}
    try:
        yield _up("infra/postgres/up.sh", env)["PREFECT_API_DATABASE_CONNECTION_URL"]
    finally:
        for sql in (f"DROP DATABASE IF EXISTS {db} WITH (FORCE)", f"DROP ROLE IF EXISTS {db}"):
            out = psql(sql)
            if out.returncode != 0:
                print(f"bench: {sql!r} failed, {db} stays: {out.stderr.strip()[-300:]}", file=sys.stderr)
        if not was_up:
            subprocess.run([str(ROOT / "infra/postgres/down.sh")], env=env, capture_output=True, timeout=60)


@contextlib.contextmanager
def _fresh_redis(home: str) -> Iterator[dict[str, str]]:
    """A Redis of this server's own, stopped and removed afterwards: a fresh database beside a Redis
    that still holds another database's event streams never records a task run (its task-run
    recorder retries, forever, events whose flow runs that database lacks: foreign key violations)."""
    redis_dir = Path(home) / "redis"
    redis_dir.mkdir()
    redis_dir.chmod(0o755)
    Path(home).chmod(0o755)  # the redis user reaches its directory
    env = {**os.environ, "REDIS_DIR": str(redis_dir), "REDIS_PORT": str(_free_port())}
    try:
        yield _up("infra/redis/up.sh", env)
    finally:
        subprocess.run([str(ROOT / "infra/redis/down.sh")], env={**env, "REDIS_CLEAN": "1"}, timeout=60)


def _wait_healthy(server: subprocess.Popen[bytes], url: str, log: Path) -> None:
    import httpx

    deadline = time.monotonic() + 180
    while True:
        if server.poll() is not None:
            raise SystemExit(f"the Prefect server exited: {log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise SystemExit(f"the Prefect server did not answer in 180 s: {log.read_text()[-3000:]}")
        time.sleep(0.5)


@contextlib.contextmanager
def server(kind: str) -> Iterator[str | None]:
    """``embedded``: nothing here (each flow process starts its own, or uses ``PREFECT_API_URL``);
    ``production``: :func:`production_server`."""
    if kind == "production":
        with _terminate_unwinds(), production_server() as url:
            yield url
    else:
        yield None


@contextlib.contextmanager
def _terminate_unwinds() -> Iterator[None]:
    """SIGTERM (``kill``, ``pkill``, a timeout) raises ``SystemExit`` in the main thread for the
    block, so the server, its Redis and their processes are stopped as at a normal end (killed by
    the default SIGTERM, the benchmark left its Redis running)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    before = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def stored_events(
    url: str, name: str, since: str, expected: int, settle_s: float = 30.0, at_most_s: float = 300.0
) -> int:
    """How many events called ``name`` since ``since`` the server stored, once ``expected`` are, the
    count stops moving for ``settle_s`` (they are written after the messaging hands them on), or
    ``at_most_s`` have passed."""
    import httpx

    body = {"filter": {"event": {"name": [name]}, "occurred": {"since": since}}, "limit": 1}
    last, moved = -1, time.monotonic()
    deadline = time.monotonic() + at_most_s
    while True:
        total = int(httpx.post(f"{url}/events/filter", json=body, timeout=60).json()["total"])
        if total != last:
            last, moved = total, time.monotonic()
        if total >= expected or time.monotonic() - moved > settle_s or time.monotonic() > deadline:
            return total
        time.sleep(1.0)
