"""The production set-up for the Prefect server (docs/operations.md, "A Prefect server that holds the
load"): PostgreSQL and Redis from Debian's packages, started by infra/postgres/up.sh and
infra/redis/up.sh on 127.0.0.1, a Prefect server on both (its messaging on Redis streams,
prefect-redis; the API and its services in two processes), and a gpu-tasks flow whose every task
run and state event the server records."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from faults._procs import clean_env, free_port, run_flow_script, running_server, wait_gone

from bench.production import stored_events
from gpu_tasks.prefect_api.server import die_with_parent_hook

ROOT = Path(__file__).resolve().parent.parent
TASKS = 24

SCRIPT = textwrap.dedent(
    f"""
    from prefect import flow, task
    from gpu_tasks import ProfileTaskRunner, ResourceProfile, profile

    @task(tags=[profile("quarter")])
    def square(x):
        return x * x

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="quarter", gpus=0.25)]))
    def on_postgres():
        return sum(f.result() for f in square.map(range({TASKS})))

    if __name__ == "__main__":
        print("RESULT", on_postgres())
    """
)


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "infra/postgres/up.sh runs as root (it installs and starts Debian's postgresql)"
    if shutil.which("runuser") is None:
        return "runuser is missing"
    return None


@pytest.fixture
def postgres():
    if why := _why_not():
        pytest.skip(why)
    base = Path(tempfile.mkdtemp(prefix="gpu-tasks-pg-"))  # not under pytest's 0700 tmp: postgres reads it
    base.chmod(0o755)
    env = {**os.environ, "PG_DIR": str(base / "pg"), "PG_PORT": str(free_port())}
    up = subprocess.run(
        [str(ROOT / "infra/postgres/up.sh")], env=env, capture_output=True, text=True, timeout=300
    )
    assert up.returncode == 0, up.stderr[-2000:]
    [line] = [x for x in up.stdout.splitlines() if x.startswith("PREFECT_API_DATABASE_CONNECTION_URL=")]
    try:
        yield line.split("=", 1)[1]
    finally:
        subprocess.run([str(ROOT / "infra/postgres/down.sh")], env={**env, "PG_CLEAN": "1"}, timeout=60)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def redis_messaging():
    """Redis by infra/redis/up.sh on a free port: the Prefect settings it printed."""
    if why := _why_not():
        pytest.skip(why)
    base = Path(tempfile.mkdtemp(prefix="gpu-tasks-redis-"))
    base.chmod(0o755)
    env = {**os.environ, "REDIS_DIR": str(base / "redis"), "REDIS_PORT": str(free_port())}
    up = subprocess.run(
        [str(ROOT / "infra/redis/up.sh")], env=env, capture_output=True, text=True, timeout=300
    )
    assert up.returncode == 0, up.stderr[-2000:]
    settings = dict(line.split("=", 1) for line in up.stdout.splitlines() if line.startswith("PREFECT_"))
    assert settings["PREFECT_MESSAGING_BROKER"] == "prefect_redis.messaging", up.stdout
    try:
        yield settings
    finally:
        subprocess.run([str(ROOT / "infra/redis/down.sh")], env={**env, "REDIS_CLEAN": "1"}, timeout=60)
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.timeout(300)
def test_a_flow_on_a_prefect_server_on_postgresql_and_redis_records_every_task_run(
    tmp_path: Path, postgres: str, redis_messaging: dict[str, str]
):
    import httpx
    import redis

    marker = f"pg-{uuid.uuid4().hex[:8]}"
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    from bench.production import server_settings

    server_env = clean_env(
        marker,
        PREFECT_HOME=str(tmp_path / "server-home"),
        PREFECT_UI_ENABLED="false",
        PREFECT_API_DATABASE_CONNECTION_URL=postgres,
        **redis_messaging,
        **server_settings(),  # infra/prefect-server.env: the services write in batches
    )
    prefect = [sys.executable, "-m", "prefect", "server"]
    # as docs/operations.md starts it: the API in one process, the services (the task-run recorder
    # and event persister that write what the flow reports) in another, meeting in Redis streams
    api = [*prefect, "start", "--host", "127.0.0.1", "--port", str(port), "--no-services"]
    services = subprocess.Popen(
        [*prefect, "services", "start"],
        env=server_env,
        stdout=(tmp_path / "services.log").open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=die_with_parent_hook(),  # gone with this process, as running_server's server
    )
    with running_server(api, server_env, url), contextlib.ExitStack() as stop:
        stop.callback(services.wait, 30)
        stop.callback(services.terminate)
        out = run_flow_script(tmp_path, "on_postgres.py", SCRIPT, marker, url, 240)
        assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
        assert f"RESULT {sum(x * x for x in range(TASKS))}" in out.stdout
        # the services process records the task runs from their events (through Redis, in batches):
        # a moment after the flow script ended
        deadline = time.monotonic() + 60
        while True:
            runs = httpx.post(f"{url}/task_runs/filter", json={"limit": 200}, timeout=30).json()
            squares = [r for r in runs if r["name"].startswith("square")]
            states = sorted({r["state_type"] for r in squares})
            if (len(squares) == TASKS and states == ["COMPLETED"]) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert len(squares) == TASKS and states == ["COMPLETED"], (len(squares), states)
        # the server's database is the PostgreSQL one (not a SQLite file under PREFECT_HOME)
        assert not list((tmp_path / "server-home").glob("*.db")), list((tmp_path / "server-home").iterdir())
        # its events went through Redis streams and reached the database: each task run's Completed
        completed = stored_events(url, "prefect.task-run.Completed", "2000-01-01T00:00:00Z", TASKS)
        assert completed >= TASKS, completed
        stream = redis.Redis(port=int(redis_messaging["PREFECT_REDIS_MESSAGING_PORT"]))
        groups = {g["name"].decode(): g for g in stream.xinfo_groups("events")}
        assert groups and all(g["entries-read"] >= TASKS for g in groups.values()), groups
        assert services.poll() is None, (tmp_path / "services.log").read_text()[-3000:]
    assert wait_gone(marker, 20)[1] == [], "processes outlived the flow run and the server"


PUBLISH = textwrap.dedent(
    """
    import asyncio, json, sys, uuid
    from datetime import timedelta

    from prefect_redis.client import get_async_redis_client
    from prefect_redis.messaging import Cache, Publisher

    N, GAP = 1000, 0.0002  # events arriving on the API's websocket a fraction of a millisecond apart

    async def publish(make, n, before_close=0):
        topic = f"events-{uuid.uuid4().hex[:8]}"
        redis = get_async_redis_client()
        async with make(topic) as pub:
            for i in range(n):
                await pub.publish_data(b"{}", {"id": str(uuid.uuid4())})
                await asyncio.sleep(GAP)
            written = await redis.xlen(topic)  # the stream (one Redis, not a cluster); before the close
        return {"batch": pub.batch_size, "every": pub.publish_every.total_seconds(), "written": written,
                "stored": await redis.xlen(topic)}

    async def main():
        # as the server's API builds its events publisher (prefect.server.events.messaging):
        # batch size and flush period from the environment
        configured = lambda topic: Publisher(topic, Cache(topic=topic), deduplicate_by="id")
        # prefect-redis's periodic flush, every 5 ms instead of 10 s, and batches larger than the
        # default 5, so that it is the periodic flush that writes (the race is the same at 5, rarer)
        ticking = lambda topic: Publisher(topic, Cache(topic=topic), deduplicate_by="id", batch_size=100,
                                          publish_every=timedelta(seconds=0.005))
        # the loss is a race: up to five tries, stopping at the first that loses an event
        tries = []
        while len(tries) < 5 and not any(t["stored"] < N for t in tries):
            tries.append(await publish(ticking, N))
        print(json.dumps({"few": await publish(configured, 3), "configured": await publish(configured, N),
                          "ticking": tries}))

    asyncio.run(main())
    """
)


@pytest.mark.timeout(180)
def test_the_api_writes_each_event_to_redis_as_it_arrives_and_loses_none(
    redis_messaging: dict[str, str],
):
    """prefect-redis's publisher (the API's path from a flow's or worker's websocket into Redis)
    batches events and flushes a partial batch every PUBLISH_EVERY; an event that arrives while that
    flush waits on Redis is cleared with the batch and never written (prefect-redis 0.3.0: seen as
    1-2 task runs of 100,000 left Running, their Completed events in no stream). The production
    set-up (infra/prefect-server.env) writes each event as it arrives, with no periodic flush."""
    import json

    from bench.production import server_settings

    out = subprocess.run(
        [sys.executable, "-c", PUBLISH],
        env=clean_env("redis-publisher", **redis_messaging, **server_settings()),
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    few, configured, ticking = res["few"], res["configured"], res["ticking"]
    lost = [t["stored"] for t in ticking]
    print(f"as configured: {configured['stored']} of 1000 written; with a 5 ms flush, per try: {lost}")
    assert configured["batch"] == 1 and configured["every"] >= 86400, configured
    # each event is in Redis before the publisher closes: nothing waits for a batch or a period
    assert few["written"] == few["stored"] == 3, few
    assert configured["stored"] == 1000, configured
    # the race the settings avoid: a periodic flush loses events published meanwhile, in one try of
    # five at least (a clean-clone run once saw none lost in a single try; if five in a row lose
    # none, prefect-redis has likely fixed it: the settings' comment in infra/ can say so)
    assert any(n < 1000 for n in lost), ticking


@pytest.mark.timeout(300)
def test_the_benchmarks_database_is_dropped_and_a_postgresql_they_started_is_stopped(
    monkeypatch: pytest.MonkeyPatch,
):
    """bench.production's database of a run: dropped afterwards, and a PostgreSQL it started is
    stopped; one that was running before stays up (an unused data directory and port, so another
    test's PostgreSQL is never touched)."""
    if why := _why_not():
        pytest.skip(why)
    from bench.production import _fresh_database, psql

    base = Path(tempfile.mkdtemp(prefix="gpu-tasks-pg-"))
    base.chmod(0o755)
    pg_dir = base / "pg"
    monkeypatch.setenv("PG_DIR", str(pg_dir))
    monkeypatch.setenv("PG_PORT", str(free_port()))

    def databases() -> set[str]:
        out = psql("SELECT datname FROM pg_database")
        assert out.returncode == 0, out.stderr
        return set(out.stdout.split())

    def running() -> bool:
        return (pg_dir / "data" / "postmaster.pid").exists()

    try:
        with _fresh_database("bench_started") as url:
            assert url.endswith("/bench_started") and "bench_started" in databases()
        assert not running()  # it started PostgreSQL, so it stopped it
        up = subprocess.run([str(ROOT / "infra/postgres/up.sh")], capture_output=True, text=True, timeout=300)
        assert up.returncode == 0, up.stderr[-2000:]
        assert "bench_started" not in databases()
        with _fresh_database("bench_kept_up"):
            assert "bench_kept_up" in databases()
        assert running() and not {"bench_started", "bench_kept_up"} & databases()
    finally:
        subprocess.run(
            [str(ROOT / "infra/postgres/down.sh")], env={**os.environ, "PG_CLEAN": "1"}, timeout=60
        )
        shutil.rmtree(base, ignore_errors=True)
