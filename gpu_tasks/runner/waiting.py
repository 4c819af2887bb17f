"""What a waiting task says about why it waits: its task run's log and a ``gpu-tasks.task.waiting`` event.

While a profile's controller dispatches a task and the device queue (or a shared scheduler's board)
holds it, the code that waits works out why (:mod:`gpu_tasks.devices.wait_reasons`) and tells the
listener the controller set for that dispatch, a :class:`WaitReporter`. The reporter writes the
reason into the waiting task run's Prefect log, at a bounded rate
(:class:`~gpu_tasks.devices.wait_reasons.Throttle`: the first at once, the same one at most every
``LOG_EVERY_S``, a changed one at once but not within ``GAP_S`` of the previous line), and sends the
event when the reason changes. It runs on the controller's thread, in the job's context.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from gpu_tasks.devices import wait_reasons
from gpu_tasks.devices.wait_reasons import Throttle, WaitReason
from gpu_tasks.reporting.logs import task_run_log

if TYPE_CHECKING:
    from gpu_tasks.runner.job import Job
    from gpu_tasks.runner.session import Live

logger = logging.getLogger("gpu_tasks.runner")

LOG_EVERY_S = 30.0  # the same reason is logged again at most this often
GAP_S = 2.0  # a changed reason is logged at once, but not within this of the previous line


class WaitReporter:
    """Says why ``job`` waits (the listener of :data:`gpu_tasks.devices.wait_reasons.LISTENER`)."""

    def __init__(self, live: Live, job: Job, every: float = LOG_EVERY_S, gap: float = GAP_S) -> None:
        self.live, self.job = live, job
        self.throttle = Throttle(every, gap)
        self.started = time.monotonic()
        self.last_event: tuple[str, str] | None = None
        self.log: Any = None

    def __call__(self, reason: WaitReason) -> None:
        now = time.monotonic()
        if not self.throttle.due(reason, now):
            return
        job = self.job
        waited = now - self.started
        if self.log is None:
            self.log = task_run_log(job.task_run_id, self.live.flow_run_id, job.task.name, self.live.run.name)
        try:
            self.log.info("Waiting for devices (%.0fs so far): %s", waited, reason.text)
        except Exception:  # a log line is a courtesy: the wait goes on
            logger.debug("could not log why task %s waits", job.task_run_id, exc_info=True)
        key = self.throttle.last_kind_text
        if key != self.last_event:
            self.last_event = key
            self.live.emit_task(
                "waiting",
                job,
                {**reason.as_dict(), "why": reason.as_dict(), "waited_s": round(waited, 3)},
            )


def reporting(live: Live, job: Job) -> Any:
    """Set a :class:`WaitReporter` for ``job`` as the current context's listener; returns the token
    for :func:`done`."""
    return wait_reasons.LISTENER.set(WaitReporter(live, job))


def done(token: Any) -> None:
    """The dispatch that :func:`reporting` was set for stopped waiting."""
    wait_reasons.LISTENER.reset(token)
