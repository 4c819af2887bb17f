"""The main job as a user runs it: `gpu-tasks run` and the README example, in fresh processes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from faults._procs import wait_gone
from gpu_tasks.cli import app

ROOT = Path(__file__).resolve().parents[1]
GPU_TASKS = Path(sys.executable).with_name("gpu-tasks")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k == "GPU_TASKS_LEASE_DIR" or not k.startswith(("GPU_TASKS_", "PREFECT_API_URL"))}
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    env.update(extra)
    return env


def _leaked_children(before: set[int]) -> list[str]:
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.pid not in before and "resource_tracker" not in " ".join(p.cmdline()):
                out.append(" ".join(p.cmdline())[:120])
        except psutil.Error:
            continue
    return out


def test_run_command_on_embedded_server_with_announced_emulation(tmp_path: Path):
    """No PREFECT_API_URL, no GPU, no emulation set: the job starts its own server and emulates."""
    env = _clean_env(PREFECT_HOME=str(tmp_path / "prefect-home"))
    proc = subprocess.run(
        [str(GPU_TASKS), "run", "--limit", "20000", "--rounds", "5", "--data-dir", str(tmp_path), "--json"],
        capture_output=True, text=True, env=env, timeout=280, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "EMULATING 2 devices" in proc.stderr and "not GPU results" in proc.stderr
    out = json.loads(proc.stdout)  # --json: stdout holds the summary and nothing else
    assert out["device_source"] == "emulated"
    assert re.match(r"http://127\.0\.0\.1:\d+/api", out["prefect_api_url"])
    assert out["stages"]["etl"]["emulated"] is True and out["stages"]["etl"]["backend"] == "pandas"
    assert out["stages"]["train"]["device"] == "cpu" and out["stages"]["train"]["profile"] == "gpu-train"
    assert Path(out["model_path"]).is_file() and Path(out["metrics_path"]).is_file()
    assert json.loads(Path(out["metrics_path"]).read_text())["auc"] == pytest.approx(out["metrics"]["auc"])
    assert 0.5 < out["metrics"]["auc"] <= 1
    # the server was stopped only after it had recorded every task run's final state
    import sqlite3

    with sqlite3.connect(tmp_path / "prefect-home" / "prefect.db") as con:
        states = dict(con.execute("select state_type, count(*) from task_run group by state_type").fetchall())
    assert states and set(states) == {"COMPLETED"}, states


def test_run_command_human_output_on_a_given_server(tmp_path: Path, prefect_server):
    """PREFECT_API_URL set: the job uses that server; the summary names profiles and emulation."""
    import prefect.settings

    url = str(prefect.settings.PREFECT_API_URL.value())
    env = _clean_env(PREFECT_API_URL=url, GPU_TASKS_EMULATED_GPUS="2")
    proc = subprocess.run(
        [str(GPU_TASKS), "run", "--limit", "15000", "--rounds", "3", "--data-dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=280, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"on {url}" in proc.stdout
    assert re.search(r"^etl\s+profile=gpu-etl devices=\d \(EMULATED, backend=pandas\)", proc.stdout, re.M)
    assert "flights=15,000" in proc.stdout and "Not GPU results" in proc.stdout
    model = re.search(r"^model\s+(\S+)", proc.stdout, re.M)
    assert model and Path(model.group(1)).is_file()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--scale", "0"], "--scale"),
        (["--rounds", "0"], "--rounds"),
        (["--limit", "-5"], "--limit"),
    ],
)
def test_run_command_rejects_bad_input_before_starting_anything(tmp_path: Path, args: list[str], needle: str):
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    result = CliRunner().invoke(app, ["run", "--data-dir", str(tmp_path), *args])
    assert result.exit_code == 2
    assert needle in result.stderr and "Traceback" not in result.stderr
    assert not list(tmp_path.iterdir()), "nothing is written for bad input"
    assert not _leaked_children(before)


def test_readme_example_runs(tmp_path: Path, prefect_server):
    import prefect.settings

    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert blocks, "README has a python example"
    example = tmp_path / "example.py"
    example.write_text(blocks[0])
    env = _clean_env(GPU_TASKS_EMULATED_GPUS="2", PREFECT_API_URL=str(prefect.settings.PREFECT_API_URL.value()))
    proc = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, env=env, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert "'emulated': True" in last and "'n': 1000" in last
    assert re.search(r"'devices': \('\d',?\)", last), last


def test_shipped_profiles_file_loads_and_places_on_emulated_h100s(monkeypatch):
    from gpu_tasks import discover, load_profiles_file
    from gpu_tasks.policy import matching_devices

    profiles, default = load_profiles_file(ROOT / "infra" / "profiles.toml")
    assert default == "cpu" and set(profiles) == {"cpu", "gpu-etl", "gpu-train"}
    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "H100:80GiB,L4:24GiB,H100:80GiB")
    inventory = discover()
    assert [d.address for d in matching_devices(profiles["gpu-train"], inventory)] == ["0", "2"]


def test_unguarded_script_fails_with_a_clear_error_instead_of_hanging(tmp_path: Path, prefect_server):
    """Spawned workers re-import the script; without the __main__ guard they cannot start."""
    import prefect.settings

    script = tmp_path / "unguarded.py"
    script.write_text(
        "from prefect import flow, task\n"
        "from gpu_tasks import ProfileTaskRunner, ResourceProfile, profile\n"
        "@task(tags=[profile('gpu')])\n"
        "def f():\n    return 1\n"
        "@flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name='gpu', gpus=1)]))\n"
        "def p():\n    return f.submit().result()\n"
        "p()\n"
    )
    marker = uuid.uuid4().hex
    env = _clean_env(GPU_TASKS_EMULATED_GPUS="1", GPU_TASKS_PROVISION_TIMEOUT="10",
                     PREFECT_API_URL=str(prefect.settings.PREFECT_API_URL.value()), GPU_TASKS_TEST_MARKER=marker)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=150)
    assert proc.returncode != 0
    assert "ClusterError: profile 'gpu': could not start 1 worker(s)" in proc.stderr
    assert 'if __name__ == "__main__":' in proc.stderr
    # this script's processes only (an environment marker every descendant inherits): orphaned
    # workers exit when they see their parent gone, within seconds even on a loaded machine
    waited, strays = wait_gone(marker, timeout=10)
    assert not strays, f"worker processes outlived the script by {waited:.1f}s: {strays}"


IDLE_CLOSE_SCRIPT = '''
import json, time
from prefect import flow, task
from prefect.context import FlowRunContext
from gpu_tasks import ProfileTaskRunner, ResourceProfile, profile
from gpu_tasks.main_job import embedded_server

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
                    "event": {"prefix": ["gpu-tasks.cluster.closed"]}, "occurred": {"since": "2000-01-01T00:00:00Z"},
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
                          "client_max_retries": get_current_settings().client.max_retries}))
'''


def test_idle_close_events_reach_the_embedded_server(tmp_path: Path):
    """The embedded server is tuned for many short tasks, and an idle scale-down runs on a runner thread; its events still reach the flow run's server
    when that server's URL lives in a settings context (embedded server), not the environment,
    and no second, ephemeral Prefect server is started for them."""
    script = tmp_path / "idle_close.py"
    script.write_text(IDLE_CLOSE_SCRIPT)
    env = _clean_env(PREFECT_HOME=str(tmp_path / "prefect-home"), GPU_TASKS_EMULATED_GPUS="1",
                     PREFECT_LOGGING_LEVEL="INFO")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                          timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    port = out["url"].split(":")[2].split("/")[0]
    other_servers = [line for line in proc.stderr.splitlines()
                     if "temporary server on http" in line and f"127.0.0.1:{port}" not in line]
    assert not other_servers, other_servers[:5]
    assert any(r.startswith("scaled down: idle") for r in out["reasons"]), out
    # the embedded SQLite server waits on its writer instead of answering 503 under load
    assert out["server_db_timeout"] == 60 and out["client_max_retries"] == 10, out


RECORDED_SCRIPT = '''
import os, sqlite3, json
from prefect import flow, task
from gpu_tasks.main_job import embedded_server

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
    print(json.dumps(dict(con.execute("select state_type, count(*) from task_run group by state_type").fetchall())))
'''


def test_embedded_server_stops_only_after_recording_every_task_run(tmp_path: Path):
    """A flow of many short tasks that ends at once: the server records each task run's final
    state before it is stopped (stopped at once, it had recorded a few of 300, some 'Running')."""
    script = tmp_path / "many.py"
    script.write_text(RECORDED_SCRIPT)
    env = _clean_env(PREFECT_HOME=str(tmp_path / "prefect-home"))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                          timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"COMPLETED": 300}
