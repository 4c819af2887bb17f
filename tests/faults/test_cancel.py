"""Cancelling a flow run (`prefect flow-run cancel`, the UI's Cancel) of a Prefect process worker while
its GPU task runs: the worker sends SIGTERM to the flow run's whole process group, gpu-tasks'
scheduler and worker processes included. The flow process still closes within seconds and writes
its records, and the task run's crash message names the cancellation."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

from faults._procs import clean_env, kill_marked, server_task_run, wait_gone

PREFECT = Path(sys.executable).with_name("prefect")

FLOW = textwrap.dedent(
    """
    import os, time
    from pathlib import Path
    from prefect import flow, task
    from gpu_tasks import ProfileTaskRunner, ResourceProfile, profile

    @task(tags=[profile("gpu")])
    def long_gpu_task(ready: str):
        Path(ready).write_text("started")
        time.sleep(300)

    @task(tags=[profile("other")])
    def waits_for_the_device():
        time.sleep(300)

    PROFILES = [ResourceProfile(name="gpu", gpus=1), ResourceProfile(name="other", gpus=1)]

    @flow(task_runner=ProfileTaskRunner(profiles=PROFILES))
    def cancelled(ready: str, pid_file: str):
        Path(pid_file).write_text(str(os.getpid()))
        running = long_gpu_task.submit(ready)
        while not Path(ready).exists():
            time.sleep(0.05)
        waiting = waits_for_the_device.submit()  # the only device is held: it waits for it
        running.result(), waiting.result()
    """
)


def _until(predicate, what: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {seconds:g}s"
        time.sleep(0.2)


@pytest.mark.timeout(400)
def test_cancelling_a_process_workers_flow_run_mid_gpu_task_closes_fast_and_keeps_the_records(
    tmp_path: Path, prefect_server
):
    from prefect.settings import get_current_settings
    from prefect_api import api

    (tmp_path / "cancel_flow.py").write_text(FLOW)
    ready, pid_file = tmp_path / "ready", tmp_path / "flow.pid"
    pool = f"gpu-tasks-cancel-{uuid.uuid4().hex[:8]}"
    assert api("POST", "/work_pools/", json={"name": pool, "type": "process"})[0] == 201
    _, flow_ = api("POST", "/flows/", json={"name": "cancelled"})
    status, deployment = api(
        "POST",
        "/deployments/",
        json={
            "name": "cancel-test",
            "flow_id": flow_["id"],
            "entrypoint": "cancel_flow.py:cancelled",
            "work_pool_name": pool,
            "pull_steps": [{"prefect.deployments.steps.set_working_directory": {"directory": str(tmp_path)}}],
        },
    )
    assert status in (200, 201), deployment
    status, run = api(
        "POST",
        f"/deployments/{deployment['id']}/create_flow_run",
        json={"parameters": {"ready": str(ready), "pid_file": str(pid_file)}},
    )
    assert status in (200, 201), run
    marker = uuid.uuid4().hex
    env = clean_env(
        marker,
        PREFECT_API_URL=str(get_current_settings().api.url),
        PREFECT_WORKER_QUERY_SECONDS="1",
        PREFECT_WORKER_CANCELLATION_POLL_SECONDS="1",
        GPU_TASKS_EMULATED_GPUS="1",
    )
    log = tmp_path / "worker.log"
    worker = subprocess.Popen(
        [str(PREFECT), "worker", "start", "--pool", pool, "--type", "process"],
        env=env,
        cwd=tmp_path,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _until(lambda: ready.exists() or worker.poll() is not None, "the GPU task started", 240)
        assert ready.exists(), log.read_text()[-3000:]
        time.sleep(2)  # the other task into the device queue
        flow_pid = int(pid_file.read_text())
        cancelled_at = time.monotonic()
        status, _ = api(
            "POST",
            f"/flow_runs/{run['id']}/set_state",
            json={"state": {"type": "CANCELLING", "message": "cancelled by the test"}, "force": True},
        )
        assert status in (200, 201)
        _until(lambda: not psutil.pid_exists(flow_pid), "the flow process ended", 90)
        took = time.monotonic() - cancelled_at
        # the flow run's processes (the worker is left): none outlives it
        _, left = wait_gone(marker, 15, keep=worker.pid)
    finally:
        if worker.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGINT)
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
        kill_marked(marker)
    output = log.read_text()
    # the worker saw the run and killed its process group within a second or two of the cancel;
    # before, the flow process hung 30 s on its dead scheduler, until Prefect's SIGKILL
    assert took < 20, f"the flow process ended {took:.1f}s after the cancel\n{output[-4000:]}"
    _, arts = api(
        "POST",
        "/artifacts/filter",
        json={"artifacts": {"key": {"any_": ["resource-ledger"]}, "flow_run_id": {"any_": [run["id"]]}}},
    )
    assert len(arts) == 1, output[-4000:]
    rows = arts[0]["data"] if isinstance(arts[0]["data"], list) else json.loads(arts[0]["data"])
    [gpu] = [r for r in rows if r["profile"] == "gpu"]
    assert gpu["tasks"] == 1 and gpu["busy_s"] > 0, gpu
    assert "cancel" in gpu["reason"], gpu
    _, task_runs = api("POST", "/task_runs/filter", json={"flow_runs": {"id": {"any_": [run["id"]]}}})
    runs = {r["name"].rsplit("-", 1)[0]: server_task_run(r["id"]) for r in task_runs}
    # a user's cancel is no crash: both end Cancelled, the running one and the one that never ran
    # (Crashed and Failed until 2026-12-07: an automation on crashes fired for each cancel)
    task_run, waited = runs["long_gpu_task"], runs["waits_for_the_device"]
    message = task_run["state"]["message"]
    assert task_run["state_type"] == "CANCELLED" and "cancelled" in message, (message, output[-6000:])
    assert "unknown devices" not in message and "connection" not in message, message
    assert waited["state_type"] == "CANCELLED", (waited["state"], output[-6000:])
    assert "the flow run cancelled before this task ran" in waited["state"]["message"], waited["state"]
    assert waited["run_count"] == 0, waited  # it never started (1 until 2026-12-07)
    assert not left, f"processes outlived the cancelled flow run: {left}"
