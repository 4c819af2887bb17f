"""Why a task waits, end to end: the device queue works out the reason, writes it next to its waiter
file (``gpu-tasks waiters``), tells the dispatching controller, which puts it in the waiting task
run's Prefect log and sends ``gpu-tasks.task.waiting``.

Every test has its own lease directory (the ``lease_dir`` fixture); flow runs are real processes
against the session's Prefect server, on one emulated device.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from prefect_api import api, flow_run_events
from test_lease_queue import _until
from test_leases import _env, _stop
from test_priority import HOLDING_RUN, _script
from typer.testing import CliRunner

from gpu_tasks.cli import app
from gpu_tasks.devices import leases, wait_reasons
from gpu_tasks.devices.book import DeviceBook
from gpu_tasks.devices.discovery import Device

DEV0 = (Device(address="0", index=0, name="EMU"),)
DEV1 = (Device(address="1", index=1, name="EMU"),)

# A flow run whose GPU task waits for emulated device 0 (HOLDING_RUN holds it); writes its flow run's
# and its task run's ids as soon as it has them
WAITING_RUN = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from prefect import flow, task
    from prefect.runtime import flow_run
    from gpu_tasks import ProfileTaskRunner, ResourceProfile, profile

    OUT = Path(sys.argv[1])

    @task(tags=[profile("gpu")])
    def use():
        return 1

    GPU = ResourceProfile(name="gpu", gpus=1, idle_timeout=0.5)

    @flow(task_runner=ProfileTaskRunner(profiles=[GPU]))
    def waiting():
        futures = [use.submit() for _ in range(2)]  # the second queues behind the first's wait
        OUT.write_text(" ".join([str(flow_run.get_id()), *(str(f.task_run_id) for f in futures)]))
        return sum(f.result() for f in futures)

    if __name__ == "__main__":
        assert waiting() == 2
    """
)


def _poll(
    predicate: Any, what: str, seconds: float = 30.0, procs: tuple[subprocess.Popen[str], ...] = ()
) -> Any:
    """``_until`` at a pace for the CLI and the API (every 0.3 s)."""
    deadline = time.monotonic() + seconds
    while not (value := predicate()):
        assert all(p.poll() is None for p in procs), f"a helper process exited early (waiting for {what})"
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.3)
    return value


def _waiters_json() -> dict[str, Any]:
    result = CliRunner().invoke(app, ["waiters", "--json"])
    assert result.exit_code == 0, result.output
    return dict(json.loads(result.stdout))


