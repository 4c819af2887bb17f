"""Where a hand-off ends (:class:`Results`); a local cluster's results fetched in batches
(:class:`Landings`), since Dask runs every done-callback on one thread and a fetch is a round trip."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

from prefect.states import Cancelled, Crashed, Failed

from gpu_tasks.errors import GpuOutOfMemoryError
from gpu_tasks.preemption import PreemptedRun, preemption_reason
from gpu_tasks.prefect_api.states import report_state
from gpu_tasks.runner.job import Job, Left, OutOfMemory, Requeue, WorkerDied
from gpu_tasks.runner.session import Live

logger = logging.getLogger("gpu_tasks.runner")

Landing = tuple[Any, Any]  # (its key for the consumer, the Dask future)


class Landings:
    """Fetches finished Dask futures' results in batches on a thread of its own, calling
    ``deliver(item, value, error)`` there once per item (``value=None`` with the fetch's error)."""

    def __init__(self, deliver: Callable[[Any, Any, BaseException | None], None], name: str) -> None:
        self._deliver = deliver
        self._name = name
        self._queued: list[Landing] = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def put(self, item: Any, dfut: Any) -> bool:
        """Queue ``dfut``'s result for ``item``; ``False`` once closed (the caller handles it)."""
        with self._cv:
            if self._closed:
                return False
            self._queued.append((item, dfut))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify()
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Deliver what is queued, then stop the thread (waits up to ``timeout``)."""
        with self._cv:
            self._closed = True
            self._cv.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queued and not self._closed:
                    self._cv.wait()
                if not self._queued:
                    return
                batch, self._queued = self._queued, []
            self._fetch(batch)

    def _fetch(self, batch: list[Landing]) -> None:
        by_client: dict[int, list[Landing]] = {}
        for landing in batch:
            by_client.setdefault(id(landing[1].client), []).append(landing)
        for group in by_client.values():
            try:
                values = group[0][1].client.gather([dfut for _, dfut in group]) if len(group) > 1 else None
            except BaseException:  # one of them failed or was lost: each is fetched on its own
                values = None
            if values is None:
                for item, dfut in group:
                    self.one(item, dfut)
                continue
            for (item, _), value in zip(group, values, strict=True):
                self._hand_on(item, value, None)

    def one(self, item: Any, dfut: Any) -> None:
        """Fetch ``dfut``'s result for ``item`` now, on this thread."""
        try:
            value = dfut.result()
        except BaseException as exc:
            self._hand_on(item, None, exc)
            return
        self._hand_on(item, value, None)

    def _hand_on(self, item: Any, value: Any, error: BaseException | None) -> None:
        try:
            self._deliver(item, value, error)
        except BaseException:  # the consumer resolves its own futures; never stop this thread
            logger.warning("gpu-tasks: could not hand on a task's result", exc_info=True)


def _is_worker_death(exc: BaseException) -> bool:
    """Whether a Dask future failed because its worker died, or was lost with it (cancelled, or its
    client's loop closed with the cluster): gpu-tasks cancels none it still asks about."""
    import asyncio

    from distributed.client import FutureCancelledError
    from distributed.scheduler import KilledWorker

    lost = KilledWorker | FutureCancelledError | concurrent.futures.CancelledError | asyncio.CancelledError
    if isinstance(exc, lost):
        return True
    return isinstance(exc, RuntimeError) and str(exc) == "IOLoop is closed"


class Results:
    """Where a hand-off ends: its final state, or an event for its profile's controller when it must
    run again (worker died, ``on_oom``, preempted). Every task's future is resolved here."""

    def __init__(self, live: Live, landings: Landings, release_quota: Callable[[Job], None]) -> None:
        self.live = live
        self._landings = landings
        self._release_quota = release_quota

    def finish(self, job: Job, result: Any = None, exc: BaseException | None = None) -> None:
        """Resolve ``job``'s future with its final state (or ``exc``); its tag and quota slots go back."""
        if job.hold is not None:
            self.live.gate.release(job.hold)
        self._release_quota(job)
        job.st.post(Left(job))  # its controller counts it; the future does not wait for that
        with contextlib.suppress(concurrent.futures.InvalidStateError):  # resolved already
            if exc is not None:
                job.cf.set_exception(exc)
            else:
                job.cf.set_result(result)

    def fail(self, job: Job, exc: BaseException) -> None:
        """End ``job`` as if its task had raised ``exc`` (a Failed task run; ``Cancelled`` or ``Crashed``
        once its flow run was cancelled or interrupted, :meth:`Live.close`); a Ctrl-C, or a failure to
        record the state, resolves the future with that error: it is never left unresolved."""
        if not isinstance(exc, Exception):
            self.finish(job, exc=exc)
            return
        try:
            message = f"{type(exc).__name__}: {exc}"
            end, why = self.live.tasks_end if self.live.stop.is_set() else ("Failed", "")
            if end != "Failed":  # the flow run was cancelled or interrupted before this task (re)ran
                again = " again" if job.task_run is not None else ""  # preempted, or a crash's retry
                message = f"the {why} before this task ran{again} ({message})"
            kind = {"Cancelled": Cancelled, "Crashed": Crashed}.get(end, Failed)
            failed: Any = kind(message=message, data=exc)
            ran = job.task_run is not None  # else it never started: run count 0, as Prefect's own
            state, _ = job.ctx.copy().run(
                report_state, failed, job.task_run_id, job.task, self.live.flow_run_id, job.tags, 0.0, ran
            )
        except BaseException as err:
            self.finish(job, exc=err)
            return
        self.finish(job, result=state)

    def on_done(self, job: Job, attempt: int, dfut: Any) -> None:
        """On Dask's callback thread: a local cluster's finished result is fetched in a batch, others here."""
        if attempt != job.attempt:
            return  # it was preempted: re-queued, its worker's end is not its end
        land = partial(self._landed, job, attempt)
        shared = job.st.cluster.shared
        if shared or getattr(dfut, "status", None) != "finished" or not self._landings.put(land, dfut):
            self._landings.one(land, dfut)

    def _landed(self, job: Job, attempt: int, value: Any, error: BaseException | None) -> None:
        """``job``'s hand-off ended with ``value`` (its worker's result) or ``error``."""
        if attempt != job.attempt:
            return  # it was preempted: re-queued, its worker's end is not its end
        self._release_quota(job)
        try:
            if error is not None:
                raise error
            state, start, end, wkey = value
        except BaseException as exc:
            if _is_worker_death(exc) and not self.live.stop.is_set() and job.st.post(WorkerDied(job, exc)):
                return
            self.finish(job, exc=exc)
            return
        job.st.cluster.record(wkey, start, end)
        if isinstance(state, PreemptedRun):  # interrupted on a shared scheduler for a waiter
            by = job.st.cluster.preempted_by(job.key)
            reason = preemption_reason(by, f"queued {float(by.get('waited_s') or 0):.1f}s")
            fields = {
                k: by.get(k)
                for k in ("profile", "flow_run_name", "flow_run_id", "pid", "priority", "reclaimed_by")
            }
            if not job.st.post(Requeue(job, reason, fields)):
                self.finish(job, exc=RuntimeError(f"the task runner is shutting down; {reason}"))
            return
        prof = job.profile
        if (
            prof.on_oom
            and job.escalated_from is None
            and state.is_failed()
            and GpuOutOfMemoryError.__name__ in (state.message or "")
            and not self.live.stop.is_set()
            and job.st.post(OutOfMemory(job, state.message or "out of memory"))
        ):
            return
        self.finish(job, result=state)
