"""A busy Prefect API: the server refuses gpu-tasks' tag-slot requests with 503 for a while (as an
embedded SQLite server under tens of thousands of task runs does, beyond Prefect's own client
retries); the task runs wait it out and complete, and the log says what was waited for."""

from __future__ import annotations

import json
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from faults._procs import clean_env, free_port, run_flow_script, running_server, wait_gone

REFUSALS = 4

SCRIPT = textwrap.dedent(
    """
    from prefect import flow, task
    from gpu_tasks import ProfileTaskRunner, ResourceProfile, profile

    @task(tags=[profile("quarter")])
    def square(x):
        return x * x

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="quarter", gpus=0.25)]))
    def busy_api_flow():
        return sum(f.result() for f in square.map(range(6)))

    if __name__ == "__main__":
        print("RESULT", busy_api_flow())
    """
)


@pytest.mark.timeout(240)
def test_tag_slot_checks_wait_out_503s_and_every_task_completes(tmp_path: Path):
    marker = f"busy-api-{uuid.uuid4().hex[:8]}"
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    count = tmp_path / "refused"
    server_env = clean_env(
        marker,
        PREFECT_HOME=str(tmp_path / "server-home"),
        PREFECT_UI_ENABLED="false",
        BUSY_API_REFUSALS=str(REFUSALS),
        BUSY_API_COUNT_FILE=str(count),
    )
    server = [sys.executable, str(Path(__file__).with_name("busy_api_server.py")), str(port)]
    with running_server(server, server_env, url):
        out = run_flow_script(
            tmp_path,
            "busy_api_flow.py",
            SCRIPT,
            marker,
            url,
            200,
            PREFECT_CLIENT_MAX_RETRIES="0",  # Prefect's own client gives each 503 up at once
        )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "RESULT 55" in out.stdout, log[-3000:]
    # both sides met the refusals: the flow process's slots for the task's tags, and the engine's
    # check on the worker of the gpu:<id> tags gpu-tasks puts on every task
    assert json.loads(count.read_text()) == {"flow": REFUSALS, "worker": REFUSALS}
    assert "the Prefect API is busy (503 Service Unavailable)" in log, log[-3000:]
    assert "ConcurrencySlotAcquisitionError" not in log, log[-3000:]
    assert wait_gone(marker, 20)[1] == [], "processes outlived the flow run"
