"""Workers of an existing cluster report to a Prefect server that requires authentication: the
credentials travel with each task (the workers have none of their own)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import httpx
import pytest
from faults._procs import clean_env, kill_marked, wait_gone

from remote_clusters.hosts import Hosts

pytestmark = pytest.mark.slow

AUTH = "gpu-tasks:s3cret"

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


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_remote_workers_report_to_an_authenticated_server(gpu_hosts: Hosts, tmp_path: Path):
    marker = uuid.uuid4().hex
    url = f"http://127.0.0.1:{_port()}/api"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "prefect",
            "server",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            url.split(":")[2][:-4],
        ],
        env=clean_env(
            marker,
            PREFECT_HOME=str(tmp_path / "server-home"),
            PREFECT_SERVER_API_AUTH_STRING=AUTH,
            PREFECT_UI_ENABLED="false",
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, "the Prefect server exited"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the Prefect server did not start"
            time.sleep(0.5)
        assert httpx.post(f"{url}/flow_runs/filter", json={}, timeout=10).status_code == 401
        (tmp_path / "authed.py").write_text(SCRIPT)
        env = clean_env(
            marker,
            PREFECT_HOME=str(tmp_path / "client-home"),
            PREFECT_API_URL=url,
            PREFECT_API_AUTH_STRING=AUTH,
        )
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
        flow_run_id = next(
            line.split()[1] for line in proc.stdout.splitlines() if line.startswith("FLOW_RUN")
        )
        user, password = AUTH.split(":")
        deadline = time.monotonic() + 30
        while True:
            runs = httpx.post(
                f"{url}/task_runs/filter",
                auth=(user, password),
                timeout=10,
                json={"flow_runs": {"id": {"any_": [flow_run_id]}}},
            ).json()
            states = sorted(r["state_type"] for r in runs)
            if states == ["COMPLETED"] * 4 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert states == ["COMPLETED"] * 4, states
        # recorded by the remote workers themselves: their runs carry the workers' device tags
        assert all(any(t.startswith("gpu:") and t.count(":") == 2 for t in r["tags"]) for r in runs)
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
        kill_marked(marker)
    _, left = wait_gone(marker, timeout=10)
    assert not left, left
