"""A remote Prefect server that requires authentication: workers report there with the flow run's
credentials."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

from faults._procs import AUTH, authed_server, authed_task_states, clean_env, kill_marked, wait_gone

SCRIPT = textwrap.dedent(
    """
    import time
    from prefect import flow, task
    from prefect.runtime import flow_run
    from gpu_tasks import ProfileTaskRunner, ResourceProfile, profile

    @task(tags=[profile("half")])
    def work(i):
        time.sleep(0.1)
        return i * 2

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="half", gpus=0.5, idle_timeout=1)]))
    def authed():
        print("FLOW_RUN", flow_run.id)
        return sum(f.result() for f in work.map(range(4)))

    if __name__ == "__main__":
        print("RESULT", authed())
    """
)


def test_workers_report_to_an_authenticated_server_with_the_flow_runs_credentials(tmp_path: Path):
    marker = uuid.uuid4().hex
    try:
        with authed_server(tmp_path, marker) as url:
            (tmp_path / "authed.py").write_text(SCRIPT)
            env = clean_env(
                marker,
                PREFECT_HOME=str(tmp_path / "client-home"),
                PREFECT_API_URL=url,
                PREFECT_API_AUTH_STRING=AUTH,
                GPU_TASKS_EMULATED_GPUS="1",
            )
            proc = subprocess.run(
                [sys.executable, "authed.py"],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=240,
            )
            assert proc.returncode == 0, proc.stderr[-4000:]
            assert "RESULT 12" in proc.stdout
            flow_run_id = next(
                line.split()[1] for line in proc.stdout.splitlines() if line.startswith("FLOW_RUN")
            )
            runs = authed_task_states(url, flow_run_id, ["COMPLETED"] * 4)
            states = sorted(r["state_type"] for r in runs)
            assert states == ["COMPLETED"] * 4, states
    finally:
        kill_marked(marker)
    _, left = wait_gone(marker, timeout=10)
    assert not left, left
