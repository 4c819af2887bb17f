"""A profile's controller: the one thread that runs a profile's cluster and writes its state, taking
the profile's events (:mod:`gpu_tasks.runner.job`) in order."""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from gpu_tasks.allocation import Allocation
from gpu_tasks.errors import ClusterError, GpuTasksError
from gpu_tasks.policy import close_reason, task_resources
from gpu_tasks.preemption import preemption_reason
from gpu_tasks.prefect_api.futures import annotations_for_workers
from gpu_tasks.prefect_api.states import crash_topic, rerun_task
from gpu_tasks.reporting.events import publish_dashboard
from gpu_tasks.reporting.logs import flow_logger
from gpu_tasks.runner import recovery, waiting
from gpu_tasks.runner.admission import TaskQuota
from gpu_tasks.runner.job import (
    NO_WORKER,
    Arrived,
    Board,
    Counted,
    Dispatch,
    Event,
    Job,
    Left,
    LostWorker,
    OutOfMemory,
    Preempt,
    ProfileState,
    Reclaim,
    Requeue,
    Tick,
    WorkerDied,
)
from gpu_tasks.runner.results import Results
from gpu_tasks.runner.session import Live
from gpu_tasks.worker.engine import run_engine, run_on_worker

logger = logging.getLogger("gpu_tasks.runner")

OUTBOX_MAX = 32  # hand-offs a controller sends to its Dask cluster as one graph, at most
# an idle worker process that ended though no one closed it is retired this long after (a busy one's
# task's crash report retires it first)
LOST_WORKER_GRACE_S = 2.0
# a profile short of the workers its handed-out tasks want (devices were held: a preemptor, another flow
# run) tries again this often, without waiting, to grow onto a device freed since
GROW_AGAIN_S = 2.0


