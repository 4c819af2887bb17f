"""Leaving a flow on Ctrl-C closes every cluster: no worker process survives it."""

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

SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from prefect import flow, task
    from gpu_tasks import ProfileTaskRunner, ResourceProfile, profile

    READY = Path(sys.argv[1])

    @task(tags=[profile("gpu")])
    def long_gpu_task(i):
        READY.write_text("started")
        time.sleep(120)

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="gpu", gpus=1)]))
    def interrupted():
        futures = long_gpu_task.map(range(2))
        [f.result() for f in futures]

    if __name__ == "__main__":
        interrupted()
    """
)


def _marked(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("GPU_TASKS_TEST_MARKER") == marker:
                found.append(proc)
        except psutil.Error:
            continue
    return found


@pytest.mark.usefixtures("prefect_server")
def test_keyboard_interrupt_closes_every_cluster(tmp_path: Path):
    from prefect.settings import get_current_settings

    marker = uuid.uuid4().hex
    script = tmp_path / "interrupted_flow.py"
    script.write_text(SCRIPT)
    ready = tmp_path / "ready"
    env = {
        **os.environ,
        "GPU_TASKS_TEST_MARKER": marker,
        "GPU_TASKS_EMULATED_GPUS": "2",
        "PREFECT_API_URL": str(get_current_settings().api.url),
    }
    proc = subprocess.Popen([sys.executable, str(script), str(ready)], env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None, "the flow exited before its GPU task started"
            assert time.monotonic() < deadline, "the GPU task never started"
            time.sleep(0.2)
        workers = [p for p in _marked(marker) if p.pid != proc.pid]
        assert workers, "expected worker processes while the GPU task runs"
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    gone_by = time.monotonic() + 15
    while _marked(marker) and time.monotonic() < gone_by:
        time.sleep(0.25)
    survivors = []
    for p in _marked(marker):
        with contextlib.suppress(psutil.Error):  # one that ends as it is read is no survivor
            survivors.append(" ".join(p.cmdline())[:120])
    assert not survivors, f"processes outlived the interrupted flow: {survivors}"


TERM_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from prefect import flow, task
    from prefect.runtime import flow_run
    from gpu_tasks import ProfileTaskRunner, ResourceProfile, profile

    READY = Path(sys.argv[1])

    @task(tags=[profile("gpu")])
    def long_gpu_task():
        READY.write_text(str(flow_run.id))
        time.sleep(120)

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="gpu", gpus=1)]))
    def terminated():
        long_gpu_task.submit().result()

    if __name__ == "__main__":
        terminated()
    """
)


@pytest.mark.usefixtures("prefect_server")
def test_sigterm_mid_gpu_task_counts_the_running_task_as_busy(tmp_path: Path):
    """SIGTERM to the flow process while its GPU task runs (what `timeout`, systemd and a Prefect
    worker send): the ledger counts the task as busy up to the close, and the summary raises no
    held-busy alert. Before, the row said `busy 0.0 (0%), 0 tasks` and the alert fired."""
    from prefect.settings import get_current_settings
    from prefect_api import api, flow_run_events

    script = tmp_path / "terminated_flow.py"
    script.write_text(TERM_SCRIPT)
    ready = tmp_path / "ready"
    env = {
        **os.environ,
        "GPU_TASKS_EMULATED_GPUS": "1",
        "GPU_TASKS_TUNE_ALERT_MIN_HELD_SECONDS": "0",  # seconds held here, not minutes
        "PREFECT_API_URL": str(get_current_settings().api.url),
    }
    proc = subprocess.Popen([sys.executable, str(script), str(ready)], env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() or not ready.read_text():
            assert proc.poll() is None, "the flow exited before its GPU task started"
            assert time.monotonic() < deadline, "the GPU task never started"
            time.sleep(0.2)
        time.sleep(3.0)  # busy for 3 s
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    run_id = ready.read_text()
    _, arts = api(
        "POST",
        "/artifacts/filter",
        json={"artifacts": {"key": {"any_": ["resource-ledger"]}, "flow_run_id": {"any_": [run_id]}}},
    )
    assert len(arts) == 1, arts
    data = arts[0]["data"]
    rows = data if isinstance(data, list) else json.loads(data)
    [row] = [r for r in rows if r["profile"] == "gpu"]
    assert row["reason"] == "flow run ended with TerminationSignal", row
    assert row["tasks"] == 1 and row["busy_s"] >= 3.0, row
    [summary] = flow_run_events(run_id, {"name": ["gpu-tasks.flow-run.summary"]})
    assert summary["resource"]["gpu-tasks.alert"] == "none", summary["resource"]
