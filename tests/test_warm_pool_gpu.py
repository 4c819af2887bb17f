"""Warm workers on a real GPU (``-m gpu``; skipped without one): a warm process holds no CUDA
context before its bind, and once bound its worker makes one on the leased device only.

NVML lists each device's compute processes, so this is judged from outside the worker.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from typing import Any

import pytest
from prefect import flow, task
from prefect.context import FlowRunContext

from gpu_tasks import ProfileTaskRunner, ResourceProfile, _gpu, current_allocation, profile
from gpu_tasks.devices.discovery import nvml_devices

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("prefect_server", "no_leaked_processes")]


def _context_pids() -> dict[int, set[int]]:
    """NVML device index -> pids with a compute context on it."""
    nvml = _gpu.load("pynvml")
    nvml.nvmlInit()
    try:
        out = {}
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            out[i] = {p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)}
        return out
    finally:
        nvml.nvmlShutdown()


@task
def first() -> int:  # the runner's first task starts its warm pool
    return 0


@task(tags=[profile("gpu")])
def on_device() -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "process": multiprocessing.current_process().name,
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "devices": list(current_allocation().devices),
        "contexts": {i: os.getpid() in pids for i, pids in _context_pids().items()},
    }


def test_a_bound_warm_process_makes_its_cuda_context_on_the_leased_device_only(monkeypatch):
    for lib in ("dask_cuda", "pynvml"):
        if not _gpu.available(lib):
            pytest.skip(f"{lib} is not available: {_gpu.why_unavailable(lib)}")
    found, note = nvml_devices()
    if not found:
        pytest.skip(f"no NVIDIA device found by NVML: {note}")
    if any(d.mig for d in found):
        pytest.skip("MIG instances: NVML's per-device process list does not name the instance")
    monkeypatch.delenv("GPU_TASKS_EMULATED_GPUS", raising=False)
    monkeypatch.delenv("GPU_TASKS_PROFILES_FILE", raising=False)
    monkeypatch.setenv("GPU_TASKS_TUNE_WARM_WORKERS", "2")

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="gpu", gpus=1, idle_timeout=30)]))
    def f() -> dict[str, Any]:
        runner = FlowRunContext.get().task_runner
        first.submit().result()
        deadline = time.monotonic() + 120
        # every idle process ready (the pool keeps as many as the profile can still bind: 1 per device)
        while not (listed := runner.warm_workers()) or not all(w["ready"] for w in listed):
            assert time.monotonic() < deadline, "warm processes not ready within 120 s"
            time.sleep(0.1)
        warm = [w["pid"] for w in runner.warm_workers()]
        before = _context_pids()
        return {"warm": warm, "before": before, "task": on_device.submit().result()}

    seen = f()
    # unbound warm processes hold no CUDA context on any device
    assert not any(set(seen["warm"]) & pids for pids in seen["before"].values()), seen["before"]
    row = seen["task"]
    assert row["pid"] in seen["warm"] and row["process"] == "gpu-tasks warm worker"
    assert row["devices"] == [row["visible"]]
    (leased,) = [d.index for d in found if d.address == row["visible"]]
    # dask-cuda's --create-cuda-context preload made the worker's context, on that device alone
    assert {i for i, mine in row["contexts"].items() if mine} == {leased}, row
