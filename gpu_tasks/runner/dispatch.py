"""From a submitted task to its final state: provision, hand to the cluster, collect, recover.

``Dispatcher.dispatch`` runs once a task's upstream futures are done: it makes sure
the profile's cluster runs with enough workers (:mod:`gpu_tasks.policy` decides),
submits Prefect's task engine to it and, when the engine returns, resolves the
task's future with the final state. A dead worker is reported ``Crashed`` and the
task re-run on a new worker while it has retries; a task that ran out of memory is
re-run once on its profile's ``on_oom`` profile.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from gpu_tasks.allocation import Allocation
from gpu_tasks.compat.prefect import (
    can_skip_engine_tag_slots,
    known_without_limits,
    tag_slots_held_by_flow,
)
from gpu_tasks.errors import GpuOutOfMemoryError, GpuTasksError
from gpu_tasks.policy import desired_workers, task_resources
from gpu_tasks.preemption import PreemptedRun, describe_waiter
from gpu_tasks.prefect_api import quotas
from gpu_tasks.prefect_api.futures import futures_to_states
from gpu_tasks.prefect_api.states import (
    await_retry,
    crash_task_run,
    fail_task_run,
    preempt_task_run,
    read_task_run,
)
from gpu_tasks.prefect_api.tag_slots import Hold, slot_names
from gpu_tasks.profiles import profile
from gpu_tasks.reporting.events import publish_dashboard
from gpu_tasks.reporting.logs import flow_logger
from gpu_tasks.runner.admission import CacheOnly, cached_key, may_be_cached
from gpu_tasks.runner.results import Landings
from gpu_tasks.runner.session import Job, Live, ProfileState
from gpu_tasks.worker.engine import run_engine, run_on_worker

logger = logging.getLogger("gpu_tasks.runner")

ESCALATED_TAG = "gpu-tasks:on-oom"
# hand-offs a profile's dispatch thread sends to its Dask cluster as one graph, at most
OUTBOX_MAX = 32
_ON_DISPATCH_THREAD = threading.local()  # .st: the profile whose dispatch thread this is, while it dispatches
# a wait for a tag slot this long is logged and sent as an event (shorter ones: the API round trip)
SLOT_WAIT_REPORTED_S = 0.5


def _is_worker_death(exc: BaseException) -> bool:
    """Whether a Dask future failed because the worker process running it died."""
    from distributed.scheduler import KilledWorker

    return isinstance(exc, KilledWorker)


def _retry_delay(task: Any, attempt: int) -> float:
    """Seconds before re-run ``attempt`` (0-based), from the task's ``retry_delay_seconds``."""
    delay = task.retry_delay_seconds
    if isinstance(delay, (list, tuple)):
        delay = delay[min(attempt, len(delay) - 1)] if delay else 0
    return float(delay or 0)


def _say(job: Job, level: int, msg: str, *args: Any) -> None:
    """A line in the flow run's logs (from any thread: the logger is looked up in the job's context)."""
    job.ctx.copy().run(lambda: flow_logger().log(level, msg, *args))


def _off_thread(job: Job, fn: Any, *args: Any, name: str) -> None:
    """``fn(*args)`` in the job's context on a thread of its own (it may wait on the server or devices)."""
    threading.Thread(target=job.ctx.copy().run, args=(fn, *args), name=name, daemon=True).start()


