"""A closing worker process sends the Prefect events and run logs it still queues (thousands under a
slow server), and tells the runner so, which then does not end it first."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from multiprocessing.connection import Connection

logger = logging.getLogger(__name__)


def send_before_exit(conn: Connection) -> None:
    """Before a closed worker exits: say ``("draining", n)`` on ``conn``, then send what it queues for
    up to ``GPU_TASKS_TUNE_EVENTS_DRAIN_SECONDS``; what is left then is lost, and said."""
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
    """Whether a closing worker said ``("draining", n)`` on ``conn``."""
    with contextlib.suppress(OSError, EOFError, ValueError):
        while conn.poll(0):
            if conn.recv()[0] == "draining":
                return True
    return False
