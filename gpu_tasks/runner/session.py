"""What an entered runner owns while it runs: its profiles' states and jobs (:mod:`gpu_tasks.runner.job`),
the idle monitor, closing.

``Live`` is created when the runner's first task is submitted (never in
``__enter__``: Prefect enters copies of the runner on workers) and closed as a
whole when the flow run ends.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import logging
import threading
import time
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any

from gpu_tasks.cluster.backends import uses_warm_pool
from gpu_tasks.cluster.kinds import new_cluster
from gpu_tasks.cluster.local import ProfileCluster
from gpu_tasks.compat import warn_if_changed
from gpu_tasks.compat.prefect import use_no_limits_cache
from gpu_tasks.devices.book import DeviceBook
from gpu_tasks.devices.discovery import Inventory, discover
from gpu_tasks.devices.measure import Sampler
from gpu_tasks.policy import bound_at_most, close_reason
from gpu_tasks.prefect_api.api import require_flow_api_url, worker_env
from gpu_tasks.prefect_api.states import api_unreachable
from gpu_tasks.prefect_api.tag_answers import start_renewing
from gpu_tasks.prefect_api.tag_slots import SlotGate
from gpu_tasks.profiles import ResourceProfile
from gpu_tasks.reporting.events import RunRef, emit_cluster_event, emit_right_size, emit_task_event
from gpu_tasks.reporting.ledger import LedgerRow, right_size
from gpu_tasks.reporting.logs import RunLogs
from gpu_tasks.runner.job import Job, LostWorker, ProfileState
from gpu_tasks.runner.payload import ContextSerializer
from gpu_tasks.settings import get_settings

logger = logging.getLogger("gpu_tasks.runner")

PREEMPTION_CHECK_S = 0.5  # how often a runner with preemptible clusters reads the device queue
# a worker process that ended though no one closed it, while idle, is retired this long after (one
# that ran a task is the task's crash report's to retire, which comes first)
LOST_WORKER_GRACE_S = 2.0


# preempt(st, addresses, waiter): stop st's workers on addresses for waiter (gpu_tasks.runner.recovery)
Preempt = Callable[[ProfileState, list[str], dict[str, Any]], None]


class Live:
    """Everything an entered runner owns; closed as a whole on exit (``close_results(timeout)``: the
    results fetched or queued reach their tasks, gpu_tasks.runner.results.Landings.close)."""

    def __init__(
        self,
        profiles: dict[str, ResourceProfile],
        default: str,
        idle_timeout: float,
        close_results: Callable[[float], None],
    ):
        self.profiles, self.default = profiles, default
        self._close_results = close_results
        self.settings = get_settings()
        use_no_limits_cache(self.settings.tag_limit_cache_seconds)
        start_renewing()  # the answers renewed before they expire (prefect_api.tag_answers)
        warn_if_changed()  # once per process: a release that changed a private name gpu-tasks uses
        self.idle_timeout = idle_timeout
        self._inventory: Inventory | None = None
        self.states: dict[str, ProfileState] = {}
        self.ledger: list[LedgerRow] = []
        self.inflight: dict[uuid.UUID, Job] = {}  # handed to a cluster, no final state yet
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=4, thread_name_prefix="gpu-tasks-dispatch"
        )
        self.monitor: threading.Thread | None = None
        self.gate = SlotGate()  # the tag concurrency slots of GPU tasks (its thread starts on first use)
        self.worker_env: dict[str, str] | None = None
        self.context = ContextSerializer()
        self.book = DeviceBook(
            reclaim=self._reclaim,
            stop=self.stop,
            lease_dir=self.settings.lease_dir,
            lease_timeout=self.settings.lease_timeout,
            preemption_grace=self.settings.preemption_grace,
            on_preempting=self._on_preempting,
            priority_aging=self.settings.priority_aging,
        )
        self.preempting: dict[str, threading.Thread] = {}  # profile -> the thread preempting it
        # profile -> (worker name, devices, how it ended, address) of its last worker lost while idle
        self.lost: dict[str, LostWorker] = {}
        self.run = RunRef.current()  # the runner outlives the flow run context; remember the run
        # events are sent in the flow run's context, also after Prefect left it (exit-time events):
        # Prefect's events worker adds related resources from the sending context
        self.ctx = contextvars.copy_context()
        self.flow_run_id = self.run.id
        # why the Prefect API could not be reached when an interrupted run closed (then no events)
        self.api_down: str | None = None
        self.sampler = Sampler(self.settings.gpu_sample_seconds)  # measured use (its thread: real devices)
        RunLogs.enter(self.flow_run_id, self.settings.dask_log_level)  # lines to the run's logs
        try:
            self.pool = self._warm_pool()
        except BaseException:
            RunLogs.leave(self.flow_run_id)
            raise

    def _warm_pool(self) -> Any:
        """Start the warm worker processes (gpu_tasks.worker.warm) when a profile's workers can use them.

        Started with the runner's first task, so they import while earlier stages run; they
        hold no device, and :meth:`close` ends them.
        """
        size = self.settings.warm_workers
        local = [p for p in self.profiles.values() if p.is_local and p.uses_processes]
        if size <= 0 or not local:
            return None
        emulated = self.inventory.emulated if any(p.is_gpu for p in local) else False
        pooled = [p for p in local if uses_warm_pool(p, emulated)]
        if not pooled:
            return None
        from gpu_tasks.worker.warm import WarmPool

        pool = WarmPool(size, capacity=bound_at_most(pooled, self.inventory))
        target = pool.target()
        pool.start_in_background()  # a new fork server's imports hold up no task of this flow
        logger.info("gpu-tasks: %d warm worker process(es) starting (GPU_TASKS_WARM_WORKERS)", target)
        return pool

    @property
    def inventory(self) -> Inventory:
        if self._inventory is None:
            t0 = time.monotonic()
            self._inventory = discover(self.settings)
            logger.info(
                "gpu-tasks devices: %s (found in %.2f s)", self._inventory.describe(), time.monotonic() - t0
            )
            if self._inventory.emulated:
                logger.warning(
                    "gpu-tasks is EMULATING devices (%s): tasks get CUDA_VISIBLE_DEVICES and Dask GPU "
                    "resources as on real hardware, but compute runs on the CPU",
                    self._inventory.detail,
                )
        return self._inventory

    def state(self, prof: ResourceProfile) -> ProfileState:
        with self.lock:
            st = self.states.get(prof.name)
            if st is None:
                if self.worker_env is None and prof.uses_processes:
                    RunLogs.dask_imported()  # Dask's INFO chatter stays out (GPU_TASKS_DASK_LOG_LEVEL)
                    api_url = require_flow_api_url(prof.name)
                    self.worker_env = worker_env(api_url)
                    self.context.api_url = api_url
                timeout = prof.idle_timeout if prof.idle_timeout is not None else self.idle_timeout
                cluster = new_cluster(
                    prof,
                    inventory=lambda: self.inventory,
                    worker_env=self.worker_env or {},
                    provision_timeout=self.settings.provision_timeout,
                    dashboard=self.settings.dashboard,
                    book=self.book,
                    pool=self.pool,
                    api_url=self.context.api_url,
                    on_board=partial(self._on_board, prof.name),
                )
                st = self.states[prof.name] = ProfileState(cluster, timeout)
                self.sampler.watch(cluster)
            return st

    # ------------------------------------------------------------ in flight
    def running(self, job: Job) -> None:
        """``job`` was handed to its cluster (its dispatch calls this under its profile's lock)."""
        with job.st.counts_lock:
            job.st.dispatched += 1
        self.inflight[job.task_run_id] = job

    def landed(self, job: Job) -> None:
        """``job`` came back from its cluster, finished or not (from any thread: no profile's lock)."""
        with job.st.counts_lock:
            job.st.dispatched -= 1
        self.inflight.pop(job.task_run_id, None)

    # ------------------------------------------------------------ idle close
    def watch(self, preempt: Preempt) -> None:
        """Start the monitor: idle clusters close; ``preempt`` runs when a waiter is due devices."""
        if self.monitor is None:
            # The monitor and the close threads it starts run in the submitting thread's context:
            # a thread starts with an empty one, which would lose the flow run's Prefect settings
            # (an API URL set by `temporary_settings` or a test harness) and send the events of
            # idle closes to a new ephemeral Prefect server started in this process.
            self.monitor = threading.Thread(
                target=contextvars.copy_context().run,
                args=(self._watch, preempt),
                name="gpu-tasks-idle",
                daemon=True,
            )
            self.monitor.start()

    def _watch(self, preempt: Preempt) -> None:
        closing: dict[str, threading.Thread] = {}
        next_preemption_check = 0.0
        while not self.stop.wait(self._interval()):
            if time.monotonic() >= next_preemption_check:
                next_preemption_check = time.monotonic() + PREEMPTION_CHECK_S
                try:
                    self._check_preemption(preempt)
                except Exception:  # the idle monitor must go on
                    logger.warning("gpu-tasks: preemption check failed", exc_info=True)
            for name, st in list(self.states.items()):
                if name in closing and closing[name].is_alive():
                    continue
                try:
                    self._retire_lost(st)
                except Exception:  # the idle monitor must go on
                    logger.warning("gpu-tasks: could not retire a lost worker", exc_info=True)
                if close_reason(st.idle_view(), time.monotonic()):
                    # close off the monitor thread so one slow close never delays another profile's
                    closing[name] = threading.Thread(
                        target=contextvars.copy_context().run,
                        args=(self._close_if_idle, st),
                        name=f"gpu-tasks-close-{name}",
                        daemon=True,
                    )
                    closing[name].start()
        for thread in closing.values():
            thread.join(timeout=30)

    def _retire_lost(self, st: ProfileState) -> None:
        """Give back the devices of workers whose process ended though no one closed them (their
        scheduler dropped them: no heartbeat within Dask's worker TTL). Tasks the scheduler holds
        for the profile then get a new worker (when its devices can be had at once; else the
        cluster closes and they are reported as for a dead worker): they never wait at a scheduler
        with no worker."""
        if not st.cluster.running or not (lost := st.cluster.lost_workers(LOST_WORKER_GRACE_S)):
            return
        from gpu_tasks.worker.exits import worker_exit

        for name, address in lost:
            ended = worker_exit(address) if address else None
            how = ended.describe() if ended else "ended"
            with st.lock:
                devices = st.cluster.worker_devices(name) or ()
                self.lost[st.cluster.profile.name] = LostWorker(
                    name, devices, ended, address
                )  # crash reports
                row = st.cluster.retire(name, f"worker lost: {how}", keep=True)
            logger.warning(
                "profile %r: worker %r%s %s though the runner did not stop it (Dask's log above says "
                "why: a scheduler drops a worker it has not heard from for "
                "distributed.scheduler.worker-ttl); its devices are given back",
                st.cluster.profile.name,
                name,
                f" (pid {ended.pid})" if ended and ended.pid else "",
                how,
            )
            if row is not None:
                self.gave_back(st, row, "crashed", {"worker": name, "while": "idle"})
        with st.lock:
            self.refill(st)
            if st.cluster.worker_count == 0:
                self.close_cluster(st, "its workers were lost")

    def refill(self, st: ProfileState) -> None:
        """After workers were lost (retired by the idle monitor, or a crash report): grow ``st``'s
        cluster back to as many workers as the tasks handed to it want, on the devices just given
        back unless a waiter has them. No later dispatch may come to grow it: every task may have
        been handed out already, and they would queue on the workers left. Call under ``st.lock``."""
        if not (st.dispatched and st.cluster.running and st.cluster.profile.is_gpu):
            return
        try:
            self.grow(st, st.dispatched)
        except Exception:
            logger.warning("gpu-tasks: could not replace a lost worker", exc_info=True)

    def grow(self, st: ProfileState, outstanding: int) -> None:
        """Grow ``st``'s running cluster to the workers ``outstanding`` tasks want
        (:meth:`~gpu_tasks.cluster.local.ProfileCluster.workers_wanted`), with a ``scaled`` event when
        it added devices. Call under ``st.lock``."""
        cluster = st.cluster
        want = cluster.workers_wanted(outstanding)
        if want <= cluster.worker_count:
            return
        before = set(cluster.devices)
        cluster.scale_to(want)
        if added := [d for d in cluster.devices if d not in before]:
            self.emit("scaled", cluster, {"workers": cluster.worker_count, "added": added}, added)

    def _close_if_idle(self, st: ProfileState) -> None:
        with st.lock:  # re-check under the lock: a task may have arrived meanwhile
            reason = close_reason(st.idle_view(), time.monotonic())
            if reason and not self.stop.is_set():
                self.close_cluster(st, f"scaled down: {reason}")

    # ------------------------------------------------------------ preemption
    def _check_preemption(self, preempt: Preempt) -> None:
        """Stop preemptible workers whose devices a higher-priority waiter has waited for too long."""
        busy = {n for n, t in self.preempting.items() if t.is_alive()}
        preemptible = {
            name
            for name, st in list(self.states.items())
            if st.cluster.profile.preemptible and st.cluster.running and name not in busy
        }
        if not preemptible:
            return
        due = self.book.preemption_due(preemptible)
        if due is None:
            return
        waiter, addresses = due
        for name in sorted({o for a in addresses if (o := self.book.holders.get(a)) in preemptible}):
            st = self.states[name]
            mine = [a for a in addresses if self.book.holders.get(a) == name]
            self.preempting[name] = thread = threading.Thread(
                target=contextvars.copy_context().run,
                args=(preempt, st, mine, waiter),
                name=f"gpu-tasks-preempt-{name}",
                daemon=True,
            )
            thread.start()

    def _on_preempting(self, owner: str, holders: list[dict[str, Any]]) -> None:
        """Profile ``owner`` waited past its grace; ``holders`` give devices back (the waiter's event)."""
        st = self.states.get(owner)
        if st is None:
            return
        self.emit(
            "preempting",
            st.cluster,
            {
                "priority": st.cluster.priority,
                "devices": [h["address"] for h in holders],
                "holders": [
                    {
                        k: h.get(k)
                        for k in ("address", "profile", "priority", "flow_run_name", "flow_run_id", "pid")
                    }
                    for h in holders
                ],
            },
            [h["address"] for h in holders],
        )

    def _on_board(self, name: str, what: str, info: dict[str, Any]) -> None:
        """An address profile's preemption on its shared scheduler (gpu_tasks.cluster.board):
        ``preempting`` (it waited past its grace: its entry went up) or ``preempted`` (we
        interrupted tasks for another's entry)."""
        st = self.states.get(name)
        if st is None:  # told before the profile's state was kept: nothing to count it on yet
            return
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
        self.emit(what, st.cluster, payload)

    def _reclaim(self, wanted: set[str], by: str) -> None:
        """Close idle clusters that hold devices profile ``by`` waits for (before their timeout)."""
        for name, st in list(self.states.items()):
            if name == by or not wanted.intersection(st.cluster.devices):
                continue
            if not st.lock.acquire(blocking=False):  # busy dispatching; try again next round
                continue
            try:
                if st.cluster.running and st.idle_view().outstanding == 0:
                    self.close_cluster(st, f"released its devices early: profile {by!r} is waiting for them")
            finally:
                st.lock.release()

    def _interval(self) -> float:
        timeouts = [st.idle_timeout for st in self.states.values()] or [1.0]
        return min(0.25, max(0.02, min(timeouts) / 5))

    def close_cluster(self, st: ProfileState, reason: str, hurry: bool = False) -> None:
        """Close ``st``'s cluster, write its ledger row and say so in an event."""
        row = st.cluster.close(reason, hurry=hurry)
        if row is not None:
            self.gave_back(st, row, "closed")

    def gave_back(
        self, st: ProfileState, row: LedgerRow, what: str, extra: dict[str, Any] | None = None
    ) -> None:
        """Ledger ``row`` of devices ``st``'s cluster gave back, and its event (``closed``, ``preempted``)."""
        devices = list(row.devices)
        self.ledger.append(row)
        self.emit(
            what,
            st.cluster,
            {
                "reason": row.reason,
                "devices": devices,
                "held_s": round(row.held_seconds, 3),
                "busy_s": round(row.busy_seconds, 3),
                "tasks": row.tasks,
                **(extra or {}),
            },
            devices,
        )

    # ------------------------------------------------------------ events
    def priorities(self) -> dict[str, int]:
        """The priority each profile that queues for this host's devices waited at (by name)."""
        return {
            name: st.cluster.queue_priority
            for name, st in self.states.items()
            if st.cluster.queue_priority is not None
        }

    def emit(self, what: str, cluster: ProfileCluster, payload: dict[str, Any], devices: Any = None) -> None:
        """A ``gpu-tasks.cluster.<what>`` event related to this flow run."""
        if self.api_down is None:  # else it would only fail, 7 s later, and hold up the exit
            self.in_run_context(emit_cluster_event, what, cluster, self.run, payload, devices)

    def emit_task(self, what: str, job: Job, payload: dict[str, Any]) -> None:
        """A ``gpu-tasks.task.<what>`` event about ``job``'s task run."""
        if self.api_down is not None:
            return
        task_run_name = getattr(job.task_run, "name", None)
        self.in_run_context(
            emit_task_event,
            what,
            job.task_run_id,
            job.task.name,
            job.profile.name,
            self.run,
            payload,
            task_run_name,
        )

    def api_answers(self) -> bool:
        """Whether the Prefect API answered when this run closed and still does (probed once more)."""
        if self.api_down is None:
            self.api_down = api_unreachable()
        return self.api_down is None

    def in_run_context(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in the flow run's context as it was when the runner started (any thread)."""
        return self.ctx.copy().run(fn, *args)

    # ------------------------------------------------------------ close
    def close(self, reason: str, hurry: bool = False) -> None:
        try:
            self._close(reason, hurry)
        finally:
            RunLogs.leave(self.flow_run_id)  # the close's own lines were sent before this

    def _close(self, reason: str, hurry: bool) -> None:
        self.stop.set()
        if hurry:  # a plain script's ephemeral server dies with the Ctrl-C that stopped its flow
            self.api_down = api_unreachable()
        if self.monitor is not None:
            self.monitor.join(timeout=5)
        self.sampler.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
        for st in list(self.states.values()):
            if st.dispatcher is not None:
                st.dispatcher.shutdown(wait=False, cancel_futures=True)
            st.cluster.drain()
        # results already fetched or queued reach their tasks before the clusters go (a task that
        # finished is never reported Crashed for the close); later ones are fetched one by one
        self._close_results(2.0 if hurry else 10.0)
        running = list(self.inflight.values())
        for st in list(self.states.values()):
            with st.lock:
                self.close_cluster(st, reason, hurry=hurry)
                try:
                    st.cluster.shutdown()
                except Exception:
                    logger.warning(
                        "profile %r: error while shutting down", st.cluster.profile.name, exc_info=True
                    )
        if self.pool is not None:
            self.pool.close()
        self.book.close()  # quota leases left (the clusters gave their devices back)
        # after the clusters: a task still running holds its slots until its worker is gone
        self.gate.close(timeout=2.0 if hurry else 10.0)
        self._crash_unfinished(running, reason, hurry)
        self._advise()

    def _advise(self) -> None:
        """A right-size line per GPU profile that used much less than it held (reporting.measured),
        in the run's log and as a ``gpu-tasks.profile.right-size`` event; on emulated devices one
        line saying nothing was measured."""
        for profile, line, measured in right_size(self.ledger):
            logger.info("gpu-tasks: %s", line)
            if measured is not None and self.api_down is None:
                self.in_run_context(emit_right_size, profile, line, measured, self.run)

    def _crash_unfinished(self, jobs: list[Job], reason: str, hurry: bool) -> None:
        """Report task runs that were running when their cluster closed ``Crashed`` (never left Running).

        With the Prefect API gone (a plain script's ephemeral server dies with the Ctrl-C that
        stops its flow), the states are only set here and one line says which runs the server
        still shows ``Running``: reporting each, Prefect's client would retry for about a minute
        apiece. After an interrupt requests are not retried, and the API is probed again every
        16 reports, so a server that dies mid-way costs at most 16 failed reports.
        """
        from prefect.states import Crashed

        from gpu_tasks.prefect_api.states import crash_task_run, no_client_retries

        unfinished = [
            j for j in jobs if not (j.cf.done() and not j.cf.cancelled() and j.cf.exception() is None)
        ]
        down = (self.api_down or api_unreachable()) if unfinished else None
        unreported: list[Job] = []
        for i, job in enumerate(unfinished):  # the others finished while the clusters closed
            prof = job.profile
            message = f"the flow run stopped ({reason}) while this task ran on profile {prof.name!r}; " + (
                "the runner interrupted it on the shared cluster (cancelled it there if it had not started)"
                if prof.address is not None
                else "its worker was closed"
            )
            if down is None and i and i % 16 == 0 and hurry:
                down = api_unreachable()
            if down is None:
                with no_client_retries(hurry):
                    state, _ = crash_task_run(
                        job.task_run_id,
                        job.task,
                        self.flow_run_id,
                        message,
                        tags=job.tags,
                        wait=0.0 if i else 1.0,
                    )
                logger.warning("task run %s of profile %r: %s", job.task_run_id, prof.name, message)
            else:
                unreported.append(job)
                state = Crashed(message=message)
                state.state_details.task_run_id = job.task_run_id
                state.state_details.flow_run_id = self.flow_run_id
            if not job.cf.done():
                job.cf.set_result(state)
        self.api_down = down
        if unreported:
            ids = ", ".join(str(j.task_run_id) for j in unreported[:5])
            logger.warning(
                "the Prefect API is unreachable: %s. %d task run(s) that were running when the flow run "
                "stopped (%s) could not be reported Crashed and stay 'Running' in that server's records "
                "(%s%s). A plain script on Prefect's ephemeral API loses its server to the same Ctrl-C; "
                "to keep the records, start a server (`prefect server start`, then PREFECT_API_URL) or "
                "use `gpu-tasks run`",
                down,
                len(unreported),
                reason,
                ids,
                ", ..." if len(unreported) > 5 else "",
            )
