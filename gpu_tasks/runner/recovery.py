"""A task whose hand-off went wrong, run again: on ``on_oom`` after out of memory, after preemption, or
after its worker died. Called by its controller on a thread of their own (they wait on the Prefect API).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from prefect.states import Scheduled

from gpu_tasks.allocation import ESCALATED_TAG, Allocation
from gpu_tasks.prefect_api.states import (
    PREEMPTED,
    await_retry,
    crash_task_run,
    read_task_run,
    report_state,
    retry_after_crash,
)
from gpu_tasks.profiles import profile
from gpu_tasks.reporting.ledger import LedgerRow
from gpu_tasks.reporting.logs import flow_logger
from gpu_tasks.runner.job import Arrived, Job, Left, LostWorker
from gpu_tasks.runner.results import Results

logger = logging.getLogger("gpu_tasks.runner")


_COULD_NOT = {
    "oom": "re-run an out-of-memory task on its on_oom profile",
    "requeue": "re-queue a preempted task",
    "crash": "handle the task of a dead worker",
}


def recover(kind: str, step: Callable[..., None], results: Results, job: Job, *args: Any) -> None:
    """``step(results, job, *args)`` (:func:`escalate`, :func:`requeue`, :func:`worker_died`); whatever
    fails, the job's future resolves."""
    try:
        step(results, job, *args)
    except BaseException as err:  # never leave the future unresolved
        logger.warning("gpu-tasks: could not %s", _COULD_NOT[kind], exc_info=True)
        results.finish(job, exc=err)


def escalate(results: Results, job: Job, task_run: Any, why: str) -> None:
    """Re-run ``job`` once on its profile's ``on_oom`` profile, continuing the same task run."""
    live, source = results.live, job.profile
    assert source.on_oom is not None  # the runner checked it names a known profile
    target = live.profiles[source.on_oom]
    if task_run is None:
        task_run = read_task_run(job.task_run_id, job.task, live.flow_run_id, set(job.task.tags), wait=2.0)
    old, new = job.st, live.state(target)
    old.post(Left(job))
    new.post(Arrived())
    job.st = new
    job.extra_tags = [profile(target.name), ESCALATED_TAG]
    job.escalated_from = source.name
    task_run.tags = sorted(set(task_run.tags or ()) | {profile(target.name), ESCALATED_TAG})
    await_retry(task_run, live.flow_run_id)
    job.task_run = task_run
    flow_logger().warning(
        "Task run %r ran out of memory on profile %r (%s); re-running it once on profile %r (on_oom)",
        task_run.name,
        source.name,
        why,
        target.name,
    )
    live.emit_task("escalated", job, {"from_profile": source.name, "to_profile": target.name, "reason": why})
    job.dispatch()


def requeue(results: Results, job: Job, reason: str, by: dict[str, Any]) -> None:
    """Report ``job`` ``Preempted`` and dispatch it again (devices permitting)."""
    live = results.live
    preempted: Any = Scheduled(name=PREEMPTED, message=f"Preempted: {reason}")
    state, task_run = report_state(preempted, job.task_run_id, job.task, live.flow_run_id, job.tags, wait=2.0)
    job.preemptions += 1
    job.task_run = task_run
    job.say(
        logging.WARNING,
        "Task run %r was %s; it runs again when devices free (no retry used)",
        getattr(task_run, "name", job.task_run_id),
        reason,
    )
    live.emit_task("preempted", job, {"reason": reason, "preemptions": job.preemptions, "by": by})
    if live.stop.is_set():
        results.finish(job, result=state)
        return
    job.dispatch()