def _in_thread(fn: Any, *args: Any, **kw: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn(*args, **kw)
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _listening(reasons: list[wait_reasons.WaitReason], fn: Any, *args: Any, **kw: Any) -> Any:
    token = wait_reasons.LISTENER.set(reasons.append)
    try:
        return fn(*args, **kw)
    finally:
        wait_reasons.LISTENER.reset(token)


def test_a_waiter_names_the_flow_run_holding_its_device_in_its_side_file_and_to_its_listener(lease_dir):
    holder = leases.take(["0"], dict(leases.owner_info("train"), flow_run_name="busy-otter"), lease_dir)
    assert holder is not None
    book = DeviceBook(lease_dir=lease_dir, lease_timeout=60)
    reasons: list[wait_reasons.WaitReason] = []
    thread, out = _in_thread(_listening, reasons, book.acquire, "gpu", [DEV0], 1, block=True)
    try:
        _until(lambda: reasons, "the waiter to say why", seconds=20)
        reason = reasons[0]
        assert reason.kind == "device-held", reason
        assert "device 0 is held by profile 'train' of flow run 'busy-otter'" in reason.text, reason.text
        (queued,) = _waiters_json()["this_host"]
        assert queued["profile"] == "gpu" and queued["why"]["kind"] == "device-held", queued
        assert queued["why"]["holder"]["flow_run_name"] == "busy-otter"
        table = CliRunner().invoke(app, ["waiters"], env={"COLUMNS": "250", "NO_COLOR": "1"}).stdout
        assert "Waits for" in table and "busy-otter" in table, table
    finally:
        leases.release(holder)
        thread.join(timeout=20)
    assert out.get("result") == [0], out
    book.release("gpu", ["0"])
    assert list((lease_dir / leases.QUEUE).iterdir()) == [], "the reason leaves with its waiter"


@pytest.fixture
def quota(prefect_server):
    from gpu_tasks.prefect_api import quotas

    name = f"q-why-{random.randrange(10**6)}"
    quotas.set_limit(name, 1)
    yield name
    quotas.delete_limit(name)


def test_a_full_quota_is_named_with_its_use(quota, lease_dir):
    """Device 1 is free, but the team's quota (1 device) is held on device 0: the quota is the reason."""
    first, second = DeviceBook(lease_dir=lease_dir, lease_timeout=60), DeviceBook(lease_dir=lease_dir)
    assert first.acquire("train-a", [DEV0], 1, block=False, quota=quota) == [0]
    reasons: list[wait_reasons.WaitReason] = []
    thread, out = _in_thread(
        _listening, reasons, second.acquire, "train-b", [DEV1], 1, block=True, quota=quota
    )
    try:
        _until(lambda: reasons, "the waiter to say why", seconds=30)
        assert reasons[0].kind == "quota-full", reasons[0]
        assert reasons[0].text == f"quota {quota!r} is full (1 of 1 device(s) in use)", reasons[0].text
        _poll(lambda: _waiters_json()["this_host"][0].get("why"), "the reason in gpu-tasks waiters")
        assert _waiters_json()["this_host"][0]["why"]["kind"] == "quota-full"
    finally:
        first.release("train-a", ["0"])
        thread.join(timeout=30)
        if out.get("result") == [0]:
            second.release("train-b", ["1"])
        first.close()
        second.close()
    assert out.get("result") == [0], out


def _task_run_logs(task_run_id: str) -> list[str]:
    status, body = api(
        "POST", "/logs/filter", json={"logs": {"task_run_id": {"any_": [task_run_id]}}, "limit": 50}
    )
    assert status == 200, body
    return [row["message"] for row in body]


@pytest.mark.usefixtures("prefect_server")
def test_a_waiting_task_says_who_holds_its_device_in_its_task_run_log_the_cli_and_an_event(
    tmp_path: Path, lease_dir, monkeypatch
):
    hold_out, go, wait_out = tmp_path / "hold.json", tmp_path / "go", tmp_path / "waiting.ids"
    env = _env(lease_dir, GPU_TASKS_IDLE_TIMEOUT="0.5", GPU_TASKS_LEASE_TIMEOUT="120")
    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "1")
    run = {"env": env, "cwd": tmp_path, "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    holding = subprocess.Popen(
        [sys.executable, _script(tmp_path, "holding_run", HOLDING_RUN), str(hold_out), str(go)], **run
    )
    waiting = None
    try:
        _until(hold_out.with_suffix(".held").exists, "the first flow run holds device 0", 120, (holding,))
        waiting = subprocess.Popen(
            [sys.executable, _script(tmp_path, "waiting_run", WAITING_RUN), str(wait_out)], **run
        )
        _until(
            lambda: wait_out.exists() and " " in wait_out.read_text(),
            "the second run's task",
            120,
            (waiting,),
        )
        flow_run_id, task_run_id, behind_id = wait_out.read_text().split()

        def why() -> dict[str, Any] | None:
            queued = [w for w in _waiters_json()["this_host"] if w.get("profile") == "gpu"]
            return queued[0].get("why") if queued else None

        _poll(why, "gpu-tasks waiters to show why the task waits", 60, (waiting,))
        shown_at = time.monotonic()
        shown = why()
        assert shown is not None and shown["kind"] == "device-held", shown
        assert (
            shown["holder"]["profile"] == "train" and "held by profile 'train' of flow run" in shown["text"]
        )
        holder_run = shown["holder"]["flow_run_name"]
        assert holder_run and f"flow run {holder_run!r}" in shown["text"]

        def logged(run_id: str = task_run_id) -> list[str]:
            return [m for m in _task_run_logs(run_id) if "Waiting for devices" in m]

        _poll(logged, "the reason in the waiting task run's log", 30, (waiting,))
        line = logged()[0]
        assert f"device 0 is held by profile 'train' of flow run {holder_run!r}" in line, line
        # the task queued behind it says so too (only the first one did: the other sat in Pending)
        _poll(lambda: logged(behind_id), "the reason in the queued task run's log", 30, (waiting,))
        assert f"device 0 is held by profile 'train' of flow run {holder_run!r}" in logged(behind_id)[0]
        go.write_text("go")
        waited_s = time.monotonic() - shown_at
        stdout, _ = waiting.communicate(timeout=120)
        assert waiting.returncode == 0, stdout[-3000:]
        stdout, _ = holding.communicate(timeout=120)
        assert holding.returncode == 0, stdout[-3000:]
    finally:
        go.write_text("go")
        _stop(holding)
        if waiting is not None:
            _stop(waiting)
    if waited_s < 25:
        assert len(logged()) == 1, "said once: the same reason again only after 30 s"
    events = flow_run_events(flow_run_id, {"name": ["gpu-tasks.task.waiting"]})
    assert len(events) == 2, "one event per waiting task run: the reason did not change"
    [event] = [
        e
        for e in events
        if f"prefect.task-run.{task_run_id}" in {r["prefect.resource.id"] for r in e["related"]}
    ]
    assert event["payload"]["kind"] == "device-held" and event["payload"]["holder"]["profile"] == "train"
    assert event["resource"]["gpu-tasks.wait-kind"] == "device-held"
    assert "waits: device 0 is held by profile 'train'" in event["resource"]["prefect.resource.name"]
    related = {r["prefect.resource.id"] for r in event["related"]}
    assert f"prefect.task-run.{task_run_id}" in related
