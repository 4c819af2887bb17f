"""Workers of an existing cluster report to a Prefect server that requires authentication: the
credentials travel with each task (the workers have none of their own)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from faults._procs import AUTH, authed_server, authed_task_states, clean_env, kill_marked, wait_gone

from remote_clusters.hosts import Hosts

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import sys, time
    from prefect import flow, task
    from prefect.runtime import flow_run
    from gpu_tasks import ProfileTaskRunner, ResourceProfile, profile

    shared = ResourceProfile(name="shared", gpus=0.5, address=sys.argv[1])

    @task(tags=[profile("shared")])
    def work(i):
        time.sleep(0.1)
        return i * 2

    @flow(task_runner=ProfileTaskRunner(profiles=[shared]))
    def authed():
        print("FLOW_RUN", flow_run.id)
        return sum(f.result() for f in work.map(range(4)))

    if __name__ == "__main__":
        print("RESULT", authed())
    """
)


def test_remote_workers_report_to_an_authenticated_server(gpu_hosts: Hosts, tmp_path: Path):
    marker = uuid.uuid4().hex
    try:
        with authed_server(tmp_path, marker) as url:
            (tmp_path / "authed.py").write_text(SCRIPT)
            home = str(tmp_path / "client-home")
            env = clean_env(marker, PREFECT_HOME=home, PREFECT_API_URL=url, PREFECT_API_AUTH_STRING=AUTH)
            proc = subprocess.run(
                [sys.executable, "authed.py", gpu_hosts.address],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=240,
            )
            assert proc.returncode == 0, proc.stderr[-4000:]
            assert "RESULT 12" in proc.stdout
            lines = proc.stdout.splitlines()
            flow_run_id = next(line.split()[1] for line in lines if line.startswith("FLOW_RUN"))
            runs = authed_task_states(url, flow_run_id, ["COMPLETED"] * 4)
            states = sorted(r["state_type"] for r in runs)
            assert states == ["COMPLETED"] * 4, states
            # recorded by the remote workers themselves: their runs carry the workers' device tags
            assert all(any(t.startswith("gpu:") and t.count(":") == 2 for t in r["tags"]) for r in runs)
    finally:
        kill_marked(marker)
    _, left = wait_gone(marker, timeout=10)
    assert not left, left
