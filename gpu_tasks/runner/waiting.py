"""Why a dispatching task waits: its task run's log, at a bounded rate, and a ``gpu-tasks.task.waiting``
event when the reason changes."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from gpu_tasks.devices import wait_reasons
from gpu_tasks.devices.wait_reasons import Throttle, WaitReason
from gpu_tasks.prefect_api.states import pending_task_run
from gpu_tasks.reporting.logs import task_run_log

if TYPE_CHECKING:
    from gpu_tasks.runner.job import Job
    from gpu_tasks.runner.session import Live

logger = logging.getLogger("gpu_tasks.runner")

LOG_EVERY_S = 30.0  # the same reason is logged again at most this often
GAP_S = 2.0  # a changed reason is logged at once, but not within this of the previous line


class _Told:
    """What one waiting task run was told: its log, when it began to wait, the last event's reason."""

    def __init__(self, started: float) -> None:
        self.throttle = Throttle(LOG_EVERY_S, GAP_S)
        self.started = started
        self.last_event: tuple[str, str] | None = None
        self.log: Any = None


class WaitReporter:
    """Says why ``job`` waits (the listener of :data:`gpu_tasks.devices.wait_reasons.LISTENER`), and so
    do the tasks of its profile queued behind it (``queued()``: their jobs), which wait for the same."""

    job: Job | None

    def __init__(self, live: Live, job: Job, queued: Callable[[], list[Job]]) -> None:
        self.live, self.job, self.queued = live, job, queued  # job: None once the wait is over
        self.started = time.monotonic()
        self.told: dict[Any, _Told] = {}

    def __call__(self, reason: WaitReason) -> None:
        first = self.job
        if first is None:
            return
        now = time.monotonic()
        for job in (first, *self.queued()):
            told = self.told.get(job.task_run_id)
            if told is None:
                told = self.told[job.task_run_id] = _Told(self.started if job is first else job.submitted_at)
            if told.throttle.due(reason, now):
                self._tell(job, told, reason, now - told.started)

    def _tell(self, job: Job, told: _Told, reason: WaitReason, waited: float) -> None:
        if told.log is None:
            told.log = task_run_log(job.task_run_id, self.live.flow_run_id, job.task.name, self.live.run.name)
        key = told.throttle.last_kind_text
        changed = key != told.last_event
        if changed and job.task_run is None:  # not started yet: the server has no such task run
            # its Pending record says why it waits now: set once, it named a holder that had let go
            # since (a new-user pass)
            with contextlib.suppress(Exception):  # a record is a courtesy: the wait goes on
                self.live.in_run_context(
                    pending_task_run,
                    job.task_run_id,
                    job.task,
                    self.live.flow_run_id,
                    job.tags,
                    f"Waiting for devices: {reason.text}",
                )
        try:
            told.log.info("Waiting for devices (%.0fs so far): %s", waited, reason.text)
        except Exception:  # a log line is a courtesy: the wait goes on
            logger.debug("could not log why task %s waits", job.task_run_id, exc_info=True)
        if changed:
            told.last_event = key
            self.live.emit_task(
                "waiting",
                job,
                {**reason.as_dict(), "why": reason.as_dict(), "waited_s": round(waited, 3)},
            )


@contextlib.contextmanager
def reported(live: Live, job: Job) -> Iterator[None]:
    """Within it, why ``job`` and the tasks queued behind it wait is said by a :class:`WaitReporter`
    (the context's listener)."""
    reporter = WaitReporter(live, job, job.st.queued_jobs)
    token = wait_reasons.LISTENER.set(reporter)
    try:
        yield
    finally:
        wait_reasons.LISTENER.reset(token)
        # Prefect's event loop copies the context of calls made meanwhile (a timer may keep it for
        # as long as a lease lasts): the job, and with it the task run's parameters, stays out of it
        reporter.job = None
        reporter.told.clear()
