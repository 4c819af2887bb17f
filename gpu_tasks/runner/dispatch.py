"""From an admitted task to its cluster: queue, batch, provision, hand to Dask.

``Dispatcher.dispatch`` runs once a task's upstream futures are done and it was admitted
(:mod:`gpu_tasks.runner.admission`): it makes sure the profile's cluster runs with enough
workers (:mod:`gpu_tasks.policy` decides) and submits Prefect's task engine to it. What
comes back goes to :class:`gpu_tasks.runner.results.Results` (the final state) and from
there, when it went wrong, to :class:`gpu_tasks.runner.recovery.Recovery`, whose re-runs
are dispatches again. The dispatcher builds those two: they end in its hand-offs.
"""

from __future__ import annotations

import contextvars
import logging
import time
from functools import partial
from typing import Any

from gpu_tasks.allocation import Allocation
from gpu_tasks.errors import ClusterError
from gpu_tasks.policy import task_resources
from gpu_tasks.prefect_api.futures import futures_to_states
from gpu_tasks.reporting.events import publish_dashboard
from gpu_tasks.runner.admission import TaskQuota
from gpu_tasks.runner.job import Job, ProfileState
from gpu_tasks.runner.recovery import Recovery
from gpu_tasks.runner.results import Finish, Landings, Results
from gpu_tasks.runner.session import Live
from gpu_tasks.worker.engine import run_engine, run_on_worker

logger = logging.getLogger("gpu_tasks.runner")

# hand-offs a profile's dispatch thread sends to its Dask cluster as one graph, at most
OUTBOX_MAX = 32


class Dispatcher:
    """Hands one entered runner's tasks to their profiles' clusters.

    Args:
        live: the entered runner's session.
        landings: fetches a local cluster's finished results in batches (for its :class:`Results`).
        quota: an ``address`` profile's quota slots, taken before a hand-off, given back after.
        finish: resolves a task's future (:class:`gpu_tasks.runner.results.Finish`).

    It builds its :attr:`recovery` (re-runs: given :meth:`dispatch`) and its :class:`Results`
    (where its hand-offs end: given the recovery's handlers).
    """

    def __init__(self, live: Live, landings: Landings, quota: TaskQuota, finish: Finish) -> None:
        self.live = live
        self._take_quota = quota.take
        self._finish = finish
        self.recovery = Recovery(live, finish, redispatch=self.dispatch)
        self._results = Results(
            live,
            landings,
            quota.release,
            finish,
            worker_died=self.recovery.worker_died,
            out_of_memory=self.recovery.escalate,
            preempted=self.recovery.requeue,
        )

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
        try:
            self.dispatch(job, batched=True)
        finally:
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
            dfut.add_done_callback(partial(self._results.on_done, job, attempt))

    def _not_handed_off(self, job: Job, exc: BaseException) -> None:
        """``job`` was counted running but its cluster took no task: end it as :meth:`dispatch` does."""
        self._finish.fail(job, exc, dispatched=True)

    def dispatch(self, job: Job, batched: bool = False) -> None:
        """Run ``job`` on its profile's cluster (its upstream futures are done).

        Args:
            batched: called on the profile's dispatch thread (:meth:`later`), which sends a local
                cluster's hand-offs in batches (:meth:`flush`); any other caller hands off at once.
        """
        try:
            job.ctx.run(self._dispatch_in_context, job, batched)
        except Exception as exc:  # its cluster did not start (or the runner is stopping)
            self._finish.fail(job, exc)
        except BaseException as exc:
            self._finish(job, exc=exc)
            raise

    def may_provision(self, st: ProfileState) -> bool:
        """Whether the next dispatch of ``st`` starts or grows its cluster (a read without the lock)."""
        cluster = st.cluster
        if not cluster.running:
            return True
        return cluster.workers_wanted(st.dispatched + 1) > cluster.worker_count

    def _provision(self, st: ProfileState) -> None:
        """Start ``st``'s cluster, or grow it, for one more task (call under ``st.lock``)."""
        cluster = st.cluster
        if cluster.running:
            self.live.grow(st, st.dispatched + 1)
            return
        try:
            cluster.start(cluster.workers_wanted(st.dispatched + 1))
        except Exception as exc:
            st.start_failed = (time.monotonic(), exc)
            raise
        st.start_failed = None
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

    def _dispatch_in_context(self, job: Job, batched: bool) -> None:
        from prefect import tags

        live, st, prof = self.live, job.st, job.profile
        parameters = futures_to_states(job.parameters)
        wait_for = futures_to_states(list(job.wait_for)) if job.wait_for else None
        st.cluster.admit(live.stop, partial(job.say, logging.INFO, "%s"))  # a shared scheduler's waiters
        if prof.quota is not None and not prof.is_local and job.quota_lease is None:
            self._take_quota(job)
        if st.outbox and self.may_provision(st):
            self.flush(st)  # what is ready leaves before this dispatch waits for devices or workers
        with st.lock:
            if live.stop.is_set():
                raise RuntimeError("the task runner is shutting down")
            failed = st.start_failed
            if failed is not None and not prof.is_local and failed[0] >= job.submitted_at:
                raise ClusterError(
                    f"{failed[1]} (the start failed {time.monotonic() - failed[0]:.1f}s ago, after this "
                    "task was submitted: it fails with it instead of trying again)"
                ) from failed[1]
            self._provision(st)
            live.running(job)
            st.cluster.usage.waited(slots=job.slot_wait())  # counted once, not again on a re-run
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
        key = job.hand_off(task.name)
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
                if prof.is_local and batched:
                    st.outbox.append((job, job.attempt, args))  # sent by flush(), on this thread
                    return
                dfut = st.cluster.submit(run_on_worker, *args, key=key, resources=task_resources(prof))
        dfut.add_done_callback(partial(self._results.on_done, job, job.attempt))
