"""Prefect tag concurrency slots a GPU task takes in the flow process, before it leases a device.

Prefect's task engine takes a task run's ``tag:<tag>`` slots when the run begins, which
on a worker is after the worker was started on a leased device: a task that waits for a
slot there holds the device all the while (PrefectHQ/prefect#8539). Instead the flow
process takes the slots first (:class:`SlotHold`, with Prefect's own ``concurrency``
context and lease renewal), holds them until the task ends, and tells the worker's
engine not to take them again (:func:`gpu_tasks._prefect_private.tag_slots_held_by_flow`).
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable

logger = logging.getLogger("gpu_tasks.runner")


class SlotHold:
    """The tag slots of one task run, held by a thread of the flow process until :meth:`release`."""

    def __init__(self, tags: Iterable[str], task_run_id: uuid.UUID, stop: threading.Event) -> None:
        self.names = [f"tag:{t}" for t in sorted(set(tags))]
        self.task_run_id = task_run_id
        self.stop = stop
        self.waited: float = 0.0
        self._release = threading.Event()

    def start(self, on_acquired: Callable[[float], None], on_error: Callable[[BaseException], None]) -> None:
        """Take the slots on a thread of its own (in the caller's context), then call ``on_acquired(waited)``;
        ``on_error(exc)`` when they cannot be taken."""
        ctx = contextvars.copy_context()
        threading.Thread(
            target=ctx.run,
            args=(self._hold, on_acquired, on_error),
            name=f"gpu-tasks-slots-{self.task_run_id.hex[:8]}",
            daemon=True,
        ).start()

    def _hold(self, on_acquired: Callable[[float], None], on_error: Callable[[BaseException], None]) -> None:
        from gpu_tasks._prefect_private import hold_tag_slots

        t0 = time.monotonic()
        acquired = False
        try:
            with hold_tag_slots(self.names, self.task_run_id) as limited:
                acquired = True
                self.waited = time.monotonic() - t0
                on_acquired(self.waited)
                # no limit on these tags: nothing to renew or give back, so no thread waits
                while limited and not self._release.wait(0.5) and not self.stop.is_set():
                    pass
        except BaseException as exc:  # reported to the task, or logged once it ran
            if not acquired:
                on_error(exc)
            else:
                logger.warning("gpu-tasks: releasing the tag slots of task run %s failed", self.task_run_id)

    def release(self) -> None:
        """Give the slots back (the task ended, or the runner stops)."""
        self._release.set()
