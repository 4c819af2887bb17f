"""Back-pressure from Prefect's event queue (gpu_tasks.prefect_api.backlog): task runs wait to start
while too many of their process's events wait to be sent, so a slow server cannot make the flow
process's memory grow without bound (each waiting event holds memory: for gpu-tasks' task runs a
slim run context, for others Prefect's whole copy of it, their task run's engine included)."""

from __future__ import annotations

import logging
import threading

import pytest
from prefect import flow, task

from gpu_tasks import ProfileTaskRunner, ResourceProfile, profile
from gpu_tasks.compat.prefect_server import events_backlog
from gpu_tasks.prefect_api import backlog

LIMIT = 40


@task(tags=[profile("cpu")])
def inc(x: int) -> int:
    return x + 1


@pytest.mark.usefixtures("prefect_server")
def test_task_runs_wait_while_their_processs_events_back_up(monkeypatch, caplog):
    monkeypatch.setenv("GPU_TASKS_TUNE_EVENTS_BACKLOG_LIMIT", str(LIMIT))
    backlog._forget()  # this process's instance reads the limit set here
    seen: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.005):
            seen.append(events_backlog())

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="cpu", cpus=1)], default="cpu"))
    def many() -> list[int]:
        return [f.result() for f in inc.map(range(300))]

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        with caplog.at_level(logging.INFO, logger="gpu_tasks.prefect_api.backlog"):
            values = many()
    finally:
        stop.set()
        sampler.join()
        waited = backlog.waited_seconds()
        backlog._forget()
    assert values == [x + 1 for x in range(300)]
    # task runs waited (300 tasks make about 900 events, faster than the server takes them), and
    # the queue stayed near the limit: over it only by what the tasks already running emitted
    assert waited > 0, max(seen)
    running_at_most = 8  # the profile's threads (cpus=1: its slots), each emitting up to 3 events
    assert max(seen) <= LIMIT + 3 * running_at_most + 20, max(seen)
    said = [r.getMessage() for r in caplog.records if r.name == "gpu_tasks.prefect_api.backlog"]
    assert len(said) == 1 and "task runs wait to start" in said[0] and "EVENTS_BACKLOG_LIMIT=40" in said[0]


@task(tags=[profile("gpu")])
def burst(n: int, name: str, size: int) -> int:
    """Emits ``n`` events, then ends: its flow ends, and closes its worker, while most of them
    still wait in the worker's queue."""
    from prefect.events import emit_event

    pad = "x" * size
    for i in range(n):
        emit_event(event=name, resource={"prefect.resource.id": f"burst.{i}"}, payload={"pad": pad})
    return n


def _stored_events(name: str, want: int, quiet_s: float = 20.0) -> int:
    """Events named ``name`` the server has stored, once it has ``want`` or the count has not moved
    for ``quiet_s``."""
    import time

    import httpx
    from prefect.settings import PREFECT_API_URL

    last, moved = -1, time.monotonic()
    body = {"filter": {"event": {"name": [name]}}, "limit": 1}
    url = f"{PREFECT_API_URL.value()}/events/filter"
    while True:
        total = int(httpx.post(url, json=body, timeout=30).json()["total"])
        if total >= want:
            return total
        if total != last:
            last, moved = total, time.monotonic()
        elif time.monotonic() - moved > quiet_s:
            return total
        time.sleep(0.5)


@pytest.mark.usefixtures("prefect_server")
def test_a_closing_worker_sends_its_queued_events_before_it_exits(monkeypatch):
    """A task on a worker process emits a burst of events and returns; the flow ends and closes its
    worker at once, with thousands of them still queued (more than the close grace takes to send).
    The worker sends them before it exits, and the runner waits for it to: every event reaches the
    server (before, the worker was ended 3 s after the close and the rest were lost)."""
    import uuid

    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "1")
    n, name = 4000, f"gpu-tasks-test.burst.{uuid.uuid4().hex[:8]}"  # 32 MiB of payload: seconds to send

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="gpu", gpus=1)]))
    def one_burst() -> int:
        return burst.submit(n, name, 8192).result()

    assert one_burst() == n
    assert _stored_events(name, n) == n


class Held:
    """A task parameter that says when it is freed (a weak reference to it dies)."""


@task(tags=[profile("cpu")])
def touch(held: Held, n: int) -> int:
    return n


def _task_run_events(task_run_id: str, want: int = 3, within_s: float = 60.0) -> list[dict]:
    """The events the server stored for a task run, once it has ``want`` of them (the server
    stores what it receives a few seconds later)."""
    import time

    import httpx
    from prefect.settings import PREFECT_API_URL

    body = {"filter": {"resource": {"id": [f"prefect.task-run.{task_run_id}"]}}, "limit": 10}
    url = f"{PREFECT_API_URL.value()}/events/filter"
    deadline = time.monotonic() + within_s
    while True:
        events = httpx.post(url, json=body, timeout=30).json()["events"]
        if len(events) >= want or time.monotonic() > deadline:
            return events
        time.sleep(0.5)


@pytest.mark.usefixtures("prefect_server")
@pytest.mark.parametrize("runner", ["gpu-tasks", "thread pool"])
def test_a_queued_event_keeps_neither_its_task_runs_parameters_nor_its_engine(monkeypatch, runner):
    """Prefect's events worker keeps a copy of the run context for each event until it sends it:
    with a slow server, every finished task run's parameters (and result, and engine) stayed in
    memory as long as its events waited. gpu-tasks' task runs keep a slim context instead: their
    parameters are freed as soon as they end while their events still wait, and once sent those
    carry the same related resources as the thread pool's (flow run, flow, tags). The thread
    pool's queued events keep them all, as Prefect ships. (A service Prefect starts from inside a
    task run, its tag-slot lease service, keeps that one run's context for good: one at most.)"""
    import asyncio
    import functools
    import gc
    import weakref

    from prefect.events.worker import EventsWorker
    from prefect.task_runners import ThreadPoolTaskRunner

    gate = threading.Event()
    handle = EventsWorker._handle

    @functools.wraps(handle)  # the compat check reads Prefect's own code through it
    async def held_back(self, event):  # the server takes nothing until the gate opens
        await asyncio.to_thread(gate.wait, 120)
        await handle(self, event)

    monkeypatch.setattr(EventsWorker, "_handle", held_back)
    task_runner = (
        ProfileTaskRunner(profiles=[ResourceProfile(name="cpu", cpus=1)], default="cpu")
        if runner == "gpu-tasks"
        else ThreadPoolTaskRunner(max_workers=1)
    )
    n = 6

    @flow(task_runner=task_runner)
    def drop_them() -> tuple[int, int, str]:
        refs = []
        for i in range(n):
            held = Held()
            refs.append(weakref.ref(held))
            assert touch.submit(held, i).result() == i
            del held
        gc.collect()
        last = touch.submit(Held(), n)
        last.result()
        return sum(ref() is not None for ref in refs), events_backlog(), str(last.task_run_id)

    try:
        kept, queued, task_run_id = drop_them()
    finally:
        gate.set()
    assert queued >= 3 * n, queued  # each task run's Pending, Running and Completed wait to be sent
    if runner == "gpu-tasks":
        assert kept <= 1, kept
    else:
        assert kept >= n - 1, kept
    events = _task_run_events(task_run_id)
    assert len(events) >= 3, events
    kinds = {r["prefect.resource.id"].rsplit(".", 1)[0] for e in events for r in e["related"]}
    assert {"prefect.flow-run", "prefect.flow", "prefect.tag"} <= kinds, kinds
