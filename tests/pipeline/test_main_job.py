"""The main job as a user runs it: `gpu-tasks example run` in fresh processes (gpu_tasks.pipeline.job)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from faults._procs import clean_env, marked
from typer.testing import CliRunner

from gpu_tasks.cli import app

GPU_TASKS = Path(sys.executable).with_name("gpu-tasks")


def _clean_env(fresh_home: bool = False, **extra: str) -> dict[str, str]:
    """This environment less gpu-tasks and Prefect API settings (and a marker no test here looks for)."""
    return clean_env(uuid.uuid4().hex, fresh_home, **extra)


def test_run_command_on_embedded_server_with_announced_emulation(tmp_path: Path):
    """No PREFECT_API_URL, no GPU, no emulation set, `--emulate auto` (what ./scripts/run passes): the
    job starts its own server and emulates, loudly."""
    # a new machine's first run: no Prefect database yet
    env = _clean_env(fresh_home=True, PREFECT_HOME=str(tmp_path / "prefect-home"))
    args = ["--limit", "20000", "--rounds", "5", "--data-dir", str(tmp_path), "--json", "--emulate", "auto"]
    proc = subprocess.run(
        [str(GPU_TASKS), "example", "run", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "EMULATING 2 devices" in proc.stderr and "not GPU results" in proc.stderr
    # the plugin's line says what emulation means for any flow; the example adds what its stages do
    assert "CUDA_VISIBLE_DEVICES and Dask GPU resources" in proc.stderr, proc.stderr[-3000:]
    assert "The example pipeline on emulated devices: its ETL reads with pandas" in proc.stderr
    out = json.loads(proc.stdout)  # --json: stdout holds the summary and nothing else
    assert out["device_source"] == "emulated"
    assert re.match(r"http://127\.0\.0\.1:\d+/api", out["prefect_api_url"])
    assert out["stages"]["etl"]["emulated"] is True and out["stages"]["etl"]["backend"] == "pandas"
    assert out["stages"]["train"]["device"] == "cpu" and out["stages"]["train"]["profile"] == "gpu-train"
    assert Path(out["model_path"]).is_file() and Path(out["metrics_path"]).is_file()
    assert json.loads(Path(out["metrics_path"]).read_text())["auc"] == pytest.approx(out["metrics"]["auc"])
    assert 0.5 < out["metrics"]["auc"] <= 1
    # every stage timed; the clusters as they ended (closed, with held and busy device-seconds)
    assert all(stage["seconds"] > 0 for stage in out["stages"].values()), out["stages"]
    assert {c["state"] for c in out["clusters"].values()} == {"closed"}, out["clusters"]
    train = out["clusters"]["gpu-train"]
    assert train["tasks"] == 1 and train["devices"] and 0 < train["busy_s"] <= train["held_s"], train
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
        [str(GPU_TASKS), "example", "run", "--limit", "15000", "--rounds", "3", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
        cwd=tmp_path,
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
        (["--limit", "999"], "--limit must be at least 1000"),  # the flow's own minimum, before any server
    ],
)
def test_run_command_rejects_bad_input_before_starting_anything(
    tmp_path: Path, args: list[str], needle: str, monkeypatch: pytest.MonkeyPatch
):
    # every process this invocation starts inherits the marker: none may be found
    marker = uuid.uuid4().hex
    monkeypatch.setenv("GPU_TASKS_TEST_MARKER", marker)
    result = CliRunner().invoke(app, ["example", "run", "--data-dir", str(tmp_path), *args])
    assert result.exit_code == 2
    assert needle in result.stderr and "Traceback" not in result.stderr
    assert not list(tmp_path.iterdir()), "nothing is written for bad input"
    assert not [p.pid for p in marked(marker) if p.pid != os.getpid()], "bad input starts no process"


@pytest.mark.parametrize("command", ["run", "serve"])
def test_pipeline_commands_on_a_host_without_gpus_say_how_to_emulate(
    tmp_path: Path, command: str, monkeypatch: pytest.MonkeyPatch
):
    """No GPU and no emulation asked for: `run` and `serve` follow the rule every flow run follows
    (no emulation unless GPU_TASKS_EMULATED_GPUS or --emulate says so) and stop before starting
    anything, with an error that names both ways out."""
    from gpu_tasks.devices import discovery as devices_module

    marker = uuid.uuid4().hex
    monkeypatch.setenv("GPU_TASKS_TEST_MARKER", marker)
    monkeypatch.delenv("GPU_TASKS_EMULATED_GPUS", raising=False)
    monkeypatch.delenv("GPU_TASKS_DISCOVERY_COMMAND", raising=False)
    monkeypatch.delenv("GPU_TASKS_PROFILES_FILE", raising=False)
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # serve needs one; nothing listens
    monkeypatch.setattr(
        devices_module, "nvml_devices", lambda: ((), "no NVIDIA driver (NVMLError_LibraryNotFound)")
    )
    result = CliRunner().invoke(app, ["example", command, "--limit", "1000"])
    assert result.exit_code == 2, result.output
    err = result.stderr
    assert f"gpu-tasks example {command}: the pipeline's stages cannot run here" in err, err
    assert "no GPUs" in err and "GPU_TASKS_EMULATED_GPUS=2" in err and "fallback='cpu'" in err, err
    assert f"`gpu-tasks example {command}` takes --emulate auto" in err, err
    assert "Traceback" not in err and "GPU_TASKS_EMULATED_GPUS" not in os.environ
    assert not [p.pid for p in marked(marker) if p.pid != os.getpid()], "nothing was started"


def test_run_command_rejects_a_bad_emulate_value(tmp_path: Path):
    result = CliRunner().invoke(
        app, ["example", "run", "--data-dir", str(tmp_path), "--emulate", "H100:lots"]
    )
    assert result.exit_code == 2
    assert "--emulate 'H100:lots'" in result.stderr and "GPU_TASKS_EMULATED_GPUS must be" in result.stderr
    assert not list(tmp_path.iterdir())
