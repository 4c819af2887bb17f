"""The embedded Prefect server (prefect_api.server.embedded_server) in fresh processes, as scripts use it."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

from faults._procs import clean_env

from gpu_tasks.prefect_api.server import RECORDER_BATCH

IDLE_CLOSE_SCRIPT = """
import json, time
from prefect import flow, task
from prefect.context import FlowRunContext
from gpu_tasks import ProfileTaskRunner, ResourceProfile, profile
from gpu_tasks.prefect_api.server import embedded_server

@task(tags=[profile("gpu")])
def quick() -> int:
    return 1

@flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="gpu", gpus=1, idle_timeout=0.3)]))
def f() -> str:
    quick.submit().result()
    runner = FlowRunContext.get().task_runner
    deadline = time.monotonic() + 30
    while runner.status()["gpu"]["state"] != "closed" and time.monotonic() < deadline:
        time.sleep(0.05)
    return str(FlowRunContext.get().flow_run.id)

if __name__ == "__main__":
    with embedded_server() as url:
        run_id = f()
        from prefect.events.worker import EventsWorker
        EventsWorker.drain_all(timeout=10)
        from prefect.client.orchestration import get_client
        reasons = []
        for _ in range(40):
            with get_client(sync_client=True) as client:
                r = client._client.post("/events/filter", json={"filter": {
                    "event": {"prefix": ["gpu-tasks.cluster.closed"]},
                    "occurred": {"since": "2000-01-01T00:00:00Z"},
                    "related": {"resources_in_roles": [[f"prefect.flow-run.{run_id}", "flow-run"]]}}})
            reasons = [e["payload"]["reason"] for e in r.json()["events"]]
            if len(reasons) >= 2:
                break
            time.sleep(0.25)
        from prefect.settings import get_current_settings
        with get_client(sync_client=True) as client:
            server_settings = client._client.get("/admin/settings").json()
        print(json.dumps({"url": url, "reasons": reasons,
                          "server_db_timeout": server_settings["server"]["database"]["timeout"],
                          "server_analytics": server_settings["server"]["analytics_enabled"],
                          "recorder": server_settings["server"]["services"]["task_run_recorder"],
                          "client_max_retries": get_current_settings().client.max_retries}))
"""


def test_idle_close_events_reach_the_embedded_server(tmp_path: Path):
    """The embedded server is tuned for many short tasks (its recorder batched, the user's own
    settings kept) and sends no telemetry, and an idle
    scale-down runs on a runner thread; its events still reach the flow run's server when that
    server's URL lives in a settings context (embedded server), not the environment, and no
    second, ephemeral Prefect server is started for them."""
    script = tmp_path / "idle_close.py"
    script.write_text(IDLE_CLOSE_SCRIPT)
    env = clean_env(
        uuid.uuid4().hex,
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        GPU_TASKS_EMULATED_GPUS="1",
        PREFECT_LOGGING_LEVEL="INFO",
        PREFECT_SERVER_ANALYTICS_ENABLED="true",  # Prefect's default: the embedded server turns it off
        PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL="2",  # the user's own: kept
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    port = out["url"].split(":")[2].split("/")[0]
    other_servers = [
        line
        for line in proc.stderr.splitlines()
        if "temporary server on http" in line and f"127.0.0.1:{port}" not in line
    ]
    assert not other_servers, other_servers[:5]
    assert any(r.startswith("scaled down: idle") for r in out["reasons"]), out
    # the embedded SQLite server waits on its writer instead of answering 503 under load
    assert out["server_db_timeout"] == 60 and out["client_max_retries"] == 10, out
    # its task-run recorder writes states in batches (Prefect's default: one transaction each), at
    # the flush interval the user set
    recorder = out["recorder"]
    assert (recorder["batch_size"], recorder["flush_interval"]) == (RECORDER_BATCH, 2), out
    # and nothing phones home: no usage telemetry from the server gpu-tasks started
    assert out["server_analytics"] is False, out
    assert "telemetry" not in proc.stderr.lower(), proc.stderr[-3000:]


RECORDED_SCRIPT = """
import os, sqlite3, json
from prefect import flow, task
from gpu_tasks.prefect_api.server import embedded_server

@task
def inc(x):
    return x + 1

@flow
def many():
    return sum(x.result() for x in inc.map(range(300)))

if __name__ == "__main__":
    with embedded_server():
        many()
    con = sqlite3.connect(os.path.join(os.environ["PREFECT_HOME"], "prefect.db"))
    rows = con.execute("select state_type, count(*) from task_run group by state_type").fetchall()
    print(json.dumps(dict(rows)))
