"""A GPU task before any device: its cached result, then its Prefect tag concurrency slots
(:class:`Admission`); an ``address`` profile's quota slots (:class:`TaskQuota`)."""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import logging
import threading
import uuid
from collections.abc import Callable
from typing import Any

from gpu_tasks.allocation import Allocation
from gpu_tasks.compat.prefect import (
    can_skip_engine_tag_slots,
    known_without_limits,
    remember_without_limits,
    tag_slots_held_by_flow,
)
from gpu_tasks.devices import lending
from gpu_tasks.errors import GpuTasksError
from gpu_tasks.prefect_api import quotas
from gpu_tasks.prefect_api.futures import futures_to_states, upstream_failed
from gpu_tasks.prefect_api.states import await_retry, read_task_run
from gpu_tasks.prefect_api.tag_answers import read_without_limits
from gpu_tasks.prefect_api.tag_slots import Hold, slot_names
from gpu_tasks.runner.job import Counted, Job
from gpu_tasks.runner.results import Results
from gpu_tasks.runner.session import Live
from gpu_tasks.worker.engine import run_engine

logger = logging.getLogger("gpu_tasks.runner")

# a wait for a tag slot this long is logged and sent as an event (shorter ones: the API round trip)
SLOT_WAIT_REPORTED_S = 0.5


def may_be_cached(task: Any) -> bool:
    """Whether a cached result of ``task`` may exist, judged from its options alone (cheap)."""
    from prefect.cache_policies import NO_CACHE, CachePolicy
    from prefect.settings import get_current_settings

    policy = getattr(task, "cache_policy", None)
    if not isinstance(policy, CachePolicy) or policy == NO_CACHE:
        return False
    if getattr(task, "result_storage_key", None) is not None:
        return False
    settings = get_current_settings()
    refresh = task.refresh_cache if task.refresh_cache is not None else settings.tasks.refresh_cache
    if refresh:
        return False
    persist = task.persist_result
    if persist is None:
        persist = settings.tasks.default_persist_result
    if persist is None:
        persist = settings.results.persist_by_default
    return bool(persist)


def cached_key(task: Any, task_run_id: uuid.UUID, parameters: dict[str, Any]) -> str | None:
    """The cache key of ``task`` on ``parameters`` if its result store has a record, else None (on any
    error too: the worker's engine computes the key again and logs it)."""
    from prefect.client.schemas.objects import TaskRun
    from prefect.context import FlowRunContext, TaskRunContext
    from prefect.results import get_result_store
    from prefect.utilities.engine import resolve_inputs_sync

    flow_ctx = FlowRunContext.get()
    if flow_ctx is None or flow_ctx.flow_run is None:
        return None
    try:
        # as the engine resolves them (its _resolve_parameters is Prefect's documented resolve_inputs_sync)
        inputs = resolve_inputs_sync(parameters)
        store: Any = get_result_store().update_for_task(task)
        if inspect.isawaitable(store):  # an async flow's context: this executor thread runs no loop
            store = asyncio.run(_awaited(store))
        task_run = TaskRun(
            id=task_run_id,
            name=task.name,
            flow_run_id=flow_ctx.flow_run.id,
            task_key=task.task_key,
            dynamic_key="gpu-tasks-cache-check",
            tags=sorted(task.tags),
        )
        with TaskRunContext(
            task=task,
            task_run=task_run,
            parameters=inputs,
            result_store=store,
            client=flow_ctx.client,
            persist_result=True,
        ) as task_ctx:
            key = task.cache_policy.compute_key(
                task_ctx=task_ctx, inputs=inputs, flow_parameters=flow_ctx.parameters or {}
            )
        if key and store.exists(key=key):
            return str(key)
    except Exception:
        return None
    return None


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


class CacheOnly:
    """``task`` for a run that must only read its cached result (its function raises if called);
    ``called``: the record was gone and the run ended ``Crashed``, which uses no retry."""

    class Missed(BaseException):
        """The engine would have run the task's function in the flow process."""

    def __init__(self, task: Any) -> None:
        self.called = False
        fn = task.fn

        @functools.wraps(fn)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            self.called = True
            raise CacheOnly.Missed(
                f"task {task.name!r}: its cached result was gone when the run started; it runs again "
                "on its profile's workers"
            )

        @functools.wraps(fn)
        async def aguarded(*args: Any, **kwargs: Any) -> Any:
            return guarded(*args, **kwargs)

        self.task = copy.copy(task)
        self.task.fn = aguarded if getattr(task, "isasync", False) else guarded


