"""The flow thread never waits for a device, and one profile's provisioning holds back no other
profile's results (docs/runner.md, "Threads").

Another process holds a device through its lease file, as another flow run on the host would;
it lets go when the test says so, or after HOLD_S. Each test asserts an order: what must happen
while the device is still held happens before the holder lets go.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from prefect import flow, task

from gpu_tasks import ProfileTaskRunner, ResourceProfile, current_allocation, profile

pytestmark = pytest.mark.usefixtures("prefect_server", "no_leaked_processes")

HOLD_S = 90  # the holder's own limit: a frozen flow ends the test late, never hangs it

HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from gpu_tasks.devices import leases

    lease_dir, address, folder, hold_s = sys.argv[1:5]
    info = dict(leases.owner_info("holder"), flow_run_name="holder-run", flow_run_id="holder-id")
    held = leases.take([address], info, lease_dir)
    assert held is not None
    Path(folder, "ready").write_text("held")
    deadline = time.monotonic() + float(hold_s)
    while not Path(folder, "release").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    leases.release(held)
    Path(folder, "gone").write_text("released")
    """
)

_PROCS: list[subprocess.Popen[bytes]] = []


class Holder:
    """Another process leasing one device until :meth:`release` (or ``HOLD_S``). Picklable (its
    folder alone): the flows below use it, and Prefect sends a flow's closure to its workers."""

    def __init__(self, tmp_path: Path, lease_dir: Path, address: str) -> None:
        self.folder = tmp_path / "holder"
        self.folder.mkdir()
        script = tmp_path / "holder.py"
        script.write_text(HOLDER)
        args = [sys.executable, str(script), str(lease_dir), address, str(self.folder), str(HOLD_S)]
        proc = subprocess.Popen(args)
        _PROCS.append(proc)
        _until((self.folder / "ready").exists, "the holder's lease", lambda: proc.poll() is None)

    def holding(self) -> bool:
        return not (self.folder / "gone").exists()

    def release(self) -> None:
        (self.folder / "release").write_text("go")
        _until((self.folder / "gone").exists, "the holder to let go", timeout=30)


@pytest.fixture(autouse=True)
def _reap_holders():
    yield
    while _PROCS:
        proc = _PROCS.pop()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _until(check, what: str, alive=lambda: True, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert alive(), f"gave up waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@task(tags=[profile("gpu")])
def on_gpu(i: int) -> list[str]:
    return list(current_allocation().devices)


@task
def on_cpu(i: int) -> int:
    return i + 1


def test_a_cpu_task_runs_while_the_flows_gpu_tasks_wait_for_a_device(tmp_path, lease_dir, monkeypatch):
    """The only device is another process's: the flow's first GPU task waits for it, on its
    profile's thread. Two more GPU submits and a CPU task submitted after it return, and the CPU
    task finishes, while the device is still held."""
    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "1")
    holder = Holder(tmp_path, lease_dir, "0")
    seen: dict[str, object] = {}

    @flow(
        task_runner=ProfileTaskRunner(
            profiles=[
                ResourceProfile(name="cpu", cpus=1),
                ResourceProfile(name="gpu", gpus=1, idle_timeout=5),
            ],
            default="cpu",
        )
    )
    def waits_for_a_device() -> list[list[str]]:
        from prefect.context import FlowRunContext

        from gpu_tasks.devices import leases

        first = on_gpu.submit(0)
        # the profile's thread is waiting for the device now (queued behind the holder)
        _until(lambda: any(w.get("profile") == "gpu" for w in leases.waiters()), "the profile to queue")
        # and the server has its task run, Pending, saying why (before, none until it started)
        _until(lambda: _state_of(first.task_run_id) is not None, "the waiting task run on the server")
        seen["while waiting"] = _state_of(first.task_run_id)
        # a waiter of higher priority (another flow run's) arrives: the record says so (it kept naming
        # the first reason: a new-user pass)
        urgent = leases.enqueue(
            ["0"], dict(leases.owner_info("urgent"), flow_run_name="urgent-run"), priority=5
        )
        try:
            _until(
                lambda: "urgent" in ((_state_of(first.task_run_id) or ("", ""))[1]), "the record's new reason"
            )
        finally:
            leases.dequeue(urgent)
        seen["run"] = FlowRunContext.get().flow_run.id
        more = [on_gpu.submit(i) for i in (1, 2)]
        cpu = on_cpu.submit(41)
        seen["cpu"] = cpu.result(timeout=HOLD_S)
        seen["holding after the cpu task"] = holder.holding()
        seen["gpu done before release"] = any(f.state.is_final() for f in [first, *more])
        holder.release()
        return [f.result() for f in [first, *more]]

    try:
        devices = waits_for_a_device()
    finally:
        holder.release()
    state_type, message = seen.pop("while waiting")
    assert state_type == "PENDING" and message.startswith("Waiting for devices: device 0 is held by"), message
    # the engine's states followed on the same task runs: one each, all Completed
    from prefect_api import flow_run_task_runs

    runs = flow_run_task_runs(  # as the server records them, from their events a moment later
        seen.pop("run"), lambda rs: len(rs) == 4 and all(r["state_type"] == "COMPLETED" for r in rs)
    )
    assert sorted((r["name"].rsplit("-", 1)[0], r["state_type"]) for r in runs) == [
        ("on_cpu", "COMPLETED"),
        *[("on_gpu", "COMPLETED")] * 3,
    ], runs
    assert all("gpu:0" in r["tags"] for r in runs if r["name"].startswith("on_gpu")), runs
    assert seen == {"cpu": 42, "holding after the cpu task": True, "gpu done before release": False}
    assert devices == [["0"]] * 3