def worker_died(results: Results, job: Job, lost: LostWorker, how: str, row: LedgerRow | None) -> None:
    """The worker running ``job`` died (``row``: its ledger row when this report retired it): the crash
    report and ledger, then ``job`` runs again if it had not begun there (no retry used) or its
    retries allow."""
    live, st, prof = results.live, job.st, job.profile
    name, devices, ended, address = lost
    where = f"device(s) {','.join(devices)}" if devices else ("unknown devices" if prof.is_gpu else "CPU")
    if st.cluster.emulated:
        where += " (emulated)"
    pid = f", pid {ended.pid}" if ended and ended.pid else ""
    who = f" ({name or address}{pid})" if name or address else ""
    began = st.cluster.shared or live.started.began(job.key)
    cancelled = live.cancelled()  # a Prefect worker's cancel signals the flow run's whole process group
    if cancelled:
        message = (
            f"the flow run stopped (cancelled) while this task ran on profile {prof.name!r} on {where}; "
            f"its worker ended with the cancellation{who}"
            if began
            else f"the flow run stopped (cancelled) before this task started on profile {prof.name!r}"
        )
    elif st.cluster.shared and not (name or address):  # no worker named: its client lost the scheduler
        message = (
            f"the connection of profile {prof.name!r} to its Dask scheduler at "
            f"{getattr(st.cluster, 'scheduler_address', None)} was lost ({how}) while this "
            "task waited or ran there"
        )
    else:
        message = (
            f"{'Out of memory: ' if ended and ended.memory_kill else ''}the worker process of profile "
            f"{prof.name!r} on {where}{who} {how} while running this task"
        )
        if ended and ended.memory_kill and not prof.on_oom:  # the limit it had, and the fix
            from dask.utils import format_bytes

            limit = (
                f"its memory is {format_bytes(prof.memory)}" if prof.memory else "it has Dask's memory limit"
            )
            message += (
                f"; {limit} per worker: raise the profile's memory, lower the task's use, or give the "
                "profile on_oom='<a profile with more memory>'"
            )
    if row is not None:
        live.gave_back(
            st,
            row,
            "crashed",
            {
                "reason": message,
                "worker": name,
                "pid": ended.pid if ended else None,
                "exitcode": ended.exitcode if ended else None,
                "out_of_memory": bool(ended and ended.memory_kill),
            },
        )
    if not began and not cancelled:
        job.say(
            logging.INFO,
            "Task %r had been queued on the worker of profile %r on %s (%s), which %s before it began: "
            "it runs again on another worker (no retry used)",
            job.task.name,
            prof.name,
            where,
            name or address,
            how,
        )
        _again(results, job, 0.0, None)
        return
    # the devices it held: its worker, dead within a second, may have sent no state with them
    tags = (
        job.tags
        | Allocation(profile=prof.name, devices=tuple(devices), emulated=st.cluster.emulated).placement_tags()
    )
    state, task_run = crash_task_run(
        job.task_run_id, job.task, live.flow_run_id, message, tags=tags, cancelled=cancelled
    )
    if cancelled:  # never retried: the run is ending
        flow_logger().warning(
            "Task run %s cancelled: %s", getattr(task_run, "name", None) or job.task.name, message
        )
        results.finish(job, result=state)
        return
    if ended and ended.memory_kill and prof.on_oom and job.escalated_from is None and task_run is not None:
        escalate(results, job, task_run, message)
        return
    crashes = job.crashes + 1
    delay = retry_after_crash(
        job.task, task_run, live.flow_run_id, job.free_runs, crashes, message, flow_logger()
    )
    if delay is None:
        results.finish(job, result=state)
        return
    job.crashes = crashes
    job.task_run = task_run
    _again(results, job, delay, state)


def _again(results: Results, job: Job, delay: float, state: Any) -> None:
    """Dispatch ``job`` again after ``delay`` s, unless the runner stops meanwhile (then its future
    resolves to ``state``, its crash, or fails when it never ran)."""
    if results.live.stop.wait(delay):
        stopped = None if state else RuntimeError("the task runner is shutting down")  # it never ran
        results.finish(job, result=state, exc=stopped)
        return
    job.dispatch()