class Admission:
    """Before a device: a GPU task's cached result, then its Prefect tag concurrency slots."""

    def __init__(self, live: Live, results: Results) -> None:
        self.live = live
        self._results = results
        self._lock = threading.Lock()
        self._read: set[frozenset[str]] = set()  # tag sets whose limits this runner read once
        self._reading: dict[frozenset[str], list[tuple[Job, Callable[[], Any]]]] = {}  # and their waiters

    def admit(self, job: Job) -> None:
        """Dispatch ``job`` once nothing but devices stands in its way (CPU tasks: at once); its
        upstream futures are done. One that failed ends it NotReady in the flow process, as Prefect's
        engine does, with no device leased (a cluster was started for that)."""
        then = job.dispatch
        if not job.profile.is_gpu:
            then()
            return
        if upstream_failed(job.parameters, list(job.wait_for or ())):
            self._off_thread(job, then, self._run_here, job, None, then)
            return
        if may_be_cached(job.task):  # resolving inputs and reading storage: off the caller's thread
            self._off_thread(job, then, self._look_up_cache, job, then)
            return
        self._take_slots(job, then)

    def _off_thread(self, job: Job, then: Callable[[], Any], step: Callable[..., Any], *args: Any) -> None:
        """``step(*args)`` on an executor thread; once the runner's close shut it down (a flow that
        returned without waiting: 'cannot schedule new futures'), ``then()``, whose controller ends
        the job as it ends every task still unplaced then."""
        try:
            self.live.executor.submit(self._settled, job, step, *args)
        except RuntimeError:
            then()

    def _settled(self, job: Job, step: Callable[..., Any], *args: Any) -> None:
        """``step(*args)`` on an executor thread; an error fails the task run, never loses it."""
        try:
            step(*args)
        except BaseException as exc:
            self._results.fail(job, exc)  # its tag slots go back with it

    def _look_up_cache(self, job: Job, then: Callable[[], Any]) -> None:
        key = job.ctx.run(cached_key, job.task, job.task_run_id, futures_to_states(job.parameters))
        if key is None:
            self._take_slots(job, then)
            return
        run_cached = functools.partial(
            self.live.executor.submit, self._settled, job, self._run_here, job, key, then
        )
        self._take_slots(job, run_cached)

    def _take_slots(self, job: Job, then: Callable[[], Any]) -> None:
        """``then()`` once ``job`` holds its tag slots (at once when its tags have no limits)."""
        if not can_skip_engine_tag_slots():
            then()  # this Prefect takes them where gpu-tasks cannot skip them: on the worker
            return
        names = slot_names(job.tags)
        job.slot_names = tuple(names)
        if known_without_limits(names):
            then()  # the common case: no limit on these tags, nothing to take or wait for
            return
        key = frozenset(names)
        with self._lock:
            waiting = self._reading.get(key)
            if waiting is not None:  # its limits are being read: that answer decides
                waiting.append((job, then))
                return
            first = key not in self._read
            if first:
                self._read.add(key)
                self._reading[key] = [(job, then)]
        if not first:
            self._through_gate(job, names, then)
            return
        try:
            self.live.executor.submit(self._read_limits, job.ctx, key, names)
        except BaseException:
            with self._lock:
                self._reading.pop(key, None)
            raise

    def _read_limits(self, ctx: Any, key: frozenset[str], names: list[str]) -> None:
        """A tag set's first look, by reads (a busy server answers a read at once, a slot request after
        its backlog); then its waiters go on, or to the gate when a limit exists."""
        try:
            free = ctx.run(read_without_limits, names)
        except Exception:  # the slot request decides (it waits out a busy server)
            logger.debug("gpu-tasks: could not read the limits of %s", names, exc_info=True)
            free = False
        if free:
            remember_without_limits(names)
        with self._lock:
            waiting = self._reading.pop(key, [])
        for job, then in waiting:
            if free:
                self._settled(job, then)
            else:
                self._settled(job, self._through_gate, job, names, then)

    def _through_gate(self, job: Job, names: list[str], then: Callable[[], Any]) -> None:
        """``then()`` once the gate holds ``job``'s tag slots."""
        st = job.st
        st.post(Counted(waiting_for_slots=1))

        def ready(hold: Hold) -> None:  # on the gate's callback thread
            st.post(Counted(waiting_for_slots=-1))
            self._slots_taken(job, hold, then)

        def failed(exc: BaseException) -> None:
            st.post(Counted(waiting_for_slots=-1))
            job.off_thread(self._slots_failed, job, exc, name=f"gpu-tasks-slots-{job.profile.name}")

        try:
            job.hold = self.live.gate.take(names, job.task_run_id, job.ctx, ready, failed)
        except BaseException:
            st.post(Counted(waiting_for_slots=-1))
            raise

    def _slots_taken(self, job: Job, hold: Hold, then: Callable[[], Any]) -> None:
        """Report a long wait, then ``then()``: the task goes on or ends, never left waiting."""
        if hold.limits:
            job.slot_waited = hold.waited
            if hold.waited >= SLOT_WAIT_REPORTED_S:
                try:
                    job.say(
                        logging.INFO,
                        "Task %r waited %.1fs for a Prefect concurrency slot (%s) and held no device "
                        "meanwhile",
                        job.task.name,
                        hold.waited,
                        ", ".join(hold.limits),
                    )
                    self.live.emit_task(
                        "slot-waited", job, {"seconds": round(hold.waited, 3), "limits": hold.limits}
                    )
                except Exception:
                    logger.warning("gpu-tasks: could not report a slot wait", exc_info=True)
        try:
            then()
        except BaseException as exc:  # RuntimeError: the runner is stopping, its executors take no work
            job.off_thread(self._results.finish, job, None, exc, name=f"gpu-tasks-slots-{job.profile.name}")

    def _slots_failed(self, job: Job, exc: BaseException) -> None:
        if not isinstance(exc, Exception):
            self._results.finish(job, exc=exc)
            return
        error = GpuTasksError(
            f"task {job.task.name!r} (profile {job.profile.name!r}) could not take its Prefect tag "
            f"concurrency slots ({', '.join(job.slot_names)}): {type(exc).__name__}: {exc}"
        )
        error.__cause__ = exc
        self._results.fail(job, error)

    def _run_here(self, job: Job, key: str | None, then: Callable[[], Any]) -> None:
        """Run ``job`` in the flow process, where Prefect's engine returns its cached result (cache
        ``key``), or with ``key`` ``None`` marks it NotReady for a failed upstream (no device); if the
        engine would call its function after all, ``then()`` runs it on a worker as a retry of the
        same run."""
        prof = job.profile
        only = CacheOnly(job.task)
        kwargs = job.engine_kwargs()

        def run() -> Any:
            with job.tags_context(), tag_slots_held_by_flow(job.task_run_id, job.slot_names):
                return run_engine(Allocation(profile=prof.name, worker="in-process"), only.task, kwargs)[0]

        state = job.ctx.run(run)
        if only.called:
            task_run = job.ctx.run(
                read_task_run, job.task_run_id, job.task, self.live.flow_run_id, job.tags, 2.0
            )
            await_retry(task_run, self.live.flow_run_id)
            job.task_run = task_run
            why = (
                f"its cached result (Prefect cache key {key}) was gone when the run started"
                if key is not None
                else "Prefect's engine found its upstream tasks fit to run it after all"
            )
            job.say(logging.WARNING, "Task %r: %s; running it on profile %r", job.task.name, why, prof.name)
            then()
            return
        if key is None:
            job.say(
                logging.INFO,
                "Task %r: an upstream task did not complete; Prefect's engine ended it %s in the flow "
                "process, no device leased on profile %r",
                job.task.name,
                state.name,
                prof.name,
            )
            self._results.finish(job, result=state)
            return
        job.st.post(Counted(cache_hits=1))
        job.say(
            logging.INFO,
            "Task %r: result found in Prefect's cache (key %s); read in the flow process, no device "
            "leased on profile %r",
            job.task.name,
            key,
            prof.name,
        )
        self.live.emit_task("cache-hit", job, {"cache_key": key, "state": state.name})
        self._results.finish(job, result=state)


