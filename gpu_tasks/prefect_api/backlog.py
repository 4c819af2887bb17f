"""Back-pressure from Prefect's event queue: a task run waits to start while too many events of its
process wait to be sent (docs/operations.md, "A Prefect server that holds the load")."""

from __future__ import annotations

import functools
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

    def __init__(self) -> None:
        self.limit = get_settings().events_backlog_limit
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
                "flow's tasks make them, and each waiting event holds memory until it is sent. A "
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


@functools.cache
def _this_process() -> EventsBacklog:
    return EventsBacklog()


def wait_to_start() -> float:
    """Before a task run in this process: wait while this process's events back up (seconds)."""
    return _this_process().wait()


def waited_seconds() -> float:
    """The seconds this process's task runs have waited in all for its events to be sent."""
    return _this_process().waited_s


_forget = _this_process.cache_clear  # a forked child counts its own events, with its own settings
os.register_at_fork(after_in_child=_forget)
