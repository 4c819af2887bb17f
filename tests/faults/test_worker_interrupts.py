"""The worker side of a lost flow process or a lost scheduler, without a cluster: the watch thread
interrupts a task whose key its scheduler released, and the tasks still running when the worker
closes (whose crash then goes unreported); an unreachable API is asked again every ``longest`` s.
On an in-process cluster: a task is interrupted once, by the runner or the watch thread."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from gpu_tasks.compat.api_busy import BusyWait
from gpu_tasks.worker import interrupts


class FakeWorker:
    def __init__(self) -> None:
        self.address = "tcp://10.213.77.11:1"
        self.status = SimpleNamespace(name="running")
        self.state = SimpleNamespace(tasks={})


def _task_thread(key: str, worker: FakeWorker) -> tuple[threading.Thread, list[str]]:
    """A thread registered as running ``key``, as ``engine._interruptible`` registers one."""
    seen: list[str] = []
    ready = threading.Event()

    def run() -> None:
        with interrupts.INTERRUPTIBLE_LOCK:
            interrupts.INTERRUPTIBLE[threading.get_ident()] = key
        worker.state.tasks[key] = SimpleNamespace(state="executing")
        ready.set()
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # Python between short sleeps, as a task
                time.sleep(0.02)
            seen.append("ran to its end")
        except KeyboardInterrupt:
            seen.append("interrupted")
        finally:
            with interrupts.INTERRUPTIBLE_LOCK:
                interrupts.INTERRUPTIBLE.pop(threading.get_ident(), None)
                seen.append("orphaned" if threading.get_ident() in interrupts.ORPHANED else "")
                interrupts.ORPHANED.discard(threading.get_ident())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait(5)
    return thread, seen


def test_released_keys_are_those_the_worker_holds_cancelled():
    worker = FakeWorker()
    worker.state.tasks = {"a": SimpleNamespace(state="executing"), "b": SimpleNamespace(state="cancelled")}
    assert interrupts.released_keys(worker, ["a", "b", "gone"]) == ["b"]


def test_a_released_task_is_interrupted_and_its_crash_reported(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(interrupts, "RELEASED_POLL_S", 0.05)
    worker = FakeWorker()
    keep, kept = _task_thread("keep", worker)
    drop, dropped = _task_thread("drop", worker)
    interrupts.watch_released(worker)
    worker.state.tasks["drop"].state = "cancelled"  # the scheduler released it: its client is gone
    drop.join(2)
    assert dropped == ["interrupted", ""]  # not an orphan: Prefect reports its crash
    assert keep.is_alive() and kept == []
    worker.status.name = "closing"  # then the worker loses its scheduler
    keep.join(2)
    assert kept == ["interrupted", "orphaned"]


def test_an_orphans_crash_is_not_reported(monkeypatch: pytest.MonkeyPatch):
    from prefect.task_engine import SyncTaskRunEngine

    reported: list[BaseException] = []
    monkeypatch.setattr(SyncTaskRunEngine, "handle_crash", lambda self, exc: reported.append(exc))
    interrupts._quiet_orphan_crash()
    engine = SimpleNamespace(task_run=SimpleNamespace(id="r1"), _raised=None)
    crash = KeyboardInterrupt()
    SyncTaskRunEngine.handle_crash(engine, crash)  # type: ignore[arg-type]
    assert reported == [crash]
    interrupts.ORPHANED.add(threading.get_ident())
    try:
        SyncTaskRunEngine.handle_crash(engine, crash)  # type: ignore[arg-type]
    finally:
        interrupts.ORPHANED.discard(threading.get_ident())
    assert reported == [crash] and engine._raised is crash


def test_an_unreachable_api_is_asked_again_every_longest_seconds_at_most():
    wait = BusyWait("reading a task run", timeout=600, longest=5.0)
    refused = httpx.ConnectError("[Errno 111] Connection refused")
    waits = [wait.next_wait(refused) for _ in range(8)]
    assert waits[0] <= 1.0 and max(waits) <= 5.0 and waits[-1] >= 5.0 * 0.8, waits  # never past `longest`
    with pytest.raises(ValueError):
        wait.next_wait(ValueError("an answer, not a busy API"))


@pytest.mark.processes  # a Dask worker's start may run `uname -p` (platform.processor(), once a process)
def test_a_task_stopped_by_its_runner_and_then_released_is_interrupted_once(monkeypatch: pytest.MonkeyPatch):
    """Ctrl-C on an ``address`` flow: the runner cancels the task, then interrupts it out of band; its
    worker's watch thread, which sees it released a moment later, must not interrupt it again while
    Prefect's engine handles the first interrupt (a second one there once leaked a logging lock and
    wedged the worker). A real Dask worker, in this process; the engine stands in for Prefect's."""
    from distributed import Client, LocalCluster

    from gpu_tasks.worker import engine

    monkeypatch.setattr(interrupts, "RELEASED_POLL_S", 0.02)
    seen: list[str] = []
    running, handling = threading.Event(), threading.Event()

    def prefects_engine(alloc: object, task: object, kwargs: dict) -> None:
        try:
            running.set()
            while True:  # the task's body
                time.sleep(0.01)
        except KeyboardInterrupt:
            seen.append("interrupted")
            try:  # Prefect's engine logs the crash and reports it: a second interrupt lands here
                handling.set()
                time.sleep(1.0)
            except KeyboardInterrupt:
                seen.append("interrupted again")
            raise

    monkeypatch.setattr(engine, "run_engine", prefects_engine)

    def run() -> object:
        from distributed import get_worker

        alloc = SimpleNamespace(device_keys=(), worker="w")
        return engine._interruptible(get_worker(), alloc, None, {"task_run_id": None})  # type: ignore[arg-type]

    with (
        LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster,
        Client(cluster) as client,
    ):
        future = client.submit(run, key="g-1", pure=False)
        assert running.wait(10)
        client.cancel(future)  # the runner cancels its unfinished tasks, then interrupts them
        client.run(interrupts.interrupt_tasks, ["g-1"], "stop")  # (or the watch thread came first)
        assert handling.wait(5)
        assert "g-1" not in interrupts.INTERRUPTIBLE.values()  # no longer interruptible
        assert client.run(interrupts.interrupt_tasks, ["g-1"], "stop").popitem()[1] == []
        worker = next(iter(cluster.workers.values()))
        deadline = time.monotonic() + 10
        while worker.state.executing_count and time.monotonic() < deadline:
            time.sleep(0.02)
    assert seen == ["interrupted"]