def _state_of(task_run_id) -> tuple[str, str] | None:
    """The server's state type and message of a task run (``None``: it has no such task run)."""
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            state = client.read_task_run(task_run_id).state
    except Exception:
        return None
    return None if state is None else (state.type.value, state.message or "")


def test_a_cache_hit_returns_while_its_profile_waits_for_a_device(tmp_path, lease_dir, monkeypatch):
    """A GPU profile's thread waits for the only device (another process's) to start its cluster;
    a task of the same profile whose result Prefect has cached returns meanwhile: it needs no
    device, and finishing it does not wait for the profile's provisioning."""
    from prefect.cache_policies import INPUTS

    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "1")
    salt = uuid.uuid4().hex  # inputs of this test only

    @task(tags=[profile("gpu")], cache_policy=INPUTS, result_storage=tmp_path / "results")
    def cached(x: int, salt: str) -> int:
        return x * x

    gpu = ResourceProfile(name="gpu", gpus=1, idle_timeout=5)

    @flow(task_runner=ProfileTaskRunner(profiles=[gpu]))
    def fill_the_cache() -> int:
        return cached.submit(4, salt).result()

    assert fill_the_cache() == 16
    holder = Holder(tmp_path, lease_dir, "0")
    seen: dict[str, object] = {}

    @flow(task_runner=ProfileTaskRunner(profiles=[gpu]))
    def hit_while_waiting() -> list[str]:
        from gpu_tasks.devices import leases

        first = on_gpu.submit(0)
        _until(lambda: any(w.get("profile") == "gpu" for w in leases.waiters()), "the profile to queue")
        hit = cached.submit(4, salt)
        seen["cached"] = hit.result(timeout=HOLD_S)
        seen["state"] = hit.state.name
        seen["holding after the cache hit"] = holder.holding()
        holder.release()
        return first.result()

    try:
        devices = hit_while_waiting()
    finally:
        holder.release()
    assert seen == {"cached": 16, "state": "Cached", "holding after the cache hit": True}
    assert devices == ["0"]


@task(tags=[profile("pair")])
def on_two(i: int) -> list[str]:
    return list(current_allocation().devices)


@task(tags=[profile("gpu")])
def until_told(folder: str) -> list[str]:
    Path(folder, "started").write_text("yes")
    deadline = time.monotonic() + HOLD_S
    while not Path(folder, "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return list(current_allocation().devices)


def test_one_gpu_profiles_result_lands_while_another_waits_for_devices(tmp_path, lease_dir, monkeypatch):
    from prefect.context import FlowRunContext

    """Two emulated devices, one held by another process. Profile "gpu" runs a task on the other;
    profile "pair" (both devices, one worker) then waits for the held one on its controller. The
    running task finishes meanwhile and its result reaches the flow while the device is still
    held; the idle "gpu" cluster then gives its device to the waiting profile early."""
    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "2")
    holder = Holder(tmp_path, lease_dir, "1")
    folder = tmp_path / "signals"
    folder.mkdir()
    seen: dict[str, object] = {}
    runner = ProfileTaskRunner(
        profiles=[
            ResourceProfile(name="cpu", cpus=1),
            ResourceProfile(name="gpu", gpus=1, idle_timeout=60),
            ResourceProfile(name="pair", gpus=2, idle_timeout=5),
        ],
        default="cpu",
    )

    @flow(task_runner=runner)
    def two_profiles() -> list[str]:
        from gpu_tasks.devices import leases

        running = until_told.submit(str(folder))
        _until((folder / "started").exists, "the gpu task to start", timeout=HOLD_S)
        pair = on_two.submit(0)
        _until(lambda: any(w.get("profile") == "pair" for w in leases.waiters()), "the pair to queue")
        (folder / "go").write_text("go")
        seen["gpu"] = running.result(timeout=HOLD_S)
        seen["pair done before release"] = pair.state.is_final()
        seen["holding after the gpu result"] = holder.holding()
        holder.release()
        devices = pair.result(timeout=HOLD_S)
        ledger = FlowRunContext.get().task_runner.ledger  # the run's copy of the runner
        seen["gpu closed"] = [r.reason for r in ledger if r.profile == "gpu"]
        return devices

    try:
        devices = two_profiles()
    finally:
        holder.release()
    assert seen == {
        "gpu": ["0"],
        "pair done before release": False,
        "holding after the gpu result": True,
        "gpu closed": ["released its devices early: profile 'pair' is waiting for them"],
    }
    assert sorted(devices) == ["0", "1"]


