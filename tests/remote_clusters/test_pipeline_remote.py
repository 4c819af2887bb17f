"""The main job, `gpu-tasks example run`, with its GPU stages on an existing Dask cluster (the stand-in
hosts): the embedded Prefect server and the scheduler are both on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from faults._procs import seed_prefect_home

from remote_clusters.hosts import Hosts

pytestmark = pytest.mark.slow


def test_gpu_tasks_run_with_gpu_stages_on_an_existing_cluster(gpu_hosts: Hosts, tmp_path: Path):
    profiles = tmp_path / "profiles.toml"
    profiles.write_text(
        f"""
        default = "cpu"
        [profiles.cpu]
        cpus = 1
        [profiles.gpu-etl]
        gpus = 1
        address = "{gpu_hosts.address}"
        [profiles.gpu-train]
        gpus = 1
        address = "{gpu_hosts.address}"
        """.replace("\n        ", "\n")
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "GPU_TASKS"))}
    env.update(
        GPU_TASKS_PROFILES_FILE=str(profiles),
        GPU_TASKS_DATA_DIR=str(tmp_path / "data"),  # one filesystem for the flow and the workers
        PREFECT_HOME=str(tmp_path / "prefect-home"),
    )
    seed_prefect_home(tmp_path / "prefect-home")
    gpu_tasks_cli = Path(sys.executable).with_name("gpu-tasks")
    proc = subprocess.run(
        # a smoke-sized run (as tests/pipeline/ runs it): every stage, on the hosts, in well under a minute
        [str(gpu_tasks_cli), "example", "run", "--json", "--limit", "30000", "--rounds", "30"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    assert report["metrics"]["auc"] > report["metrics"]["baseline_auc"], report["metrics"]
    # the GPU stages ran on the stand-in hosts' (emulated) devices, announced as such
    assert report["stages"]["etl"]["emulated"] and report["stages"]["train"]["emulated"], report["stages"]
    assert "connected to tcp://127.0.0.1" in proc.stderr
