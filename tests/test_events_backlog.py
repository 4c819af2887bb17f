"""Back-pressure from Prefect's event queue (gpu_tasks.prefect_api.backlog): task runs wait to start
while too many of their process's events wait to be sent, so a slow server cannot make the flow
process's memory grow without bound (each waiting event holds its task run's engine)."""

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
    monkeypatch.setenv("GPU_TASKS_EVENTS_BACKLOG_LIMIT", str(LIMIT))
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
        waited = backlog._THIS_PROCESS[0].waited_s if backlog._THIS_PROCESS else 0.0
        backlog._forget()
    assert values == [x + 1 for x in range(300)]
    # task runs waited (300 tasks make about 900 events, faster than the server takes them), and
    # the queue stayed near the limit: over it only by what the tasks already running emitted
    assert waited > 0, max(seen)
    running_at_most = 8  # the profile's threads (cpus=1: its slots), each emitting up to 3 events
    assert max(seen) <= LIMIT + 3 * running_at_most + 20, max(seen)
    said = [r.getMessage() for r in caplog.records if r.name == "gpu_tasks.prefect_api.backlog"]
    assert len(said) == 1 and "task runs wait to start" in said[0] and "EVENTS_BACKLOG_LIMIT=40" in said[0]
