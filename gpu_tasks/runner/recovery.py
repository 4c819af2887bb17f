"""A task whose hand-off went wrong, run again: out of memory, preempted, its worker dead.

A task that ran out of memory is re-run once on its profile's ``on_oom`` profile; a task
stopped for a higher-priority waiter is reported ``Preempted`` and queued again without
using a retry; a dead worker is reported ``Crashed`` and its task re-run on a new worker
while it has retries. Each re-run is a dispatch (:meth:`gpu_tasks.runner.dispatch.Dispatcher.dispatch`),
which :class:`Recovery` is given as a callback.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from gpu_tasks.policy import crash_retry
from gpu_tasks.preemption import describe_waiter
from gpu_tasks.prefect_api.states import await_retry, crash_task_run, preempt_task_run, read_task_run
from gpu_tasks.profiles import profile
from gpu_tasks.reporting.logs import flow_logger
from gpu_tasks.runner.job import NO_WORKER, Job, LostWorker, ProfileState
from gpu_tasks.runner.results import Finish
from gpu_tasks.runner.session import Live

logger = logging.getLogger("gpu_tasks.runner")

ESCALATED_TAG = "gpu-tasks:on-oom"


class Recovery:
    """Runs again the tasks whose hand-off went wrong, or ends them.

    Args:
        live: the entered runner's session.
        finish: resolves a task's future (:class:`gpu_tasks.runner.results.Finish`).
        redispatch: dispatches a task again, as the same task run
            (:meth:`gpu_tasks.runner.dispatch.Dispatcher.dispatch`).
    """

    def __init__(self, live: Live, finish: Finish, redispatch: Callable[[Job], None]) -> None:
        self.live = live
        self._finish = finish
        self._redispatch = redispatch
        # profile -> (worker name, devices, how it ended) of its last dead worker: the tasks that were
        # lost with it (their futures cancelled when the first report closed its cluster) name it too
        self._last_death: dict[str, LostWorker] = {}

    # ------------------------------------------------------------ out of memory
    def escalate(self, job: Job, task_run: Any, why: str) -> None:
        """Re-run ``job`` once on its profile's ``on_oom`` profile; whatever fails, its future resolves."""
        try:
            self._escalate(job, task_run, why)
        except BaseException as err:  # never leave the future unresolved
            logger.warning(
                "gpu-tasks: could not re-run an out-of-memory task on its on_oom profile", exc_info=True
            )
            self._finish(job, exc=err)

    def _escalate(self, job: Job, task_run: Any, why: str) -> None:
        """Re-run ``job`` once on its profile's ``on_oom`` profile, continuing the same task run."""
        live = self.live
        source = job.profile
        assert source.on_oom is not None  # the runner checked it names a known profile
        target = live.profiles[source.on_oom]
        if task_run is None:
            task_run = read_task_run(
                job.task_run_id, job.task, live.flow_run_id, set(job.task.tags), wait=2.0
            )
        old, new = job.st, live.state(target)
        old.leave()
        new.arrive()
        job.st = new
        job.extra_tags = [profile(target.name), ESCALATED_TAG]
        job.escalated_from = source.name
        task_run.tags = sorted(set(task_run.tags or ()) | {profile(target.name), ESCALATED_TAG})
        await_retry(task_run, live.flow_run_id)
        job.continues(task_run)
        flow_logger().warning(
            "Task run %r ran out of memory on profile %r (%s); re-running it once on profile %r (on_oom)",
            task_run.name,
            source.name,
            why,
            target.name,
        )
        live.emit_task(
            "escalated", job, {"from_profile": source.name, "to_profile": target.name, "reason": why}
        )
        self._redispatch(job)

    # ------------------------------------------------------------ preemption
    def preempt(self, st: ProfileState, addresses: list[str], waiter: dict[str, Any]) -> None:
        """Stop ``st``'s workers on ``addresses`` for ``waiter``; re-queue the tasks they ran.

        Runs on a thread of its own (gpu_tasks.runner.session checks the queue). The tasks end
        ``Preempted`` and are dispatched again, as the same task runs with their retries
        intact; they wait for devices like any task of the profile (without
        ``GPU_TASKS_LEASE_TIMEOUT``).
        """
        live = self.live
        waited = time.time() - float(waiter["arrived"])
        reason = f"preempted by {describe_waiter(waiter)}, waiting {waited:.1f}s"
        by = {
            k: waiter.get(k)
            for k in ("profile", "flow_run_name", "flow_run_id", "pid", "priority", "arrived")
        }
        with st.lock:
            cluster = st.cluster
            names = cluster.workers_on(addresses)
            if not cluster.running or not names:
                return
            jobs = [j for j in live.inflight.values() if j.st is st]
            keys = None if cluster.whole_stop(names) else cluster.running_keys(names)
            if keys is None:  # the whole cluster stops (or Dask cannot tell which ran where)
                names = [s.name for s in cluster.specs]
            else:
                jobs = [j for j in jobs if j.key in keys]
            for j in jobs:
                j.disown()  # what its worker reports now is not its outcome
                live.landed(j)
            logger.warning(
                "profile %r: stopping worker(s) %s on device(s) %s, %d task(s) re-queued: %s",
                cluster.profile.name,
                ", ".join(names),
                ",".join(addresses),
                len(jobs),
                reason,
            )
            try:
                rows = cluster.stop_workers(names, reason)
            except Exception:  # its tasks are re-queued whatever happens: stop it all instead
                logger.warning(
                    "profile %r: could not stop workers %s", cluster.profile.name, names, exc_info=True
                )
                whole = cluster.close(reason, hurry=True)
                rows = [whole] if whole is not None else []
            for row in rows:
                live.gave_back(st, row, "preempted", {"by": dict(by, waited_s=round(waited, 3))})
        for j in jobs:
            j.off_thread(self.requeue, j, reason, by, name=f"gpu-tasks-requeue-{j.profile.name}")

    def requeue(self, job: Job, reason: str, by: dict[str, Any]) -> None:
        """Report ``job`` ``Preempted`` and dispatch it again (devices permitting)."""
        try:
            state, task_run = preempt_task_run(
                job.task_run_id, job.task, self.live.flow_run_id, f"Preempted: {reason}", job.tags
            )
            job.preemptions += 1
            job.continues(task_run)
            job.say(
                logging.WARNING,
                "Task run %r was %s; it runs again when devices free (no retry used)",
                getattr(task_run, "name", job.task_run_id),
                reason,
            )
            self.live.emit_task(
                "preempted", job, {"reason": reason, "preemptions": job.preemptions, "by": by}
            )
            if self.live.stop.is_set():
                self._finish(job, result=state)
                return
        except BaseException as err:  # never leave the future unresolved
            logger.warning("gpu-tasks: could not re-queue a preempted task", exc_info=True)
            self._finish(job, exc=err)
            return
        self._redispatch(job)

    # ------------------------------------------------------------ dead workers
    def worker_died(self, job: Job, exc: BaseException) -> None:
        """The worker running ``job`` died: report the crash, give its devices back, retry if allowed."""
        try:
            retry = self._report_worker_death(job, exc)
        except BaseException as err:  # never leave the future unresolved
            logger.warning("gpu-tasks: error while handling a dead worker", exc_info=True)
            self._finish(job, exc=err)
            return
        if retry is None:
            return
        delay, state = retry
        if self.live.stop.wait(delay):
            self._finish(job, result=state)
            return
        self._redispatch(job)

    def _report_worker_death(self, job: Job, exc: BaseException) -> tuple[float, Any] | None:
        """Crash report and ledger for a dead worker; ``(delay, crashed state)`` when the task is retried."""
        from gpu_tasks.worker.exits import worker_exit  # imports distributed: only once a worker died

        live, st, prof = self.live, job.st, job.profile
        ws = getattr(exc, "last_worker", None)
        if ws is None:  # lost with its cluster (closed when its last worker died), no worker named
            name, devices, ended, address = (
                self._last_death.get(prof.name) or live.lost.get(prof.name) or NO_WORKER
            )
            how = ended.describe() if ended else f"was lost ({type(exc).__name__}: {exc})"
            row = None
            with st.lock:
                live.landed(job)  # nothing to retire: the first report did, a retry may run already
        else:
            name = str(getattr(ws, "name", "") or "")
            address = getattr(ws, "address", None)
            ended = worker_exit(address) if address else None
            how = ended.describe() if ended else "died"
            with st.lock:
                known = self._last_death.get(prof.name)
                lost = live.lost.get(prof.name)
                # retired already: its replacement may have its name (the name comes from its devices)
                row = None
                if known is not None and known.address == address:  # another of its tasks
                    devices = known.devices
                elif lost is not None and lost.address == address:  # found lost by the idle monitor
                    devices = lost.devices
                    self._last_death[prof.name] = lost
                else:
                    devices = tuple(st.cluster.worker_devices(name) or st.cluster.devices)
                    self._last_death[prof.name] = LostWorker(name, devices, ended, address)
                    row = st.cluster.retire(name, f"worker crashed: {how}")
                live.landed(job)
                live.refill(st)  # a new worker for the tasks still queued on the workers left
        where = f"device(s) {','.join(devices)}" if devices else ("unknown devices" if prof.is_gpu else "CPU")
        if st.cluster.emulated:
            where += " (emulated)"
        pid = f", pid {ended.pid}" if ended and ended.pid else ""
        message = (
            f"{'Out of memory: ' if ended and ended.memory_kill else ''}the worker process of profile "
            f"{prof.name!r} on {where} ({name or address}{pid}) {how} while running this task"
        )
        if row is not None:
            live.ledger.append(row)
            live.emit(
                "crashed",
                st.cluster,
                {
                    "reason": message,
                    "devices": list(row.devices),
                    "worker": name,
                    "pid": ended.pid if ended else None,
                    "exitcode": ended.exitcode if ended else None,
                    "out_of_memory": bool(ended and ended.memory_kill),
                    "held_s": round(row.held_seconds, 3),
                    "busy_s": round(row.busy_seconds, 3),
                },
                row.devices,
            )
        state, task_run = crash_task_run(job.task_run_id, job.task, live.flow_run_id, message, tags=job.tags)
        if (
            ended
            and ended.memory_kill
            and prof.on_oom
            and job.escalated_from is None
            and task_run is not None
        ):
            self._escalate(job, task_run, message)
            return None
        attempts = max(job.crashes + 1, int(getattr(task_run, "run_count", 0) or 0))
        retries = int(job.task.retries or 0)
        log = flow_logger()
        delay = (
            None
            if task_run is None
            else crash_retry(retries, attempts, job.task.retry_delay_seconds, job.crashes)
        )
        if delay is None:
            log.error(
                "Task run %s crashed: %s%s",
                job.task_run_id,
                message,
                f"; no retries left ({retries} allowed)" if retries else "",
            )
            self._finish(job, result=state)
            return None
        await_retry(task_run, live.flow_run_id, delay)
        job.crashes += 1
        job.continues(task_run)
        log.warning(
            "Task run %r crashed: %s; retrying it on a new worker (retry %d of %d) in %gs",
            task_run.name,
            message,
            attempts,
            retries,
            delay,
        )
        return delay, state