class TaskQuota:
    """An ``address`` profile's quota slots while its task is handed off (the one owner of
    ``Job.quota_lease``); a preemptible profile's task may borrow beyond the quota, reclaimable."""

    def __init__(self, live: Live) -> None:
        self.live = live

    def take(self, job: Job) -> None:
        """Hold room in ``job``'s profile's quota (waiting, holding nothing, while it is full)."""
        live, prof = self.live, job.profile
        assert prof.quota is not None
        said: list[str] = []

        def say(line: str) -> None:
            said.append(line)
            job.say(logging.INFO, "%s", line)

        cluster = job.st.cluster
        slots, need, team = live.book.quota_slots(), quotas.task_need(prof.gpus), prof.quota
        what = (prof.name, f"{need} device(s) for task run {job.task_run_id.hex[:8]}")
        borrow = (
            (lambda: lending.borrow_slots(slots, team, need, True, cluster.owed_waiters, what))
            if prof.preemptible
            else None
        )
        lease, waited, borrowed = quotas.wait_for_room(
            slots,
            prof.name,
            team,
            need,
            live.stop,
            None if job.preemptions else live.settings.lease_timeout,
            say,
            borrow,
        )
        job.quota_lease = lease
        cluster.lend(job.task_run_id.hex, borrowed)
        if borrowed:
            job.say(
                logging.INFO,
                "profile %r: quota %r is full; its task borrows %d device(s) beyond it: preemptible work, "
                "reclaimed when a team owed them asks",
                prof.name,
                team,
                need,
            )
        if said or borrowed:
            live.emit_task(
                "quota-waited", job, {"quota": team, "seconds": round(waited, 3), "borrowed": borrowed}
            )

    def release(self, job: Job) -> None:
        """Give back ``job``'s quota slots (off the caller's thread: it is an API call)."""
        lease, job.quota_lease = job.quota_lease, None
        job.st.cluster.lend(job.task_run_id.hex, False)
        if lease is not None:
            job.off_thread(self.live.book.quota_slots().release, lease, name="gpu-tasks-quota-release")
