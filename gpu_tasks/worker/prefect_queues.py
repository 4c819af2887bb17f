"""A closing worker process's Prefect queues: the events and run logs it has not yet sent.

A worker's task runs report their states as events, which Prefect's ``EventsWorker`` sends from a
queue; under load (a slow server) that queue holds thousands. The worker sends them before it
exits, and tells the runner it is doing so, so that the runner does not end it first
(:func:`gpu_tasks.worker.warm.end_closed`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from multiprocessing.connection import Connection

logger = logging.getLogger(__name__)


def send_before_exit(conn: Connection) -> None:
    """Before a closed worker exits: send the Prefect events and run logs it still queues.

    Says ``("draining", n)`` on ``conn`` first, so the runner waits ``GPU_TASKS_TUNE_EVENTS_DRAIN_SECONDS``
    past its close grace; what is still queued after that is lost, and said.
    """
    if "prefect.events.worker" not in sys.modules:  # no task run here
        return
    from gpu_tasks.compat.prefect_server import drain_events, drain_logs, events_backlog
    from gpu_tasks.settings import get_settings

    queued = events_backlog()
    if queued:
        with contextlib.suppress(OSError, ValueError):
            conn.send(("draining", queued))
    bound = get_settings().events_drain_seconds
    start = time.monotonic()
    sent = drain_events(bound)
    logs_sent = drain_logs(max(1.0, bound - (time.monotonic() - start)))
    if not (sent and logs_sent):
        logger.warning(
            "gpu-tasks: worker process %d exits with Prefect %s still unsent after %.0f s (%d events were "
            "queued when it closed): the server is slower than this flow's tasks; the UI misses what they "
            "held (GPU_TASKS_TUNE_EVENTS_DRAIN_SECONDS; a server that holds the load: "
            "docs/operations.md#a-prefect-server-that-holds-the-load)",
            os.getpid(),
            "events" if not sent else "run logs",
            time.monotonic() - start,
            queued,
        )


def says_draining(conn: Connection) -> bool:
    """Whether a closing worker said ``("draining", n)`` on ``conn`` (:func:`send_before_exit`)."""
    with contextlib.suppress(OSError, EOFError, ValueError):
        while conn.poll(0):
            if conn.recv()[0] == "draining":
                return True
    return False