class Dispatcher:
    """Hands one entered runner's tasks to their profiles' clusters and collects their states."""

    def __init__(self, live: Live) -> None:
        self.live = live
        live.preempt = self.preempt
        live.landings = Landings(self._landing, name="gpu-tasks-results")

    # ------------------------------------------------------------ admit
    def admit(self, job: Job, then: Callable[[], Any]) -> None:
        """Call ``then()`` (which dispatches ``job``) once nothing but devices stands in its way.

        A GPU task first looks for its cached result (:mod:`gpu_tasks.runner.admission`; found, it runs
        in the flow process and never reaches ``then``) and takes its Prefect tag concurrency
        slots (:mod:`gpu_tasks.prefect_api.tag_slots`), so that neither ever holds a device. The common
        case (no cache policy, tags without limits) costs a few attribute reads and one cached
        answer. CPU tasks go on at once.
        """
        if not job.profile.is_gpu:
            then()
            return
        if may_be_cached(job.task):  # resolving inputs and reading storage: off the caller's thread
            self.live.executor.submit(self._settled, job, self._look_up_cache, job, then)
            return
        self._take_slots(job, then)

    def _settled(self, job: Job, step: Callable[..., Any], *args: Any) -> None:
        """``step(*args)`` for ``job`` on an executor thread; an error fails the task run, never loses it."""
        try:
            step(*args)
        except Exception as exc:
            if job.hold is not None:
                self.live.gate.release(job.hold)
            state = job.ctx.copy().run(
                fail_task_run, job.task_run_id, job.task, self.live.flow_run_id, exc, job.tags
            )
            self.finish(job, result=state)
        except BaseException as exc:
            self.finish(job, exc=exc)

    def _look_up_cache(self, job: Job, then: Callable[[], Any]) -> None:
        key = job.ctx.run(cached_key, job.task, job.task_run_id, futures_to_states(job.parameters))
        if key is None:
            self._take_slots(job, then)
            return
        run_cached = partial(self.live.executor.submit, self._settled, job, self._run_cached, job, key, then)
        self._take_slots(job, run_cached)

    def _take_slots(self, job: Job, then: Callable[[], Any]) -> None:
        """``then()`` once ``job`` holds its tag slots (at once when its tags have no limits)."""
        if not can_skip_engine_tag_slots():
            then()  # this Prefect takes them where gpu-tasks cannot skip them: on the worker
            return
        from prefect.context import TagsContext

        tags_ctx = job.ctx.run(TagsContext.get)
        names = slot_names(job.tags | set(tags_ctx.current_tags if tags_ctx else ()))
        job.slot_names = tuple(names)
        if known_without_limits(names):
            then()  # the common case: no limit on these tags, nothing to take or wait for
            return
        st = job.st
        st.count(waiting_for_slots=1)

        def ready(hold: Hold) -> None:  # on the gate's callback thread
            st.count(waiting_for_slots=-1)
            self._slots_taken(job, hold, then)

        def failed(exc: BaseException) -> None:
            st.count(waiting_for_slots=-1)
            _off_thread(job, self._slots_failed, job, exc, name=f"gpu-tasks-slots-{job.profile.name}")

        try:
            job.hold = self.live.gate.take(names, job.task_run_id, job.ctx, ready, failed)
        except BaseException:
            st.count(waiting_for_slots=-1)
            raise

    def _slots_taken(self, job: Job, hold: Hold, then: Callable[[], Any]) -> None:
        """On the gate's callback thread: report a long wait, then ``then()``; whatever fails here,
        the task goes on or ends, never left waiting (an error on this thread is only logged)."""
        if hold.limits:
            job.slot_waited = hold.waited
            if hold.waited >= SLOT_WAIT_REPORTED_S:
                try:
                    _say(
                        job,
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
            _off_thread(job, self.finish, job, None, exc, name=f"gpu-tasks-slots-{job.profile.name}")

    def _slots_failed(self, job: Job, exc: BaseException) -> None:
        if not isinstance(exc, Exception):
            self.finish(job, exc=exc)
            return
        error = GpuTasksError(
            f"task {job.task.name!r} (profile {job.profile.name!r}) could not take its Prefect tag "
            f"concurrency slots ({', '.join(job.slot_names)}): {type(exc).__name__}: {exc}"
        )
        error.__cause__ = exc
        state = job.ctx.run(fail_task_run, job.task_run_id, job.task, self.live.flow_run_id, error, job.tags)
        self.finish(job, result=state)

    # ------------------------------------------------------------ quotas of shared schedulers
    def _take_task_quota(self, job: Job) -> None:
        """Hold room in an ``address`` profile's quota for ``job``'s task before it is handed off.

        Its task holds its devices while it runs on the shared cluster: it takes
        :func:`gpu_tasks.prefect_api.quotas.task_need` slots, waiting (logged, holding nothing) while the
        quota is full; a re-queued preempted task waits without ``GPU_TASKS_LEASE_TIMEOUT``.
        """
        live, prof = self.live, job.profile
        assert prof.quota is not None
        said: list[str] = []

        def say(line: str) -> None:
            said.append(line)
            _say(job, logging.INFO, "%s", line)

        lease, waited = quotas.wait_for_room(
            live.book.quota_slots(),
            prof.name,
            prof.quota,
            quotas.task_need(prof.gpus),
            live.stop,
            None if job.preemptions else live.settings.lease_timeout,
            say,
        )
        job.quota_lease = lease
        if said:
            live.emit_task("quota-waited", job, {"quota": prof.quota, "seconds": round(waited, 3)})

    def _release_task_quota(self, job: Job) -> None:
        """Give back ``job``'s quota slots (off the caller's thread: it is an API call)."""
        lease, job.quota_lease = job.quota_lease, None
        if lease is not None:
            _off_thread(job, self.live.book.quota_slots().release, lease, name="gpu-tasks-quota-release")

    # ------------------------------------------------------------ cached results
    def _run_cached(self, job: Job, key: str, then: Callable[[], Any]) -> None:
        """Run ``job`` in the flow process, where Prefect's engine returns its cached result (no device).

        If the record is gone by then (expired between the check and the run), the run ends
        ``Crashed`` and ``then()`` runs it again on the profile's workers, as a retry of the
        same task run.
        """
        prof = job.profile
        only = CacheOnly(job.task)
        kwargs: dict[str, Any] = dict(
            task_run_id=job.task_run_id,
            parameters=futures_to_states(job.parameters),
            wait_for=futures_to_states(list(job.wait_for)) if job.wait_for else None,
            dependencies=job.dependencies,
            return_type="state",
        )

        def run() -> Any:
            from prefect import tags

            with tags(*job.extra_tags), tag_slots_held_by_flow(job.task_run_id, job.slot_names):
                return run_engine(Allocation(profile=prof.name, worker="in-process"), only.task, kwargs)[0]

        state = job.ctx.run(run)
        if only.called:
            task_run = job.ctx.run(
                read_task_run, job.task_run_id, job.task, self.live.flow_run_id, job.tags, 2.0
            )
            await_retry(task_run, self.live.flow_run_id)
            job.task_run = task_run
            _say(
                job,
                logging.WARNING,
                "Task %r: its cached result (Prefect cache key %s) was gone when the run started; running "
                "it on profile %r",
                job.task.name,
                key,
                prof.name,
            )
            then()
            return
        job.st.count(cache_hits=1)
        _say(
            job,
            logging.INFO,
            "Task %r: result found in Prefect's cache (key %s); read in the flow process, no device "
            "leased on profile %r",
            job.task.name,
            key,
            prof.name,
        )
        self.live.emit_task("cache-hit", job, {"cache_key": key, "state": state.name})
        self.finish(job, result=state)

    # ------------------------------------------------------------ dispatch
    def soon(self, job: Job) -> None:
        """Dispatch ``job`` off the caller's thread: a GPU profile's on its dispatch thread
        (:meth:`later`), a CPU profile's on the runner's executor."""
        if job.st.dispatcher is not None:
            self.later(job)
        else:
            self.live.executor.submit(self.dispatch, job)

    def later(self, job: Job) -> None:
        """Dispatch ``job`` on its profile's dispatch thread (a GPU profile's: waiting for devices
        there blocks neither the flow nor other profiles).

        Its hand-offs to a local Dask cluster leave in batches: each dispatch on that thread
        adds its task to the profile's outbox, sent as one graph once no dispatch is queued
        behind it, or at ``OUTBOX_MAX`` (:meth:`flush`). A lone task leaves at once; a burst
        (``.map``) costs Dask one graph per batch, not per task.
        """
        st = job.st
        assert st.dispatcher is not None
        with st.counts_lock:
            st.queued += 1
        try:
            st.dispatcher.submit(self._dispatch_queued, st, job)
        except BaseException:
            with st.counts_lock:
                st.queued -= 1
            raise

    def _dispatch_queued(self, st: ProfileState, job: Job) -> None:
        _ON_DISPATCH_THREAD.st = st
        try:
            self.dispatch(job)
        finally:
            _ON_DISPATCH_THREAD.st = None
            with st.counts_lock:
                st.queued -= 1
                last = st.queued == 0
            if last or len(st.outbox) >= OUTBOX_MAX:
                self.flush(st)

    def flush(self, st: ProfileState) -> None:
        """Send ``st``'s outbox to its cluster as one graph (on its dispatch thread)."""
        batch, st.outbox = st.outbox, []
        batch = [b for b in batch if b[0].attempt == b[1]]  # one preempted meanwhile is queued again
        if not batch:
            return
        try:
            dfuts = st.cluster.submit_many(
                run_on_worker,
                [b[2] for b in batch],
                [b[0].key for b in batch],
                task_resources(st.cluster.profile),
            )
        except BaseException as exc:
            for job, _, _ in batch:
                self._not_handed_off(job, exc)
            if not isinstance(exc, Exception):
                raise
            return
        for (job, attempt, _), dfut in zip(batch, dfuts, strict=True):
            dfut.add_done_callback(partial(self._on_done, job, attempt))

    def _not_handed_off(self, job: Job, exc: BaseException) -> None:
        """``job`` was counted running but its cluster took no task: end it as :meth:`dispatch` does."""
        if not isinstance(exc, Exception):
            self.finish(job, exc=exc, dispatched=True)
            return
        try:
            state = job.ctx.run(
                fail_task_run, job.task_run_id, job.task, self.live.flow_run_id, exc, job.tags
            )
        except BaseException as err:  # never leave the future unresolved
            self.finish(job, exc=err, dispatched=True)
            return
        self.finish(job, result=state, dispatched=True)

    def dispatch(self, job: Job) -> None:
        """Run ``job`` on its profile's cluster (its upstream futures are done)."""
        try:
            job.ctx.run(self._dispatch_in_context, job)
        except Exception as exc:
            # its cluster did not start (or the runner is stopping): a Failed task run, as if the
            # task had raised, so ``wait()`` returns and ``result()`` raises ``exc``
            state = job.ctx.run(
                fail_task_run, job.task_run_id, job.task, self.live.flow_run_id, exc, job.tags
            )
            self.finish(job, result=state)
        except BaseException as exc:
            self.finish(job, exc=exc)
            raise

    def _may_provision(self, st: ProfileState) -> bool:
        """Whether the next dispatch of ``st`` starts or grows its cluster (a read without the lock)."""
        cluster = st.cluster
        if not cluster.running:
            return True
        return desired_workers(cluster.profile, st.dispatched + 1, cluster.worker_count, cluster.limit) > (
            cluster.worker_count
        )

    def _provision(self, st: ProfileState) -> None:
        """Start ``st``'s cluster, or grow it, for one more task (call under ``st.lock``)."""
        cluster = st.cluster
        want = desired_workers(cluster.profile, st.dispatched + 1, cluster.worker_count, cluster.limit)
        if not cluster.running:
            cluster.start(want)
            cluster.usage.waited(devices=cluster.startup.get("wait_devices_s", 0.0))
            st.ever_provisioned = True
            self.live.emit(
                "provisioned",
                cluster,
                {
                    "workers": cluster.worker_count,
                    **{k: round(v, 3) for k, v in cluster.startup.items()},
                },
            )
            publish_dashboard(cluster)
        elif want > cluster.worker_count:
            before = set(cluster.devices)
            cluster.scale_to(want)
            added = [d for d in cluster.devices if d not in before]
            if added:
                self.live.emit("scaled", cluster, {"workers": cluster.worker_count, "added": added}, added)

    def _dispatch_in_context(self, job: Job) -> None:
        from prefect import tags

        live, st, prof = self.live, job.st, job.profile
        parameters = futures_to_states(job.parameters)
        wait_for = futures_to_states(list(job.wait_for)) if job.wait_for else None
        if prof.address is not None and prof.is_gpu:
            st.cluster.admit(live.stop, partial(_say, job, logging.INFO, "%s"))
        if prof.quota is not None and not prof.is_local and job.quota_lease is None:
            self._take_task_quota(job)
        if st.outbox and self._may_provision(st):
            self.flush(st)  # what is ready leaves before this dispatch waits for devices or workers
        with st.lock:
            if live.stop.is_set():
                raise RuntimeError("the task runner is shutting down")
            self._provision(st)
            live.running(job)
            st.cluster.usage.waited(slots=job.slot_waited)
            job.slot_waited = 0.0  # counted once, not again on a re-run
        task = job.task
        kwargs: dict[str, Any] = dict(
            task_run_id=job.task_run_id,
            parameters=parameters,
            wait_for=wait_for,
            dependencies=job.dependencies,
            return_type="state",
        )
        if job.task_run is not None:  # a re-run after a crash continues the same task run
            kwargs["task_run"] = job.task_run
            task = task.with_options(retries=max(0, (task.retries or 0) - job.crashes))
        job.attempt += 1
        key = job.key = f"{task.name}-{job.task_run_id.hex}-{job.attempt}"
        with tags(*job.extra_tags):
            if not prof.uses_processes:
                alloc = Allocation(profile=prof.name, worker="in-process")
                dfut = st.cluster.submit(
                    contextvars.copy_context().run, run_engine, alloc, task, kwargs, key=key, resources=None
                )
            else:
                kwargs["context"], settings_key = live.context.serialize(
                    asset_ctx_kwargs={
                        "task": task,
                        "task_run_id": job.task_run_id,
                        "task_inputs": job.dependencies or {},
                        "copy_to_child_ctx": True,
                    }
                )
                args = (
                    prof.name,
                    float(prof.share),
                    live.context.blobs.blob(task, "task"),
                    kwargs,
                    settings_key,
                    not prof.is_local,
                    job.slot_names,
                )
                if prof.is_local and getattr(_ON_DISPATCH_THREAD, "st", None) is st:
                    st.outbox.append((job, job.attempt, args))  # sent by flush(), on this thread
                    return
                dfut = st.cluster.submit(run_on_worker, *args, key=key, resources=task_resources(prof))
        dfut.add_done_callback(partial(self._on_done, job, job.attempt))

    # ------------------------------------------------------------ collect
    def _on_done(self, job: Job, attempt: int, dfut: Any) -> None:
        """On Dask's callback thread (one per process): a local cluster's finished task has its
        result fetched in a batch (:mod:`gpu_tasks.runner.results`), anything else here."""
        if attempt != job.attempt:
            return  # it was preempted: re-queued, its worker's end is not its end
        if (
            job.profile.is_local
            and getattr(dfut, "status", None) == "finished"
            and self.live.landings is not None
            and self.live.landings.put((job, attempt), dfut)
        ):
            return
        try:
            value = dfut.result()
        except BaseException as exc:
            self._landed(job, attempt, None, exc)
            return
        self._landed(job, attempt, value, None)

    def _landing(self, item: tuple[Job, int], value: Any, error: BaseException | None) -> None:
        self._landed(item[0], item[1], value, error)

    def _landed(self, job: Job, attempt: int, value: Any, error: BaseException | None) -> None:
        """``job``'s hand-off ended with ``value`` (its worker's result) or ``error``."""
        live = self.live
        if attempt != job.attempt:
            return  # it was preempted: re-queued, its worker's end is not its end
        self._release_task_quota(job)
        try:
            if error is not None:
                raise error
            state, start, end, wkey = value
        except BaseException as exc:
            if _is_worker_death(exc) and not live.stop.is_set():
                # off Dask's callback thread: reporting may wait on the server, a retry on devices
                _off_thread(job, self._worker_died, job, exc, name=f"gpu-tasks-crash-{job.profile.name}")
                return
            self.finish(job, exc=exc, dispatched=True)
            return
        job.st.cluster.record(wkey, start, end)
        if isinstance(state, PreemptedRun):  # interrupted on a shared scheduler for a waiter
            by = job.st.cluster.preempted_by(job.key)
            with job.st.lock:
                live.landed(job)
            reason = f"preempted by {describe_waiter(by)}, queued {float(by.get('waited_s') or 0):.1f}s"
            fields = {k: by.get(k) for k in ("profile", "flow_run_name", "flow_run_id", "pid", "priority")}
            _off_thread(job, self._requeue, job, reason, fields, name=f"gpu-tasks-requeue-{job.profile.name}")
            return
        prof = job.profile
        if (
            prof.on_oom
            and job.escalated_from is None
            and state.is_failed()
            and GpuOutOfMemoryError.__name__ in (state.message or "")
            and not live.stop.is_set()
        ):
            with job.st.lock:
                live.landed(job)
            _off_thread(
                job,
                self._escalate_guarded,
                job,
                None,
                state.message or "out of memory",
                name=f"gpu-tasks-oom-{prof.name}",
            )
            return
        self.finish(job, result=state, dispatched=True)

    def finish(
        self, job: Job, result: Any = None, exc: BaseException | None = None, dispatched: bool = False
    ) -> None:
        """Resolve ``job``'s future with its final state (or ``exc``) and account for it."""
        st, cf = job.st, job.cf
        if job.hold is not None:
            self.live.gate.release(job.hold)
        self._release_task_quota(job)
        with st.lock:
            if dispatched:
                self.live.landed(job)
            st.leave()
        if cf.done():
            return
        if exc is not None:
            cf.set_exception(exc)
        else:
            cf.set_result(result)

    # ------------------------------------------------------------ out of memory
    def _escalate_guarded(self, job: Job, task_run: Any, why: str) -> None:
        try:
            self._escalate(job, task_run, why)
        except BaseException as err:  # never leave the future unresolved
            logger.warning(
                "gpu-tasks: could not re-run an out-of-memory task on its on_oom profile", exc_info=True
            )
            self.finish(job, exc=err)

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
        job.task_run = task_run
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
        self.dispatch(job)

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
                j.attempt += 1  # what its worker reports now is not its outcome
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
            _off_thread(j, self._requeue, j, reason, by, name=f"gpu-tasks-requeue-{j.profile.name}")

    def _requeue(self, job: Job, reason: str, by: dict[str, Any]) -> None:
        """Report ``job`` ``Preempted`` and dispatch it again (devices permitting)."""
        try:
            state, task_run = preempt_task_run(
                job.task_run_id, job.task, self.live.flow_run_id, f"Preempted: {reason}", job.tags
            )
            job.preemptions += 1
            job.task_run = task_run
            _say(
                job,
                logging.WARNING,
                "Task run %r was %s; it runs again when devices free (no retry used)",
                getattr(task_run, "name", job.task_run_id),
                reason,
            )
            self.live.emit_task(
                "preempted", job, {"reason": reason, "preemptions": job.preemptions, "by": by}
            )
            if self.live.stop.is_set():
                self.finish(job, result=state)
                return
        except BaseException as err:  # never leave the future unresolved
            logger.warning("gpu-tasks: could not re-queue a preempted task", exc_info=True)
            self.finish(job, exc=err)
            return
        self.dispatch(job)

    # ------------------------------------------------------------ dead workers
    def _worker_died(self, job: Job, exc: BaseException) -> None:
        """The worker running ``job`` died: report the crash, give its devices back, retry if allowed."""
        try:
            retry = self._report_worker_death(job, exc)
        except BaseException as err:  # never leave the future unresolved
            logger.warning("gpu-tasks: error while handling a dead worker", exc_info=True)
            self.finish(job, exc=err)
            return
        if retry is None:
            return
        delay, state = retry
        if self.live.stop.wait(delay):
            self.finish(job, result=state)
            return
        self.dispatch(job)

    def _report_worker_death(self, job: Job, exc: BaseException) -> tuple[float, Any] | None:
        """Crash report and ledger for a dead worker; ``(delay, crashed state)`` when the task is retried."""
        from gpu_tasks.worker.exits import worker_exit  # imports distributed: only once a worker died

        live, st, prof = self.live, job.st, job.profile
        ws = getattr(exc, "last_worker", None)
        name = str(getattr(ws, "name", "") or "")
        address = getattr(ws, "address", None)
        ended = worker_exit(address) if address else None
        how = ended.describe() if ended else "died"
        with st.lock:
            devices = st.cluster.worker_devices(name) or st.cluster.devices
            row = st.cluster.retire(name, f"worker crashed: {how}")
            live.landed(job)
        where = f"device(s) {','.join(devices)}" if devices else "CPU"
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
        if task_run is None or attempts > retries:
            log.error(
                "Task run %s crashed: %s%s",
                job.task_run_id,
                message,
                f"; no retries left ({retries} allowed)" if retries else "",
            )
            self.finish(job, result=state)
            return None
        delay = _retry_delay(job.task, job.crashes)
        await_retry(task_run, live.flow_run_id, delay)
        job.crashes += 1
        job.task_run = task_run
        log.warning(
            "Task run %r crashed: %s; retrying it on a new worker (retry %d of %d) in %gs",
            task_run.name,
            message,
            attempts,
            retries,
            delay,
        )
        return delay, state
