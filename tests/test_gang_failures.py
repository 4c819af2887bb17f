"""A gang profile (``gang=True``) starts all of its workers or none (docs/runner.md, "Gang start";
docs/profiles.md, ``gang``): what happens when it cannot.

- one of the gang's workers fails to start: the whole start fails with ``ClusterError``,
  every device is given back (in the runner and as a host lease) and no process is left;
- the gang cannot get all of its devices (another flow run leases one) within
  ``GPU_TASKS_LEASE_TIMEOUT``: ``ClusterError`` naming the profile, the gang size and the wait.

Real worker processes on emulated devices. A worker is made to die while it starts through
Dask's own ``distributed.worker.preload`` setting, which the runner keeps for its workers.
"""

from __future__ import annotations

import textwrap

import dask
import distributed  # noqa: F401  (its config defaults load before the dask.config.set below)
import pytest
from prefect import flow, task
from prefect.context import FlowRunContext
from test_leases import _holder, _stop

from gpu_tasks import ProfileTaskRunner, ResourceProfile, current_allocation, profile
from gpu_tasks.devices import leases

pytestmark = pytest.mark.usefixtures("no_leaked_processes", "emulated")

CPU = ResourceProfile(name="cpu", cpus=0.5)
GANG = ResourceProfile(name="gang", gpus=1, gang=True, max_workers=2, idle_timeout=0.5)
SINGLE = ResourceProfile(name="single", gpus=1, max_workers=1, idle_timeout=0.5)

REFUSE_DEVICE_1 = textwrap.dedent(
    """
    import os

    def dask_setup(worker):
        if os.environ.get("CUDA_VISIBLE_DEVICES") == "1":  # Dask only logs a preload's exception
            os._exit(3)  # the worker process of device 1 dies while it starts
    """
)


@task
def devices() -> tuple[str, ...]:
    return current_allocation().devices


def _error(fut) -> str:
    """``"Type: message"`` of the error the task's caller gets from ``result()``; "" if none."""
    try:
        fut.result()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def test_a_gang_worker_that_fails_to_start_fails_the_whole_gang_and_frees_its_devices(
    tmp_path, lease_dir, monkeypatch
):
    monkeypatch.setenv("GPU_TASKS_PROVISION_TIMEOUT", "30")
    preload = tmp_path / "refuse_device_1.py"
    preload.write_text(REFUSE_DEVICE_1)

    @flow(task_runner=ProfileTaskRunner(profiles=[CPU, GANG, SINGLE]))
    def f():
        runner = FlowRunContext.get().task_runner
        fut = devices.with_options(tags=[profile("gang")]).submit()
        fut.wait()  # returns, as for a task that raised: the task run is Failed, not the flow
        failed = fut.state.is_failed()
        gang = _error(fut)
        status = runner.status()["gang"]
        held = leases.holders(lease_dir, ["0", "1"])
        # the devices are free for another profile of this run (device 0's worker starts fine)
        after = devices.with_options(tags=[profile("single")]).submit().result()
        return gang, failed, status, held, after

    with dask.config.set({"distributed.worker.preload": [str(preload)]}):
        error, failed, status, held, after = f()
    assert failed, "the task run whose cluster could not start is Failed"
    assert error.startswith("ClusterError: profile 'gang': could not start 2 worker(s) (devices: 0,1): "), (
        error
    )
    assert status["state"] != "running" and status["devices"] == [] and status["workers"] == 0
    assert held == {"0": None, "1": None}, "a failed gang start leaves no device leased"
    assert after == ("0",)
    # no_leaked_processes: the worker of device 0, which had started, is gone too


def test_a_gang_that_cannot_get_all_its_devices_in_time_fails_naming_profile_and_wait(
    tmp_path, lease_dir, monkeypatch
):
    monkeypatch.setenv("GPU_TASKS_LEASE_TIMEOUT", "1")
    holder = _holder(tmp_path, lease_dir, "1")  # another flow run's lease on device 1, held throughout

    @flow(task_runner=ProfileTaskRunner(profiles=[CPU, GANG]))
    def f():
        gang = _error(devices.with_options(tags=[profile("gang")]).submit())
        return gang, FlowRunContext.get().task_runner.status()["gang"], leases.holders(lease_dir, ["0", "1"])

    try:
        error, status, held = f()
    finally:
        _stop(holder)
    assert error.startswith("ClusterError: "), error
    assert "profile 'gang' is a gang of 2 workers; it starts all of them or none" in error
    assert "waited 1." in error and "GPU_TASKS_LEASE_TIMEOUT (now 1s)" in error
    assert status["state"] == "absent" and status["workers"] == 0
    assert held["0"] is None, "the device the gang could get was given back"
    assert held["1"] is not None and held["1"]["pid"] == holder.pid


def test_gang_timeout_error_names_who_holds_the_missing_device(tmp_path, lease_dir, monkeypatch):
    """Like a single profile's lease timeout (tests/test_leases.py), the gang's names the holder."""
    monkeypatch.setenv("GPU_TASKS_LEASE_TIMEOUT", "1")
    holder = _holder(tmp_path, lease_dir, "1")

    @flow(task_runner=ProfileTaskRunner(profiles=[CPU, GANG]))
    def f():
        return _error(devices.with_options(tags=[profile("gang")]).submit())

    try:
        error = f()
    finally:
        _stop(holder)
    assert "ClusterError" in error
    assert "device 1: " in error and "holder-run" in error and f"pid {holder.pid}" in error, error


def test_a_waiting_gang_gets_devices_an_idle_profile_of_its_run_holds_at_once(lease_dir, monkeypatch):
    """The gang queues for all of its devices like any profile: an idle holder gives its device
    back at once (not after its idle timeout), and the gang never takes part of them meanwhile."""
    monkeypatch.setenv("GPU_TASKS_LEASE_TIMEOUT", "5")
    lazy = ResourceProfile(name="single", gpus=1, max_workers=1, idle_timeout=300)
    gang = GANG.model_copy(update={"idle_timeout": 60.0})  # still up when the flow looks

    @flow(task_runner=ProfileTaskRunner(profiles=[CPU, gang, lazy]))
    def f():
        runner = FlowRunContext.get().task_runner
        first = devices.with_options(tags=[profile("single")]).submit().result()
        gang = devices.with_options(tags=[profile("gang")]).submit().result()
        return first, gang, runner.status()["gang"], [r.as_dict() for r in runner.ledger]

    first, gang, status, ledger = f()
    assert len(first) == 1 and len(gang) == 1
    assert status["workers"] == 2 and sorted(status["devices"]) == ["0", "1"], status
    single = [r for r in ledger if r["profile"] == "single"]
    assert single and "released its devices early: profile 'gang' is waiting for them" in single[0]["reason"]
