"""`gpu-tasks example serve`: a scheduled deployment of the pipeline, served against a real server."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prefect_api import api
from typer.testing import CliRunner

from gpu_tasks.cli import app

GPU_TASKS = Path(sys.executable).with_name("gpu-tasks")


def _serve(tmp_path: Path, name: str, limit: int) -> subprocess.Popen[str]:
    """`gpu-tasks example serve` on the session's server, in a process group of its own (a terminal's
    Ctrl-C goes to the whole group), on two emulated devices."""
    import prefect.settings

    env = {
        k: v
        for k, v in os.environ.items()
        if k in ("GPU_TASKS_LEASE_DIR", "GPU_TASKS_PRESENCE_DIR") or not k.startswith("GPU_TASKS_")
    }
    env.update(
        PREFECT_API_URL=str(prefect.settings.PREFECT_API_URL.value()),
        GPU_TASKS_EMULATED_GPUS="2",
        GPU_TASKS_DATA_DIR=str(tmp_path),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
    )
    args = ["example", "serve", "--name", name, "--cron", "0 2 * * *", "--limit", str(limit), "--rounds", "3"]
    return subprocess.Popen(
        [str(GPU_TASKS), *args],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _registered(proc: subprocess.Popen[str], name: str) -> dict:
    """The served deployment, once serve has registered it."""
    for _ in range(240):
        code, body = api("GET", f"/deployments/name/etl-train/{name}")
        if code == 200:
            return body
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.25)
    raise AssertionError("serve did not register the deployment")


def test_served_deployment_has_its_schedule_and_runs_to_completion(tmp_path: Path, prefect_server):
    name = f"serve-test-{os.getpid()}"
    proc = _serve(tmp_path, name, limit=15000)
    try:
        deployment = _registered(proc, name)
        assert [s["schedule"]["cron"] for s in deployment["schedules"]] == ["0 2 * * *"]
        assert deployment["parameters"] == {"scale": 1, "num_rounds": 3, "limit": 15000}
        # the Deployments page says which profiles and GPUs it needs
        assert "GPU profiles: gpu-etl: 1 GPU per task" in deployment["description"], deployment["description"]
        assert deployment["tags"] == ["gpu-tasks", "gpu-profile:gpu-etl", "gpu-profile:gpu-train", "gpus:2"]

        code, run = api("POST", f"/deployments/{deployment['id']}/create_flow_run", json={})
        assert code == 201, run
        state = None
        for _ in range(600):
            code, body = api("GET", f"/flow_runs/{run['id']}")
            state = body["state"]["type"]
            if state in {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}:
                break
            time.sleep(0.25)
        assert state == "COMPLETED", state
        models = list(tmp_path.glob("scale-1/model/*.json"))
        assert any(m.name.endswith(".metrics.json") for m in models)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--cron", "bogus"], "--cron"),
        (["--scale", "0"], "--scale"),
        (["--rounds", "0"], "--rounds"),
        (["--process-limit", "0"], "--process-limit"),
    ],
)
def test_serve_rejects_bad_input(args, needle, monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    # Prefect's settings context, not only the environment: in a test process without the session's
    # server (this test run alone) the context built at import has no API URL
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        result = CliRunner().invoke(app, ["example", "serve", *args])
    assert result.exit_code == 2 and needle in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr  # one line, a pydantic dump neither


def test_ctrl_c_on_serve_mid_run_reports_the_flow_run_crashed(tmp_path: Path, prefect_server):
    """Ctrl-C on `gpu-tasks example serve` while a run's GPU clusters start: the run process closes and
    reports Crashed; the serving runner must not SIGKILL it first (it did when the deployment was
    served without its flow object: the flow run stayed Running for good)."""
    import psutil

    name = f"serve-ctrl-c-{os.getpid()}"
    proc = _serve(tmp_path, name, limit=5000)
    try:
        deployment = _registered(proc, name)
        code, run = api("POST", f"/deployments/{deployment['id']}/create_flow_run", json={})
        assert code == 201, run
        # the moment of the report: just after the first stage (CPU), while the GPU clusters start
        for _ in range(600):
            query = {"flow_runs": {"id": {"any_": [run["id"]]}}}
            code, task_runs = api("POST", "/task_runs/filter", json=query)
            assert code == 200, task_runs
            if any(t["name"].startswith("ingest-") and t["state_type"] == "COMPLETED" for t in task_runs):
                break
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.1)
        else:
            pytest.fail("the run's ingest task never completed")
        time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
        state = None
        for _ in range(120):  # the run process reports Crashed before it exits; allow the API a moment
            state = api("GET", f"/flow_runs/{run['id']}")[1]["state"]["type"]
            if state != "RUNNING":
                break
            time.sleep(0.25)
        assert state == "CRASHED", f"{state}\n{proc.stdout.read()[-3000:]}"

        def left() -> list[str]:
            found = []
            for p in psutil.process_iter():
                with contextlib.suppress(psutil.Error, ProcessLookupError):
                    if p.status() != psutil.STATUS_ZOMBIE and os.getpgid(p.pid) == proc.pid:
                        found.append(" ".join(p.cmdline())[:150])
            return found

        # the run's fork server ends when the run process it served is gone (its pipe closes): a moment
        # after serve, on a loaded machine (once in CI it was still there as serve exited)
        deadline = time.monotonic() + 15
        while left() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left(), left()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
