"""Nothing waits while holding a device (PrefectHQ/prefect#8539).

A GPU task that must wait for a Prefect tag concurrency slot waits in the flow process,
before any device is leased or worker started for it (gpu_tasks.prefect_api.tag_slots), and the
worker's engine does not take that slot a second time; a GPU task whose result Prefect
has cached is answered in the flow process with no device (gpu_tasks.runner.admission). Behaviour
is read from the lease book, ``runner.status()``, the ledger, the server's events and task
runs; never from timings. Ctrl-C while a task waits: tests/faults/test_ctrl_c.py.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import psutil
import pytest
from faults._procs import server_task_run
from prefect import flow, task
from prefect.cache_policies import INPUTS
from prefect.context import FlowRunContext
from prefect_api import api, flow_run_events, run_logs

from bench.waits import counted
from gpu_tasks import ProfileTaskRunner, ResourceProfile, current_allocation, profile
from gpu_tasks.devices import leases

pytestmark = pytest.mark.usefixtures("no_leaked_processes", "emulated", "lease_dir")


@task
def hold(seconds: float) -> dict:
    """Sleep; report the devices leased on this host (the lease book) at the start and the end."""
    held_at_start = [a for a, info in leases.holders().items() if info is not None]
    start = time.time()
    time.sleep(seconds)
    held_at_end = [a for a, info in leases.holders().items() if info is not None]
    return {
        "devices": current_allocation().devices,
        "start": start,
        "end": time.time(),
        "leased": sorted(set(held_at_start) | set(held_at_end)),
    }


def _limit(name: str, limit: int = 1) -> None:
    code, body = api("POST", "/v2/concurrency_limits/", json={"name": name, "limit": limit})
    assert code == 201, body


@pytest.fixture
def serial_tag():
    tag = f"serial-{uuid.uuid4().hex[:8]}"
    _limit(f"tag:{tag}")
    yield tag
    api("DELETE", f"/v2/concurrency_limits/tag:{tag}")


def _events(run_id, name: str, at_least: int = 1) -> list:
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all(timeout=10)
    return flow_run_events(run_id, {"name": [name]}, at_least=at_least)


def test_a_task_waiting_for_a_tag_slot_leases_no_device(serial_tag):
    """Limit 1 on a tag, two whole-GPU tasks, two free devices: one device, one worker, ever."""
    gpu = ResourceProfile(name="gpu", gpus=1, idle_timeout=30)
    serial = hold.with_options(tags=[profile("gpu"), serial_tag])

    @flow(task_runner=ProfileTaskRunner(profiles=[gpu]))
    def two_serial():
        runner = FlowRunContext.get().task_runner
        futures = [serial.submit(1.5) for _ in range(2)]
        seen_waiting = []  # status() while one task waits for the slot
        while not all(f.wrapped_future.done() for f in futures):
            row = runner.status()["gpu"]
            if row["waiting_for_slots"]:
                seen_waiting.append(row)
            time.sleep(0.05)
        results = [f.result() for f in futures]
        return results, seen_waiting, runner, FlowRunContext.get().flow_run.id

    results, seen_waiting, runner, run_id = two_serial()
    first, second = sorted(results, key=lambda r: r["start"])
    assert second["start"] >= first["end"]  # the limit of 1 held: one at a time
    # the lease book never had a second device: not while the first ran and the second waited
    assert first["leased"] == second["leased"] == list(first["devices"]) == list(second["devices"]), results
    # status() while tasks waited for the slot: never a second device; one task running on the
    # profile's only worker while the other waited
    assert all(len(row["devices"]) <= 1 for row in seen_waiting), seen_waiting
    assert any(row["waiting_for_slots"] == 1 and row["state"] == "running" for row in seen_waiting)
    # the ledger: one cluster lifetime on one device, the slot wait apart from held time
    [row] = runner.ledger
    assert row.devices == tuple(first["devices"]) and row.workers == 1
    assert row.wait_slots_seconds >= 1.0 and row.as_dict()["wait_slots_s"] >= 1.0
    # events: one device leased, and the slot wait as an event of its own
    leased = _events(run_id, "gpu-tasks.device.leased")
    assert len(leased) == 1, leased
    # (the first task's wait is the API's answer time: under load it may pass 0.5 s and be sent too)
    deadline = time.monotonic() + 15
    while True:
        waits = _events(run_id, "gpu-tasks.task.slot-waited")
        longest = max(waits, key=lambda e: e["payload"]["seconds"])
        if longest["payload"]["seconds"] >= 1.0 or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert longest["payload"]["seconds"] >= 1.0, waits
    assert longest["payload"]["limits"] == [f"tag:{serial_tag}"]  # the limits that exist
    assert run_logs(run_id, "held no device meanwhile")


def test_the_slot_is_taken_once_so_a_limit_of_one_never_deadlocks(serial_tag):
    gpu = ResourceProfile(name="gpu", gpus=0.5, idle_timeout=30)

    @flow(task_runner=ProfileTaskRunner(profiles=[gpu]))
    def one():
        return hold.with_options(tags=[profile("gpu"), serial_tag]).submit(0.2).result()

    assert one()["devices"]


def test_limits_on_the_device_tags_a_worker_adds_still_hold():
    """The flow process holds the slots of the tags it knows; ``gpu:<id>`` tags are added on the
    worker, whose engine still takes their slots."""
    _limit("tag:gpu:0")
    try:
        gpu = ResourceProfile(name="gpu", gpus=0.5, max_workers=1, idle_timeout=30)

        @flow(task_runner=ProfileTaskRunner(profiles=[gpu]))
        def two_on_device_0():
            futures = [hold.with_options(tags=[profile("gpu")]).submit(1.0) for _ in range(2)]
            return [f.result() for f in futures]

        results = two_on_device_0()
    finally:
        api("DELETE", "/v2/concurrency_limits/tag:gpu:0")
    first, second = sorted(results, key=lambda r: r["start"])
    assert first["devices"] == second["devices"] == ("0",)  # one worker, two threads on device 0
    assert second["start"] >= first["end"]  # its limit of 1 held on the worker


# ---------------------------------------------------------------- cached results
def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if "resource_tracker" not in _cmd(p)}


def _cmd(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


@task
def base(x: int) -> int:
    return x + 1


def _cached_square(storage: Path):
    @task(tags=[profile("gpu")], cache_policy=INPUTS, result_storage=storage)
    def cached_square(x: int, salt: str) -> dict:
        return {"value": x * x, "pid": os.getpid(), "devices": current_allocation().devices}

    return cached_square


def test_a_cached_gpu_task_holds_no_device_and_starts_no_worker(tmp_path, monkeypatch):
    monkeypatch.setenv("GPU_TASKS_TUNE_WARM_WORKERS", "0")  # so that any process started is a worker
    cached_square = _cached_square(tmp_path / "results")
    salt = uuid.uuid4().hex  # inputs of this test only
    gpu = ResourceProfile(name="gpu", gpus=1, idle_timeout=30)
    cpu = ResourceProfile(name="cpu", cpus=1)

    @flow(task_runner=ProfileTaskRunner(profiles=[cpu, gpu], default="cpu"))
    def squares():
        runner = FlowRunContext.get().task_runner
        before = _children()
        # its input comes from an upstream task: resolved in the flow process for the key
        future = cached_square.submit(base.submit(3), salt)
        out = future.result()
        started = _children() - before
        return out, future.state, counted(runner), runner, started, FlowRunContext.get().flow_run.id

    first, first_state, first_status, _, first_started, _ = squares()
    assert first["value"] == 16 and first["devices"], first  # ran on a worker, on a device
    assert first_state.name == "Completed" and first_status["cache_hits"] == 0
    assert first_started, "the first run started a worker process"

    second, state, status, runner, started, run_id = squares()
    assert second == first  # the cached result, as Prefect returns it
    assert state.name == "Cached" and state.is_completed()
    assert status["state"] == "absent" and status["cache_hits"] == 1, status  # never provisioned
    assert not started, "a worker process started for a cached result"
    assert [row for row in runner.ledger if row.profile == "gpu"] == []  # no device held, no row
    # the server's record of the task run, and the events of the run
    task_run = server_task_run(state.state_details.task_run_id)  # states reach it as events
    assert task_run["state"]["name"] == "Cached", task_run
    assert profile("gpu") in task_run["tags"]
    [hit] = _events(run_id, "gpu-tasks.task.cache-hit")
    assert hit["payload"]["state"] == "Cached" and hit["payload"]["cache_key"]
    assert run_logs(run_id, "result found in Prefect's cache")
    others = flow_run_events(run_id, {"prefix": ["gpu-tasks.cluster.", "gpu-tasks.device."]}, timeout=2)
    assert not [e for e in others if e["resource"].get("gpu-tasks.profile") == "gpu"], others


def test_a_cache_record_gone_before_the_run_sends_the_task_to_its_worker(tmp_path):
    """The key the flow process found has no record by the time Prefect's engine looks (here: a
    cache_key_fn that answers the check and the run differently): the run ends Crashed in the flow
    process, without running the task there, and runs again as a retry on a worker."""
    from prefect.filesystems import LocalFileSystem
    from prefect.results import ResultStore

    storage = tmp_path / "results"
    found = f"found-{uuid.uuid4().hex}"
    ResultStore(result_storage=LocalFileSystem(basepath=str(storage))).write(obj={"value": -1}, key=found)
    calls: list[int] = []

    def key_fn(context, inputs) -> str:
        calls.append(1)
        return found if len(calls) == 1 else f"gone-{uuid.uuid4().hex}"  # the check, then the run

    @task(tags=[profile("gpu")], cache_key_fn=key_fn, result_storage=storage)
    def square(x: int) -> dict:
        return {"value": x * x, "pid": os.getpid(), "devices": current_allocation().devices}

    gpu = ResourceProfile(name="gpu", gpus=1, idle_timeout=30)

    @flow(task_runner=ProfileTaskRunner(profiles=[gpu]))
    def once():
        future = square.submit(5)
        return future.result(), future.state, counted(FlowRunContext.get().task_runner)

    out, state, status = once()
    assert out["value"] == 25 and out["pid"] != os.getpid() and out["devices"], out  # on a worker
    assert state.is_completed() and status["cache_hits"] == 0
    server_task_run(state.state_details.task_run_id, lambda r: r["state_type"] == "COMPLETED")
    _, history = api("GET", "/task_run_states/", params={"task_run_id": str(state.state_details.task_run_id)})
    names = [s["name"] for s in sorted(history, key=lambda s: s["timestamp"])]
    assert "Crashed" in names and names[-1] == "Completed", names