def test_a_task_still_waiting_when_its_flow_returns_ends_cancelled(tmp_path, lease_dir, monkeypatch):
    """A flow that returns without waiting for a task that still waits for devices: Prefect's own
    runners cancel such a task. It ended Failed ("the runner stopped while waiting for devices"), an
    error of its own though the flow chose not to wait (a new-user pass, 2 of 2)."""
    from prefect.context import FlowRunContext

    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "1")
    holder = Holder(tmp_path, lease_dir, "0")
    ids: list = []

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="gpu", gpus=1)]))
    def returns_at_once() -> None:
        from gpu_tasks.devices import leases

        ids.append(on_gpu.submit(0).task_run_id)
        ids.append(FlowRunContext.get().flow_run.id)
        _until(lambda: any(w.get("profile") == "gpu" for w in leases.waiters()), "the profile to queue")

    try:
        returns_at_once()
    finally:
        holder.release()
    from faults._procs import server_task_run

    run = server_task_run(ids[0], lambda r: r["state_type"] not in ("PENDING", "RUNNING"))
    assert run["state_type"] == "CANCELLED", run["state"]
    assert run["state"]["message"].startswith("the flow run ended before this task ran"), run["state"]
    assert run["run_count"] == 0, run


def _listening_pool_processes() -> list[int]:
    """This process's warm-pool processes (forked by its fork server) that listen: schedulers."""
    import psutil

    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if "forkserver" in " ".join(proc.cmdline()) and any(
                c.status == psutil.CONN_LISTEN for c in proc.net_connections("tcp")
            ):
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


def test_a_scheduler_killed_while_its_profile_waits_for_a_device_is_replaced(
    tmp_path, lease_dir, monkeypatch
):
    """A profile's scheduler starts before its lease, so it can die while the profile waits (killed,
    out of memory). Its workers then waited for it until the provision timeout and the task failed
    (a cancel's SIGTERM to the process group held a closing flow process that long, until Prefect's
    SIGKILL); now another scheduler starts after the lease and the task runs."""
    import os
    import signal

    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "1")
    monkeypatch.setenv("GPU_TASKS_PROVISION_TIMEOUT", "20")  # the old code's failure, sooner
    holder = Holder(tmp_path, lease_dir, "0")
    killed: list[int] = []

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="gpu", gpus=1)]))
    def scheduler_dies_while_waiting() -> list[str]:
        from gpu_tasks.devices import leases

        waiting = on_gpu.submit(0)
        _until(lambda: any(w.get("profile") == "gpu" for w in leases.waiters()), "the profile to queue")
        _until(lambda: bool(_listening_pool_processes()), "its scheduler process")
        [pid] = _listening_pool_processes()
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
        holder.release()
        return waiting.result(timeout=HOLD_S)

    try:
        devices = scheduler_dies_while_waiting()
    finally:
        holder.release()
    assert killed and devices == ["0"]


def test_the_cache_check_finds_a_cached_result_in_an_async_flow(tmp_path):
    """The check made before a device is leased gets the task's result store from Prefect's public
    ``update_for_task``, which returns a coroutine in an async flow's context: it is run on the
    checking thread's own loop, and the cached record is found (no private ``_sync`` keyword)."""
    import asyncio
    import concurrent.futures
    import contextvars

    from prefect.cache_policies import INPUTS

    from gpu_tasks.runner.admission import cached_key

    salt = uuid.uuid4().hex

    @task(cache_policy=INPUTS, result_storage=tmp_path / "results", persist_result=True)
    def square(x: int, salt: str) -> int:
        return x * x

    @flow
    async def fill_then_check() -> tuple[str | None, str | None]:
        assert square(3, salt) == 9  # run in the flow: its result is stored
        ctx = contextvars.copy_context()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # as the runner's executor thread
            hit = pool.submit(ctx.run, cached_key, square, uuid.uuid4(), {"x": 3, "salt": salt})
            miss = pool.submit(ctx.run, cached_key, square, uuid.uuid4(), {"x": 4, "salt": salt})
            return await asyncio.wrap_future(hit), await asyncio.wrap_future(miss)

    hit, miss = asyncio.run(fill_then_check())
    assert hit is not None and miss is None
