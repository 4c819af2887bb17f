"""A GPU task that must wait for a Prefect tag concurrency slot holds no device while it waits
(PrefectHQ/prefect#8539): the flow process holds the slot from before the device lease until the
task ends, and the worker's task engine does not take a second one."""

from __future__ import annotations

import time
import uuid

import pytest
from prefect import flow, task
from prefect.context import FlowRunContext
from prefect_api import api, flow_run_events

from gpu_tasks import ProfileTaskRunner, ResourceProfile, current_allocation

pytestmark = pytest.mark.usefixtures("no_leaked_processes", "emulated", "lease_dir")


@task
def hold(seconds: float) -> dict:
    start = time.time()
    time.sleep(seconds)
    return {"devices": current_allocation().devices, "start": start, "end": time.time()}


@pytest.fixture
def serial_tag():
    tag = f"serial-{uuid.uuid4().hex[:8]}"
    code, body = api("POST", "/v2/concurrency_limits/", json={"name": f"tag:{tag}", "limit": 1})
    assert code == 201, body
    yield tag
    api("DELETE", f"/v2/concurrency_limits/tag:{tag}")


def test_a_task_waiting_for_a_tag_slot_leases_no_device(serial_tag):
    gpu = ResourceProfile(name="gpu", gpus=1, idle_timeout=30)
    serial = hold.with_options(tags=["profile:gpu", serial_tag])

    @flow(task_runner=ProfileTaskRunner(profiles=[gpu]))
    def two_serial():
        runner = FlowRunContext.get().task_runner
        futures = [serial.submit(1.5) for _ in range(2)]
        results = [f.result() for f in futures]
        return results, runner.status()["gpu"], FlowRunContext.get().flow_run.id

    results, status, run_id = two_serial()
    first, second = sorted(results, key=lambda r: r["start"])
    assert second["start"] >= first["end"] - 0.05  # the limit of 1 held: one at a time
    # the waiting task leased no second device: the profile never grew past one worker
    assert status["workers"] == 1 and len(status["devices"]) == 1, status
    # the wait for the slot is an event of its own, apart from waits for devices
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all(timeout=10)
    deadline = time.monotonic() + 15
    waits: list = []
    while time.monotonic() < deadline and not any(e["payload"]["seconds"] >= 1.0 for e in waits):
        waits = flow_run_events(run_id, {"name": ["gpu-tasks.task.slot-waited"]})
    # the second task waited for the first one's 1.5 s (the first may log its API round trip too)
    [event] = [e for e in waits if e["payload"]["seconds"] >= 1.0]
    assert event["payload"]["limits"] == sorted(["tag:profile:gpu", f"tag:{serial_tag}"])


def test_the_slot_is_taken_once_so_a_limit_of_one_never_deadlocks(serial_tag):
    gpu = ResourceProfile(name="gpu", gpus=0.5, idle_timeout=30)

    @flow(task_runner=ProfileTaskRunner(profiles=[gpu]))
    def one():
        return hold.with_options(tags=["profile:gpu", serial_tag]).submit(0.2).result()

    started = time.monotonic()
    assert one()["devices"]
    assert time.monotonic() - started < 60
