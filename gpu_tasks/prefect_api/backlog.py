"""Back-pressure from Prefect's event queue: task runs wait to start while too many events wait.

Each task run's engine emits its state changes as events, which this process's Prefect
``EventsWorker`` sends to the server from a queue; each queued event keeps a copy of the run
context it was emitted in, and through it the task run's engine (task run, states, the event):
about 15 KiB an event, measured. When the server takes events more slowly than the flow's tasks
make them (the embedded SQLite server under thousands of short tasks), the queue grows without
bound: 17,852 events and 513 MiB at the peak of a 10,000-task run, and past 2 GiB at 100,000.
So in each process that runs task runs (the flow process's threads for in-process profiles, each
worker process), a task run waits to start, in its slot, while more than
``GPU_TASKS_TUNE_EVENTS_BACKLOG_LIMIT`` events of that process wait to be sent (0: never); it goes on
when fewer do, or when the queue has not shrunk for ``STALL_S`` (a server that takes nothing:
waiting would only stop the flow; Prefect keeps or drops those events as it does without
gpu-tasks). Tasks already running go on: the queue overshoots by what they emit.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from gpu_tasks.compat.prefect_server import events_backlog
from gpu_tasks.settings import get_settings

logger = logging.getLogger(__name__)

STALL_S = 30.0  # the queue not shrinking this long: go on
POLL_S = 0.05


class EventsBacklog:
    """One per process (:func:`wait_to_start`): :meth:`wait` before each task run; says so once."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = get_settings().events_backlog_limit if limit is None else limit
        self.waited_s = 0.0  # in all, for the run's summary and tests
        self._said = False
        self._lock = threading.Lock()

    def wait(self) -> float:
        """Block while more than ``limit`` events wait to be sent; the seconds waited."""
        if self.limit <= 0:
            return 0.0
        queued = events_backlog()
        if queued <= self.limit:
            return 0.0
        start = last_move = time.monotonic()
        least = queued
        with self._lock:
            first, self._said = not self._said, True
        if first:
            logger.info(
                "gpu-tasks: task runs wait to start while %d Prefect events wait to be sent to the server "
                "(GPU_TASKS_TUNE_EVENTS_BACKLOG_LIMIT=%d): the server takes them more slowly than this "
                "flow's tasks make them, and each waiting event holds its task run's engine in memory. A "
                "server that holds this load: docs/operations.md#a-prefect-server-that-holds-the-load",
                queued,
                self.limit,
            )
        while queued > self.limit:
            time.sleep(POLL_S)
            queued = events_backlog()
            now = time.monotonic()
            if queued < least:
                least, last_move = queued, now
            elif now - last_move > STALL_S:
                logger.warning(
                    "gpu-tasks: %d Prefect events have not been sent for %.0f s (is the server up?); "
                    "submitting tasks again without waiting for them",
                    queued,
                    STALL_S,
                )
                break
        waited = time.monotonic() - start
        with self._lock:
            self.waited_s += waited
        return waited


_THIS_PROCESS: list[EventsBacklog] = []
_CREATE = threading.Lock()


def wait_to_start() -> float:
    """Before a task run in this process: wait while this process's events back up (seconds)."""
    if not _THIS_PROCESS:
        with _CREATE:
            if not _THIS_PROCESS:
                _THIS_PROCESS.append(EventsBacklog())
    return _THIS_PROCESS[0].wait()


def waited_seconds() -> float:
    """The seconds this process's task runs have waited in all for its events to be sent (0 if none)."""
    return _THIS_PROCESS[0].waited_s if _THIS_PROCESS else 0.0


def _forget() -> None:  # a forked child counts its own events, with its own settings
    global _CREATE
    _CREATE = threading.Lock()
    _THIS_PROCESS.clear()


os.register_at_fork(after_in_child=_forget)