"""


def test_embedded_server_stops_only_after_recording_every_task_run(tmp_path: Path):
    """A flow of many short tasks that ends at once: the server records each task run's final
    state before it is stopped (stopped at once, it had recorded a few of 300, some 'Running')."""
    script = tmp_path / "many.py"
    script.write_text(RECORDED_SCRIPT)
    env = clean_env(uuid.uuid4().hex, PREFECT_HOME=str(tmp_path / "prefect-home"))
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"COMPLETED": 300}


def test_waiting_for_records_ignores_task_runs_older_than_the_server(prefect_server):
    """A task run left Running in the database by a process killed long ago (the embedded
    server's database outlives runs) must not hold every later `gpu-tasks example run` for 15 s."""
    import datetime
    import time

    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.states import Running

    from gpu_tasks.prefect_api.server import _wait_until_recorded

    @task
    def stale() -> None: ...

    @flow
    def killed_long_ago() -> None: ...

    before = datetime.datetime.now(datetime.UTC)
    with get_client(sync_client=True) as client:
        run = client.create_flow_run(killed_long_ago)
        stuck = client.create_task_run(stale, run.id, dynamic_key="0", state=Running())
        assert client.read_task_run(stuck.id).state_type.value == "RUNNING"
    time.sleep(0.05)
    after = datetime.datetime.now(datetime.UTC)
    assert _wait_until_recorded(timeout=30, since=after), "a task run older than the server held the wait"
    assert not _wait_until_recorded(timeout=0.5, since=before), "the Running task run was not counted"


def test_waiting_for_a_flow_runs_records_ends_when_its_running_task_runs_are_recorded(prefect_server):
    """The wait on Prefect's ephemeral server at a flow run's end (wait_until_flow_run_recorded):
    it holds while a task run of that flow run is recorded Running, ends once that one's final
    state is recorded, and a Running task run of another flow run does not hold it."""
    import threading
    import time

    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.states import Completed, Running

    from gpu_tasks.prefect_api.server import wait_until_flow_run_recorded

    @task
    def late() -> None: ...

    @flow
    def ending() -> None: ...

    with get_client(sync_client=True) as client:
        run, other = client.create_flow_run(ending), client.create_flow_run(ending)
        mine = client.create_task_run(late, run.id, dynamic_key="0", state=Running())
        client.create_task_run(late, other.id, dynamic_key="0", state=Running())
        assert not wait_until_flow_run_recorded(run.id, timeout=30, stall=1.0), (
            "a Running task run was not counted"
        )

        def record_late() -> None:
            time.sleep(1.5)
            with get_client(sync_client=True) as late_client:
                late_client.set_task_run_state(mine.id, Completed(), force=True)

        recorder = threading.Thread(target=record_late)
        recorder.start()
        t0 = time.monotonic()
        assert wait_until_flow_run_recorded(run.id, timeout=30, stall=10.0)
        waited = time.monotonic() - t0
        recorder.join()
    assert waited >= 1.5, f"the wait ended {waited:.2f} s in, before the task run's final state was recorded"


def test_dropped_event_messages_are_counted_passed_over_and_reported(caplog, capfdbinary):
    """The embedded server's stderr goes through DroppedEvents: Prefect's own "queue is full" warning
    (made here by its in-memory messaging, as the server makes it under load) is counted, logged once
    at the first drop and as a total at the end, never repeated per message; other lines pass through."""
    import asyncio
    import logging

    from prefect.server.utilities.messaging import memory

    from gpu_tasks.prefect_api.server import LOAD_DOCS, DroppedEvents

    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    async def overflow() -> None:
        sub = memory.Subscription(memory.Topic("events"))
        while True:  # fill its queue as a busy server's consumers leave it
            try:
                sub._queue.put_nowait(memory.MemoryMessage(data=b"x", attributes={}))
            except asyncio.QueueFull:
                break
        for _ in range(3):
            await sub.deliver(memory.MemoryMessage(data=b"x", attributes={}))

    handler = Lines()
    memory.logger.addHandler(handler)
    try:
        asyncio.run(overflow())
    finally:
        memory.logger.removeHandler(handler)
    assert len(lines) == 3, lines
    dropped = DroppedEvents()
    with caplog.at_level(logging.WARNING, logger="gpu_tasks.server"):
        dropped.line(b"INFO: some other server line\n")
        for line in lines:
            dropped.line(line.encode() + b"\n")
        assert dropped.count == 3
        first = [r.getMessage() for r in caplog.records if r.name == "gpu_tasks.server"]
        assert len(first) == 1 and "dropping event messages" in first[0] and LOAD_DOCS in first[0]
        dropped.report()
    said = [r.getMessage() for r in caplog.records if r.name == "gpu_tasks.server"]
    assert len(said) == 2 and "dropped 3 event message(s)" in said[1] and LOAD_DOCS in said[1]
    err = capfdbinary.readouterr().err
    assert b"some other server line" in err and b"Subscription queue is full" not in err
