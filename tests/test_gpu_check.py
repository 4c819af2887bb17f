"""scripts/gpu-check, the prepared real-GPU check: rehearsed here as a dry run on emulated devices (so
the script is proven before device time is spent), its one-line refusal without a GPU, and docs/gpu.md
as generated from docs/results/gpu.json."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_check import PLAN, render

ROOT = Path(__file__).resolve().parent.parent


def _no_gpu() -> bool:
    return shutil.which("nvidia-smi") is None


@pytest.mark.skipif(not _no_gpu(), reason="this machine has nvidia-smi: the refusal needs a machine without")
def test_without_a_gpu_it_stops_with_one_line():
    out = subprocess.run([str(ROOT / "scripts" / "gpu-check")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert len(lines) == 1 and "no NVIDIA GPU" in lines[0] and "--dry-run" in lines[0], lines


@pytest.mark.slow
@pytest.mark.timeout(960)  # above the script's own bound (900 s here, --budget)
def test_the_dry_run_runs_every_check_on_emulated_devices(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "GPU_TASKS_"))}
    # this test process's own lease and presence directories (tests/conftest.py), not the host's
    env.update(
        {k: os.environ[k] for k in ("GPU_TASKS_LEASE_DIR", "GPU_TASKS_PRESENCE_DIR") if k in os.environ}
    )
    out = subprocess.run(
        # a loaded 2-core CI machine (tests on three processes: 307-412 s measured) needs more than
        # the GPU machine's 480 s
        [sys.executable, "-m", "bench.gpu_check", "--dry-run", "--budget", "900", "--out-dir", str(tmp_path)],
        cwd=ROOT,
        env={**env, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"},
        capture_output=True,
        text=True,
        timeout=930,
    )
    log = (
        (tmp_path / "results" / "gpu-check.log").read_text()[-4000:]
        if (tmp_path / "results").exists()
        else ""
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:] + log
    data = json.loads((tmp_path / "results" / "gpu.json").read_text())
    assert data["device"]["emulated"] is True and data["dry_run"] is True
    assert [c["name"] for c in data["checks"]] == [p[0] for p in PLAN]
    assert data["runs"][-1]["note"] == "every check, budget 900 s"  # written after each check, too
    failed = [c for c in data["checks"] if not c["passed"]]
    assert not failed, failed
    by = {c["name"]: c for c in data["checks"]}
    # the out-of-memory check saw the runner's own error, naming profile and device, then the escalation
    assert "GpuOutOfMemoryError" in by["out_of_memory"]["figures"]["error"]
    assert by["out_of_memory"]["figures"]["escalated"]["profile"] == "whole"
    assert by["leases"]["figures"]["samples_both"] == 0 and all(by["leases"]["figures"]["samples_holding"])
    page = (tmp_path / "gpu.md").read_text()
    assert "DRY RUN on emulated devices" in page and "not GPU results" in page
    assert page == render(data)


def test_docs_gpu_md_is_generated_from_the_committed_results():
    results = ROOT / "docs" / "results" / "gpu.json"
    data = json.loads(results.read_text())
    assert (ROOT / "docs" / "gpu.md").read_text() == render(data), (
        "docs/gpu.md is stale: python -m bench.gpu_check --report-only"
    )
    # committed results come from a real device: a dry run is never committed as GPU results
    assert data["device"]["emulated"] is False and not data.get("dry_run")
    assert {c["name"] for c in data["checks"]} <= {p[0] for p in PLAN}