class Controller:
    """The controller of profile ``st``, its state's one writer; ``controller(event, more)`` handles one."""

    def __init__(self, st: ProfileState, live: Live, results: Results, quota: TaskQuota) -> None:
        self.st = st
        self.live = live
        self._results = results
        self._quota = quota
        self._grow_again_at = 0.0

    def __call__(self, event: Event, more: bool) -> None:
        st = self.st
        if isinstance(event, Dispatch):
            self.dispatch(event.job)
        elif isinstance(event, Arrived):
            st.outstanding += 1
            st.active_changed()
        elif isinstance(event, Left):
            st.outstanding -= 1
            self._landed(event.job)
            st.active_changed()
        elif isinstance(event, Counted):
            st.waiting_for_slots += event.waiting_for_slots
            st.cache_hits += event.cache_hits
            st.active_changed()
        elif isinstance(event, Tick):
            self._retire_lost()
            if time.monotonic() >= self._grow_again_at and self._wanted(st.dispatched) is not None:
                self._grow_again_at = time.monotonic() + GROW_AGAIN_S
                self._refill()
            reason = close_reason(st.idle_view(), time.monotonic())
            if reason and not self.live.stop.is_set():
                self.live.close_cluster(st, f"scaled down: {reason}")
        elif isinstance(event, WorkerDied):
            self._worker_died(event.job, event.exc)
        elif isinstance(event, OutOfMemory):
            self._landed(event.job)
            self._recover("oom", recovery.escalate, event.job, None, event.why)
        elif isinstance(event, Requeue):
            self._landed(event.job)
            self._recover("requeue", recovery.requeue, event.job, event.reason, event.by)
        elif isinstance(event, Preempt):
            self._preempt(event.addresses, event.waiter)
        elif isinstance(event, Reclaim):
            idle = st.idle_view()
            if (
                idle.running
                and idle.outstanding == 0
                and not self.live.ending  # its close says why; the waiter gets nothing then
                # for a profile that runs already, only after a while: not between two tasks of a sequence
                and (
                    not event.growing
                    or time.monotonic() - (idle.idle_since or time.monotonic()) >= GROW_AGAIN_S
                )
                and event.wanted.intersection(st.cluster.devices)
            ):
                self.live.close_cluster(st, f"released its devices early: {event.by} is waiting for them")
        elif isinstance(event, Board):
            self._board(event.what, event.info)
        if st.outbox and (not more or len(st.outbox) >= OUTBOX_MAX):
            self.flush()

    def _landed(self, job: Job) -> None:
        self.st.inflight.pop(job.task_run_id, None)

    def dispatch(self, job: Job) -> None:
        """Run ``job`` on the profile's cluster, starting or growing it first (it waits for devices here)."""
        if self.st.closing:  # queued when the runner stopped: no server call, as no task ran
            self._results.finish(job, exc=RuntimeError("the task runner is shutting down"))
            return
        try:
            job.ctx.run(self._dispatch_in_context, job)
        except BaseException as exc:  # its cluster did not start (or the runner is stopping)
            self._results.fail(job, exc)  # a Ctrl-C resolves the future with itself, and goes on
            if not isinstance(exc, Exception):
                raise

    def flush(self) -> None:
        """Send the outbox to the cluster as one graph."""
        st = self.st
        batch, st.outbox = st.outbox, []
        batch = [b for b in batch if b[0].attempt == b[1]]  # one preempted meanwhile is queued again
        if not batch:
            return
        try:
            dfuts = st.cluster.submit_many(
                run_on_worker,
                [b[2] for b in batch],
                [b[0].key for b in batch],
                task_resources(st.profile),
            )
        except BaseException as exc:
            for job, _, _ in batch:
                self._results.fail(job, exc)
            if not isinstance(exc, Exception):
                raise
            return
        for (job, attempt, _), dfut in zip(batch, dfuts, strict=True):
            dfut.add_done_callback(partial(self._results.on_done, job, attempt))

    def _wanted(self, tasks: int) -> int | None:
        """The workers to start or grow the cluster to for ``tasks`` tasks; ``None`` when it has them."""
        cluster = self.st.cluster
        want = cluster.workers_wanted(tasks)
        return want if not cluster.running or want > cluster.worker_count else None

    def _provision(self, tasks: int) -> None:
        """Start the cluster, or grow it (a ``scaled`` event), for ``tasks`` tasks handed out."""
        st, cluster = self.st, self.st.cluster
        want = self._wanted(tasks)
        if want is None:
            return
        if cluster.running:
            before = set(cluster.devices)
            cluster.scale_to(want)
            if added := [d for d in cluster.devices if d not in before]:
                self.live.emit("scaled", cluster, {"workers": cluster.worker_count, "added": added}, added)
            return
        try:
            cluster.start(want)
        except Exception as exc:
            st.start_failed = (time.monotonic(), exc)
            raise
        st.start_failed = None
        cluster.subscribe(crash_topic(self.live.flow_run_id), self._told)  # a shared one's workers tell
        cluster.usage.waited(devices=cluster.startup.get("wait_devices_s", 0.0))
        st.ever_provisioned = True
        self.live.emit(
            "provisioned",
            cluster,
            {
                "workers": cluster.worker_count,
                **{k: round(v, 3) for k, v in cluster.startup.items()},
                **cluster.gang_wiring,  # a gang's devices and the worst link between them
            },
        )
        publish_dashboard(cluster)

    def _told(self, event: tuple[float, dict[str, Any]]) -> None:
        """A shared worker's line about a crash of this profile's task, for the flow run's log."""
        told = event[1]
        if told.get("profile") == self.st.profile.name:
            self.live.in_run_context(lambda: flow_logger().log(int(told["level"]), "%s", told["line"]))

    def _refill(self) -> None:
        """Grow to what the tasks handed out want (after workers were lost, or devices held by others
        freed), without waiting for devices."""
        st = self.st
        if not (st.dispatched and st.cluster.running and st.profile.is_gpu):
            return
        try:
            self._provision(st.dispatched)
        except Exception:
            logger.warning("gpu-tasks: could not replace a lost worker", exc_info=True)

    def _dispatch_in_context(self, job: Job) -> None:
        with waiting.reported(self.live, job):  # what holds it up from here goes to its task run's log
            self._dispatch_job(job)

    def _dispatch_job(self, job: Job) -> None:
        live, st, prof = self.live, self.st, job.profile
        if st.cluster.running and (lost := st.cluster.lost()) is not None:
            live.close_cluster(st, lost, hurry=True)  # connected again below, or it fails saying why
        st.cluster.admit(live.stop, partial(job.say, logging.INFO, "%s"))  # a shared scheduler's waiters
        if prof.quota is not None and st.cluster.shared and job.quota_lease is None:
            self._quota.take(job)
        if st.outbox and self._wanted(st.dispatched + 1) is not None:
            self.flush()  # what is ready leaves before this dispatch waits for devices or workers
        if live.stop.is_set():
            raise RuntimeError("the task runner is shutting down")
        failed = st.start_failed
        if failed is not None and st.cluster.shared and failed[0] >= job.submitted_at:
            kind = type(failed[1]) if isinstance(failed[1], GpuTasksError) else ClusterError  # as the first
            raise kind(
                f"{failed[1]} (the start failed {time.monotonic() - failed[0]:.1f}s ago, after this "
                "task was submitted: it fails with it instead of trying again)"
            ) from failed[1]
        self._provision(st.dispatched + 1)
        st.inflight[job.task_run_id] = job  # until its Left, however it ends
        st.cluster.usage.waited(slots=job.slot_wait())  # counted once, not again on a re-run
        task = job.task
        kwargs = job.engine_kwargs()
        if job.task_run is not None:  # a re-run (crash, preemption, on_oom) continues the same task run
            kwargs["task_run"] = job.task_run
            task = rerun_task(task, job.task_run, job.free_runs, job.crashes)
        key = job.hand_off(task.name)
        with job.tags_context():
            if not prof.uses_processes:
                alloc = Allocation(profile=prof.name, worker="in-process")
                dfut = st.cluster.submit(
                    contextvars.copy_context().run, run_engine, alloc, task, kwargs, key=key, resources=None
                )
            else:
                for name in ("parameters", "wait_for"):
                    kwargs[name] = annotations_for_workers(kwargs[name])
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
                    st.cluster.shared,
                    job.slot_names,
                    None if st.cluster.shared else live.started.path,  # what began, if its worker dies
                    job.free_runs,  # a shared scheduler's re-run counts the runs that used a retry
                )
                if not st.cluster.shared:
                    st.outbox.append((job, job.attempt, args))  # sent by flush(), when the inbox is empty
                    return
                dfut = st.cluster.submit(run_on_worker, *args, key=key, resources=task_resources(prof))
        dfut.add_done_callback(partial(self._results.on_done, job, job.attempt))

    def _retire_lost(self) -> None:
        """Give back the devices of workers that ended though no one closed them; refill, or close."""
        st = self.st
        if not st.cluster.running or not (lost := st.cluster.lost_workers(LOST_WORKER_GRACE_S)):
            return
        from gpu_tasks.worker.exits import worker_exit

        for name, address in lost:
            ended = worker_exit(address) if address else None
            how = ended.describe() if ended else "ended"
            devices = st.cluster.worker_devices(name) or ()
            st.last_lost = LostWorker(name, devices, ended, address)  # crash reports name it
            row = st.cluster.retire(name, f"worker lost: {how}", keep=True)
            logger.warning(
                "profile %r: worker %r%s %s though the runner did not stop it (Dask's log above says "
                "why: a scheduler drops a worker it has not heard from for "
                "distributed.scheduler.worker-ttl); its devices are given back",
                st.profile.name,
                name,
                f" (pid {ended.pid})" if ended and ended.pid else "",
                how,
            )
            if row is not None:
                self.live.gave_back(st, row, "crashed", {"worker": name, "while": "idle"})
        self._refill()
        if st.cluster.worker_count == 0:
            self.live.close_cluster(st, "its workers were lost")

    def _worker_died(self, job: Job, exc: BaseException) -> None:
        """Retire the dead worker that ran ``job`` (once), replace it, and recover ``job`` off thread."""
        from gpu_tasks.worker.exits import worker_exit  # imports distributed: only once a worker died

        st = self.st
        ws = getattr(exc, "last_worker", None)
        row = None
        self.live.count_interrupted(job)  # busy from the hand-off's start until now
        if ws is None and st.cluster.shared:  # its client lost the scheduler: no worker to name
            lost, how = NO_WORKER, f"{type(exc).__name__}: {exc}"
        elif ws is None:  # lost with its cluster (closed when its last worker died), no worker named
            # (or with its scheduler, killed: a one-worker cluster's devices are still known)
            only = st.cluster.devices if st.cluster.worker_count == 1 else ()
            lost = st.last_lost or LostWorker("", tuple(only), None, None)
            how = lost.ended.describe() if lost.ended else f"was lost ({type(exc).__name__}: {exc})"
        else:
            name = str(getattr(ws, "name", "") or "")
            address = getattr(ws, "address", None)
            known = st.last_lost
            if known is not None and known.worker_address == address:  # retired (another of its tasks)
                lost = known
            else:
                ended = worker_exit(address) if address else None
                devices = tuple(st.cluster.worker_devices(name) or st.cluster.devices)
                lost = st.last_lost = LostWorker(name, devices, ended, address)
                row = st.cluster.retire(name, f"worker crashed: {ended.describe() if ended else 'died'}")
                if row is not None:  # booked by the recovery thread: the later reports count on it now
                    self.live.written(row)
            how = lost.ended.describe() if lost.ended else "died"
        self._landed(job)
        self._refill()  # a new worker for the tasks still queued on the workers left
        self._recover("crash", recovery.worker_died, job, lost, how, row)

    def _recover(self, kind: str, step: Callable[..., None], job: Job, *args: Any) -> None:
        """``step(results, job, *args)`` on a thread of its own, as it waits on the Prefect API."""
        name = f"gpu-tasks-{kind}-{job.profile.name}"
        thread = job.off_thread(recovery.recover, kind, step, self._results, job, *args, name=name)
        self.st.recovering = [(j, t) for j, t in self.st.recovering if t.is_alive()] + [(job, thread)]

    def _preempt(self, addresses: list[str], waiter: dict[str, Any]) -> None:
        """Stop the workers on ``addresses`` for ``waiter``; their tasks run again, retries intact."""
        st, live = self.st, self.live
        cluster = st.cluster
        waited = time.time() - float(waiter["arrived"])
        reason = preemption_reason(waiter, f"waiting {waited:.1f}s")
        by = {
            k: waiter.get(k)
            for k in ("profile", "flow_run_name", "flow_run_id", "pid", "priority", "arrived", "reclaimed_by")
        }
        names = cluster.workers_on(addresses)
        if not cluster.running or not names:
            return
        jobs = list(st.inflight.values())
        keys = None if cluster.whole_stop(names) else cluster.running_keys(names)
        if keys is None:  # the whole cluster stops (or Dask cannot tell which ran where)
            names = [s.name for s in cluster.specs]
            addresses = list(cluster.devices)  # a gang's every device, not only those asked for
        else:
            jobs = [j for j in jobs if j.key in keys]
        for j in jobs:
            live.count_interrupted(j)  # busy until stopped, in the row its workers' stop writes
            j.attempt += 1  # what its worker reports now is not its outcome
            self._landed(j)
        logger.warning(
            "profile %r: stopping worker(s) %s on device(s) %s, %d task(s) re-queued: %s (Dask keys: %s)",
            st.profile.name,
            ", ".join(names),
            ",".join(addresses),
            len(jobs),
            reason,
            ", ".join(j.key for j in jobs) or "none",
        )
        try:
            rows = cluster.stop_workers(names, reason, keys)
        except Exception:  # its tasks are re-queued whatever happens: stop it all instead
            logger.warning("profile %r: could not stop workers %s", st.profile.name, names, exc_info=True)
            whole = cluster.close(reason, hurry=True)
            rows = [whole] if whole is not None else []
        for row in rows:
            live.gave_back(st, row, "preempted", {"by": dict(by, waited_s=round(waited, 3))})
        for j in jobs:
            self._recover("requeue", recovery.requeue, j, reason, by)

    def _board(self, what: str, info: dict[str, Any]) -> None:
        """An address profile's ``preempting`` or ``preempted`` on its shared scheduler, as an event."""
        st = self.st
        keep = "profile flow_run_name flow_run_id pid hostname priority waited_s workers".split()
        if what == "preempting":
            payload = {k: info.get(k) for k in ("priority", "waited_s", "workers", "need", "queued")}
        else:
            st.cluster.preemptions += 1
            by = info.get("by") or {}
            payload = {
                "by": {k: by.get(k) for k in keep},
                "worker": info.get("worker"),
                "tasks": len(info.get("keys") or ()),
                "interrupted": len(info.get("interrupted") or ()),
            }
        self.live.emit(what, st.cluster, payload)
