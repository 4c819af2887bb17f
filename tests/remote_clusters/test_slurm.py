"""cluster_class on a real job queue: dask_jobqueue.SLURMCluster on a single-node Slurm with two
stand-in GPUs (GRES ``gpu:2``), as started by infra/slurm/up.sh (CI starts it)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import pytest
from prefect import flow, task
from prefect.context import FlowRunContext

from gpu_tasks import ProfileTaskRunner, ResourceProfile, current_allocation

pytestmark = pytest.mark.slow
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _slurm_idle() -> str | None:
    """Why there is no Slurm to test on (``None``: a node is idle)."""
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return "Slurm is not installed: run `sudo infra/slurm/up.sh` (CI does)"
    try:
        states = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=5).stdout
    except subprocess.TimeoutExpired:
        return "slurmctld does not answer: run `sudo infra/slurm/up.sh`"
    if not any(s in ("idle", "mixed") for s in states.split()):
        return f"no idle Slurm node (sinfo: {states.strip() or 'nothing'}): run `sudo infra/slurm/up.sh`"
    return None


_WHY = _slurm_idle()
requires_slurm = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")


def _queue() -> list[str]:
    return subprocess.run(
        ["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=10
    ).stdout.split()


@requires_slurm
def test_slurm_cluster_gives_each_job_its_own_gpu_and_scales_to_zero(prefect_server, tmp_path: Path):
    prof = ResourceProfile(
        name="gpu-slurm",
        gpus=1,
        cluster_class="dask_jobqueue.SLURMCluster",
        cluster_kwargs={
            "queue": "debug",
            "cores": 1,
            "memory": "1GiB",
            "processes": 1,
            "walltime": "00:10:00",
            "job_extra_directives": ["--gres=gpu:1"],
            "worker_extra_args": ["--resources", "GPU=1"],
            # the jobs' hosts know their devices are stand-ins
            "job_script_prologue": ["export GPU_TASKS_EMULATED_GPUS=H100:80GiB,H100:80GiB"],
            "scheduler_options": {"host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"},
            "log_directory": str(tmp_path / "jobs"),
        },
        max_workers=2,
        idle_timeout=1,
    )

    marks = tmp_path / "marks"  # the jobs run on this host: they see the test's files
    marks.mkdir()

    @task(tags=["profile:gpu-slurm"])
    def train(i: int, until_both: bool = False) -> dict:
        start = time.time()
        alloc = current_allocation()
        (marks / alloc.device_keys[0].replace(":", "_")).mkdir(exist_ok=True)  # one folder a device
        # the first batch holds on (at most 60 s) until a task runs on the other job's device: on a
        # loaded machine the second job's worker came up after the first had run all four tasks
        while until_both and len(list(marks.iterdir())) < 2:
            if time.time() - start > 60:
                break
            time.sleep(0.1)
        time.sleep(1.5)
        return {"devices": alloc.device_keys, "names": alloc.device_names, "start": start, "end": time.time()}

    @flow(task_runner=ProfileTaskRunner(profiles=[prof]))
    def on_slurm() -> dict:
        runner = FlowRunContext.get().task_runner
        first = [f.result() for f in [train.submit(i, until_both=True) for i in range(4)]]
        # a liveness bound: the idle close waits out a broadcast to workers Slurm already ended (30 s
        # connect timeouts under load: {"rows": 0} after 30 s in a clean-clone CI run)
        deadline = time.monotonic() + 120
        while not runner.ledger and time.monotonic() < deadline:
            time.sleep(0.2)
        while _queue() and time.monotonic() < deadline:
            time.sleep(0.2)
        between = {"rows": len(runner.ledger), "jobs": _queue()}
        second = [f.result() for f in [train.submit(i) for i in range(2)]]
        return {"first": first, "between": between, "second": second}

    out = on_slurm()
    first = out["first"]
    # Slurm gave each job its own GRES device: tasks saw device 0 and device 1, never both at once
    by_device: dict[str, list[tuple[float, float]]] = {}
    for r in first + out["second"]:
        [device] = r["devices"]
        assert list(r["names"]) == ["H100 (emulated)"]
        by_device.setdefault(device, []).append((r["start"], r["end"]))
    assert {d.rsplit(":", 1)[1] for d in by_device} == {"0", "1"}, by_device
    for device, spans in by_device.items():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), (device, spans)
    # scaled to zero when idle: the jobs were cancelled; then provisioned again for the next tasks
    assert out["between"] == {"rows": 1, "jobs": []}, out["between"]
    deadline = time.monotonic() + 20
    while _queue() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _queue() == []  # closed at the end of the flow run: no job left in the queue
