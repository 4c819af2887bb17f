"""Prefect's default API (no server started, no PREFECT_API_URL): workers report to the flow run's server."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

from faults._procs import clean_env, db_rows, kill_marked, wait_gone

SCRIPT = textwrap.dedent(
    """
    import json, os, time
    from prefect import flow, task
    from gpu_tasks import ProfileTaskRunner, ResourceProfile, current_allocation, profile

    @task(tags=[profile("quarter")])
    def hold(i):
        time.sleep(0.2)
        assert "PREFECT_API_URL" in os.environ
        return [i, list(current_allocation().devices)]

    QUARTER = ResourceProfile(name="quarter", gpus=0.25, idle_timeout=1)

    @flow(task_runner=ProfileTaskRunner(profiles=[QUARTER]))
    def newcomer():
        return [f.result() for f in hold.map(range(8))]

    if __name__ == "__main__":
        print("RESULT", json.dumps(newcomer()))
    """
)


def test_default_ephemeral_api_records_every_task_run_and_leaves_no_server(tmp_path: Path):
    marker = uuid.uuid4().hex
    (tmp_path / "newcomer.py").write_text(SCRIPT)
    home = tmp_path / "prefect-home"
    env = clean_env(marker, PREFECT_HOME=str(home), GPU_TASKS_EMULATED_GPUS="2")
    try:
        proc = subprocess.run(
            [sys.executable, "newcomer.py"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "Server process did not start" not in proc.stderr
        result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
        assert result and len(json.loads(result[0][len("RESULT ") :])) == 8
        # nothing outlives the script: no worker, no uvicorn server started by a worker
        _, left = wait_gone(marker, timeout=10)
        assert not left, f"processes outlived the script: {left}"
    finally:
        kill_marked(marker)
    # the flow run's own (ephemeral) server recorded all 8 task runs, under that flow run, final
    db = home / "prefect.db"
    flows = db_rows(db, "select id, state_type from flow_run")
    assert len(flows) == 1 and flows[0][1] == "COMPLETED", flows
    runs = db_rows(db, "select flow_run_id, state_type, name from task_run")
    assert len(runs) == 8, runs
    assert {r[0] for r in runs} == {flows[0][0]}
    assert {r[1] for r in runs} == {"COMPLETED"}, runs
