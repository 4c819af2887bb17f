"""What an entered runner owns while it runs (:class:`Live`): its profiles' states, the idle monitor,
closing. Created with the first task (Prefect enters copies of the runner on workers)."""

from __future__ import annotations

import concurrent.futures
import contextvars
import logging
import threading
import time
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

from gpu_tasks.cluster.backends import uses_warm_pool
from gpu_tasks.cluster.kinds import new_cluster, starts_processes_here
from gpu_tasks.cluster.local import ProfileCluster
from gpu_tasks.compat import warn_if_changed
from gpu_tasks.compat.prefect import use_no_limits_cache
from gpu_tasks.devices import lending
from gpu_tasks.devices.book import DeviceBook
from gpu_tasks.devices.discovery import EMULATION_MEANS, Inventory, discover
from gpu_tasks.devices.fair_share import ACCRUE_S
from gpu_tasks.devices.measure import Sampler
from gpu_tasks.policy import bound_at_most
from gpu_tasks.prefect_api.api import require_flow_api_url, sync_client, worker_env
from gpu_tasks.prefect_api.states import api_unreachable, no_client_retries
from gpu_tasks.prefect_api.tag_answers import limited_names, start_renewing
from gpu_tasks.prefect_api.tag_slots import SlotGate
from gpu_tasks.profiles import ResourceProfile
from gpu_tasks.reporting.events import RunRef, emit_cluster_event, emit_right_size, emit_task_event
from gpu_tasks.reporting.ledger import LedgerRow, right_size
from gpu_tasks.reporting.logs import RunLogs
from gpu_tasks.runner.job import Board, Handler, Job, Preempt, ProfileState, Reclaim, Tick
from gpu_tasks.runner.payload import ContextSerializer
from gpu_tasks.settings import get_settings
from gpu_tasks.worker.started import StartedLog

logger = logging.getLogger("gpu_tasks.runner")

PREEMPTION_CHECK_S = 0.5  # how often a runner with preemptible clusters reads the device queue
# the runners entered in this process (a flow run's and its subflows' own): an idle profile of one gives
# its devices back early to a profile of another that waits for them, as within one runner
_ENTERED: weakref.WeakSet[Live] = weakref.WeakSet()


class Live:
    """Everything an entered runner owns; closed as a whole on exit."""

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
        use_no_limits_cache(self.settings.tag_limit_cache_seconds, limited_names)
        start_renewing()
        warn_if_changed()  # once per process: a release that changed a private name gpu-tasks uses
        self.idle_timeout = idle_timeout
        self._inventory: Inventory | None = None
        self.states: dict[str, ProfileState] = {}
        self.ledger: list[LedgerRow] = []
        # every row written so far, also one whose event (and place in ``ledger``) is still to come:
        # a task cut short by its worker's death and reported after that worker's row is counted there
        self._written: list[LedgerRow] = []
        self._written_lock = threading.Lock()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.tasks_end = ("Failed", "")  # see :meth:`close`
        self.executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=4, thread_name_prefix="gpu-tasks-dispatch"
        )
        self.monitor: threading.Thread | None = None
        self._controller: Callable[[ProfileState], Handler] | None = None  # given by start()
        self.gate = SlotGate()  # the tag concurrency slots of GPU tasks
        self.worker_env: dict[str, str] | None = None
        self.context = ContextSerializer()
        self.started = StartedLog()  # the hand-offs that began in local workers
        self.book = DeviceBook(
            reclaim=self._reclaim,
            stop=self.stop,
            lease_dir=self.settings.lease_dir,
            lease_timeout=self.settings.lease_timeout,
            preemption_grace=self.settings.preemption_grace,
            on_preempting=self._on_preempting,
            priority_aging=self.settings.priority_aging,
            fair_share_half_life=self.settings.fair_share_half_life,
        )
        self.run = RunRef.current()  # the runner outlives the flow run context; remember the run
        # events are sent in the flow run's context, also after Prefect left it: Prefect's events
        # worker adds related resources from the sending context
        self.ctx = contextvars.copy_context()
        self.flow_run_id = self.run.id
        # why the Prefect API could not be reached when an interrupted run closed (then no events)
        self.api_down: str | None = None
        self._cancelled = False  # found Cancelling or Cancelled on the server (:meth:`cancelled`)
        self.sampler = Sampler(self.settings.gpu_sample_seconds)  # measured use
        RunLogs.enter(self.flow_run_id, self.settings.dask_log_level)
        try:
            self.pool = self._warm_pool()
        except BaseException:
            RunLogs.leave(self.flow_run_id)
            raise
        _ENTERED.add(self)

    def _warm_pool(self) -> Any:
        """Start the warm worker processes when a profile's workers can use them: with the first task,
        so they import while earlier stages run (they hold no device)."""
        size = self.settings.warm_workers
        local = [p for p in self.profiles.values() if starts_processes_here(p)]
        if size <= 0 or not local:
            return None
        emulated = self.inventory.emulated if any(p.is_gpu for p in local) else False
        pooled = [p for p in local if uses_warm_pool(p, emulated)]
        if not pooled:
            return None
        capacity = bound_at_most(pooled, self.inventory)
        if capacity <= 0:  # no device to bind one to (no GPU, no emulation): no pool, no line
            return None
        from gpu_tasks.worker.warm import WarmPool

        pool = WarmPool(size, capacity=capacity)
        target = pool.target()
        pool.start_in_background()  # a new fork server's imports hold up no task of this flow
        logger.info("gpu-tasks: %d warm worker process(es) starting (GPU_TASKS_TUNE_WARM_WORKERS)", target)
        return pool

    @property
    def inventory(self) -> Inventory:
        if self._inventory is None:
            t0 = time.monotonic()
            self._inventory = discover(self.settings)
            logger.info(
                "gpu-tasks devices: %s (found in %.2f s)", self._inventory.describe(), time.monotonic() - t0
            )
            if self._inventory.emulated and self._inventory.devices:  # GPU_TASKS_EMULATED_GPUS=0: none
                logger.warning(
                    "gpu-tasks is EMULATING devices (%s): %s", self._inventory.detail, EMULATION_MEANS
                )
        return self._inventory

    def state(self, prof: ResourceProfile) -> ProfileState:
        with self.lock:
            st = self.states.get(prof.name)
            if st is None:
                if self.worker_env is None and prof.uses_processes:
                    RunLogs.dask_imported()  # Dask's INFO chatter stays out
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
                assert self._controller is not None, "Live.start() gives the profiles their controllers"
                st = self.states[prof.name] = ProfileState(cluster, timeout, self._controller)
                self.sampler.watch(cluster)
            return st

    def start(self, controller: Callable[[ProfileState], Handler]) -> None:
        """Profiles' states get their controllers from ``controller``; the monitor starts: ``Tick`` to
        every profile, ``Preempt`` to a preemptible one whose devices a higher-priority waiter is due."""
        self._controller = controller
        if self.monitor is None:
            # in the submitting thread's context: a new thread's empty one would lose the flow run's
            # Prefect settings (an API URL set by `temporary_settings` or a test harness)
            self.monitor = threading.Thread(
                target=contextvars.copy_context().run, args=(self._watch,), name="gpu-tasks-idle", daemon=True
            )
            self.monitor.start()

    def _watch(self) -> None:
        next_preemption_check = 0.0
        next_accrual = time.monotonic() + ACCRUE_S
        while not self.stop.wait(self._interval()):
            if time.monotonic() >= next_accrual:  # the teams' use of devices still held (fair share)
                next_accrual = time.monotonic() + ACCRUE_S
                self.book.accrue()
            if time.monotonic() >= next_preemption_check:
                next_preemption_check = time.monotonic() + PREEMPTION_CHECK_S
                try:
                    self._check_preemption()
                except Exception:  # the idle monitor must go on
                    logger.warning("gpu-tasks: preemption check failed", exc_info=True)
            for st in list(self.states.values()):
                if st.cluster.running:
                    st.post(Tick())

    def _check_preemption(self) -> None:
        """Ask preemptible profiles to stop the workers a higher-priority waiter waited too long for."""
        preemptible = {
            name for name, st in list(self.states.items()) if st.profile.preemptible and st.cluster.running
        }
        if not preemptible:
            return
        # borrowed devices go back to a team owed them first (gpu_tasks.devices.lending), then priority
        due = lending.reclaim_due(self.book, preemptible) or self.book.preemption_due(preemptible)
        if due is None:
            return
        waiter, addresses = due
        for name in sorted({o for a in addresses if (o := self.book.holders.get(a)) in preemptible}):
            mine = [a for a in addresses if self.book.holders.get(a) == name]
            self.states[name].post(Preempt(mine, waiter))

    def _on_preempting(self, owner: str, holders: list[dict[str, Any]]) -> None:
        """Profile ``owner`` waited past its grace; ``holders`` give devices back (the waiter's event)."""
        st = self.states.get(owner)
        if st is None:
            return
        devices = [h["address"] for h in holders]
        keep = ("address", "profile", "priority", "flow_run_name", "flow_run_id", "pid")
        described = [{k: h.get(k) for k in keep} for h in holders]
        payload = {"priority": st.cluster.priority, "devices": devices, "holders": described}
        self.emit("preempting", st.cluster, payload, devices)

    def _on_board(self, name: str, what: str, info: dict[str, Any]) -> None:
        """An address profile's preemption on its shared scheduler (gpu_tasks.cluster.board)."""
        st = self.states.get(name)
        if st is not None:  # told before the profile's state was kept: nothing to count it on yet
            st.post(Board(what, info))

    def _reclaim(self, wanted: set[str], by: str, growing: bool) -> None:
        """Profile ``by`` waits for ``wanted`` (``growing``: it runs, and could use more workers): ask
        idle profiles holding some to give them back early, this runner's and those of the other runners
        entered in this process (a subflow's waits for its parent's, blocked in the subflow's call)."""
        wanted_now = frozenset(wanted)
        for live in (self, *(o for o in list(_ENTERED) if o is not self and not o.stop.is_set())):
            who = f"profile {by!r}" + ("" if live is self else f" of flow run {self.run.name!r}")
            for name, st in list(live.states.items()):
                if (live is not self or name != by) and wanted.intersection(st.cluster.devices):
                    st.post(Reclaim(wanted_now, who, growing))

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
        self.written(row)
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
                **({"interrupted": row.interrupted} if row.interrupted else {}),  # tasks that did not finish
                **(extra or {}),
            },
            devices,
        )

    def written(self, row: LedgerRow) -> None:
        """``row`` was written (:meth:`gave_back` books it, maybe later and on another thread): the
        tasks that ran there and are reported cut short after it count on it (:meth:`count_interrupted`)."""
        with self._written_lock:
            if not any(r is row for r in self._written):
                self._written.append(row)

    def priorities(self) -> dict[str, int]:
        """The priority each profile that queues for this host's devices waited at (by name)."""
        return {
            name: st.cluster.queue_priority
            for name, st in self.states.items()
            if st.cluster.queue_priority is not None
        }

    def emit(self, what: str, cluster: ProfileCluster, payload: dict[str, Any], devices: Any = None) -> None:
        """A ``gpu-tasks.cluster.<what>`` event related to this flow run."""
        self._send(emit_cluster_event, what, cluster, self.run, payload, devices)

    def emit_task(self, what: str, job: Job, payload: dict[str, Any]) -> None:
        """A ``gpu-tasks.task.<what>`` event about ``job``'s task run."""
        name = getattr(job.task_run, "name", None)
        self._send(
            emit_task_event, what, job.task_run_id, job.task.name, job.profile.name, self.run, payload, name
        )

    def _send(self, emit: Callable[..., Any], *args: Any) -> None:
        """An event in the flow run's context, unless the API was found down (it would hold up the exit)."""
        if self.api_down is None:
            self.in_run_context(emit, *args)

    def api_answers(self) -> bool:
        """Whether the Prefect API answered when this run closed and still does (probed once more)."""
        if self.api_down is None:
            self.api_down = api_unreachable()
        return self.api_down is None

    def cancelled(self) -> bool:
        """Whether this flow run is being cancelled (``Cancelling`` or ``Cancelled`` on its server): a
        Prefect worker's cancel stops the flow process, and its process group, with a SIGTERM, as other
        stops do. One request without retries; a run found cancelled stays so."""
        if not self._cancelled and self.api_down is None and self.flow_run_id is not None:
            self._cancelled = bool(self.in_run_context(_being_cancelled, self.flow_run_id))
        return self._cancelled

    @property
    def ending(self) -> bool:
        """Whether the runner stops, or its flow run is known to be cancelled: no device changes hands."""
        return self.stop.is_set() or self._cancelled

    def in_run_context(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in the flow run's context as it was when the runner started (any thread)."""
        return self.ctx.copy().run(fn, *args)

    def close(self, reason: str, hurry: bool = False, tasks_end: str = "Failed") -> None:
        """Close every profile; ``tasks_end``: the state of a task run that had not run by then
        (``Cancelled`` when the flow run is cancelled, ``Crashed`` when it is interrupted)."""
        _ENTERED.discard(self)
        try:
            self.tasks_end = (tasks_end, reason)  # before the stop: a dispatch that sees it reads this
            self.stop.set()
            if hurry:  # a plain script's ephemeral server dies with the Ctrl-C that stopped its flow
                self.api_down = api_unreachable()
            if self.monitor is not None:
                self.monitor.join(timeout=5)
            self.sampler.close()
            self.executor.shutdown(wait=False, cancel_futures=True)
            states = list(self.states.values())
            for st in states:  # each controller handles what is queued (a dispatch fails) and stops
                st.close()
            # from here on this thread is the only one that touches the clusters; on an interrupt the
            # flow process's own threads (CPU profiles) finish after the devices are given back, not
            # before: a running CPU task held every GPU profile's devices until it ended (a new-user
            # pass: 58 device-s for a 60 s CPU task)
            states.sort(key=lambda st: not st.profile.uses_processes)
            for st in states:
                st.cluster.drain(wait=not hurry)
            # results already fetched or queued reach their tasks before the clusters go (a task that
            # finished is never reported Crashed for the close); later ones are fetched one by one
            self._close_results(2.0 if hurry else 10.0)
            running = [j for st in states for j in st.inflight.values()]
            self._count_running(running)  # (a task in recovery was counted when its worker died)
            running += [j for j in self._await_recovery(states, 2.0 if hurry else 10.0) if j not in running]
            for st in states:
                self.close_cluster(st, reason, hurry=hurry)
                try:
                    st.cluster.shutdown()
                except Exception:
                    logger.warning("profile %r: error while shutting down", st.profile.name, exc_info=True)
            if self.pool is not None:
                self.pool.close()
            self.book.close()  # quota leases left (the clusters gave their devices back)
            # after the clusters: a task still running holds its slots until its worker is gone
            self.gate.close(timeout=2.0 if hurry else 10.0)
            self._crash_unfinished(running, reason, hurry)
            self._advise()
        finally:
            self.started.close()
            RunLogs.leave(self.flow_run_id)  # the close's own lines were sent before this

    @staticmethod
    def _await_recovery(states: list[ProfileState], timeout: float) -> list[Job]:
        """Wait up to ``timeout`` s for the crash reports, retries and re-queues under way (a worker that
        died with the flow run's cancel, say) to resolve their tasks; those still unresolved then."""
        deadline = time.monotonic() + timeout
        left = []
        for st in states:
            for job, thread in st.recovering:
                thread.join(max(0.0, deadline - time.monotonic()))
                if not job.cf.done() and job not in left:
                    left.append(job)
        return left

    def _count_running(self, jobs: list[Job]) -> None:
        """Tasks still running as their clusters close count as busy (:meth:`count_interrupted`)."""
        for job in jobs:
            if not job.cf.done() and job.profile.uses_processes and not self._ended_on_worker(job):
                self.count_interrupted(job)  # (in-process ones are drained)

    def _ended_on_worker(self, job: Job) -> bool:
        """Whether ``job``'s local worker reported its final state to Prefect, though its result did
        not reach the flow process before the close (a Crashed after that overwrote a Completed task
        run: a new-user pass, 3 of 3)."""
        return job.profile.uses_processes and not job.st.cluster.shared and self.started.ended(job.key)

    def count_interrupted(self, job: Job) -> None:
        """``job``, cut short now (its worker died, or its cluster closes under it), counts as busy from
        its start and as a task (``interrupted``): the ledger would otherwise call its devices idle (a
        false waste alert). A local worker noted when each hand-off began and on which devices
        (gpu_tasks.worker.started); a shared scheduler's workers note nothing here.

        It counts on the row of the worker it ran on: the cluster's present life when that worker is
        still held, else the row written when the worker was retired or the cluster closed (the crash
        reports of a dead worker's tasks come one by one, the later ones after that row, maybe after a
        replacement started), never a later life's row."""
        cluster = job.st.cluster
        began = None if cluster.shared else self.started.since(job.key)
        if began is None:
            return
        start, worker = began
        end = max(start, time.time())
        if cluster.usage.holds(worker, start):
            cluster.record(worker, start, end, interrupted=True)
            return
        with self._written_lock:
            for row in reversed(self._written):
                if row.profile == job.profile.name and row.count_interrupted(worker, start, end):
                    return
        logger.debug(
            "profile %r: no ledger row held %s when task %s began", job.profile.name, worker, job.key
        )

    def _advise(self) -> None:
        """A right-size line and event per GPU profile that used much less than it held."""
        for profile, line, measured in right_size(self.ledger):
            logger.info("gpu-tasks: %s", line)
            if measured is not None:
                self._send(emit_right_size, profile, line, measured, self.run)

    def _crash_unfinished(self, jobs: list[Job], reason: str, hurry: bool) -> None:
        """Report task runs still running at the close ``Crashed``, or ``Cancelled`` with a cancelled flow
        run (API gone: set here, named in one line)."""
        from prefect.states import Cancelled, Crashed

        from gpu_tasks.prefect_api.states import crash_task_run

        unfinished = [
            j
            for j in jobs
            if not (j.cf.done() and not j.cf.cancelled() and j.cf.exception() is None)
            and not self._ended_on_worker(j)
        ]
        down = (self.api_down or api_unreachable()) if unfinished else None
        cancelled = self._cancelled  # a cancel (asked of the server as the runner stopped)
        unreported: list[Job] = []
        why = reason.removeprefix("flow run ")  # "the flow run stopped (cancelled)", not "(flow run ...)"
        for i, job in enumerate(unfinished):  # the others finished while the clusters closed
            prof, cluster = job.profile, job.st.cluster
            # a local worker notes each hand-off as it begins (gpu_tasks.worker.started); a shared
            # cluster's close says which it found running
            stopped = cluster.stopped_running
            began = (
                (stopped is None or job.key in stopped)
                if cluster.shared
                else not prof.uses_processes or self.started.began(job.key)
            )
            message = (
                f"the flow run stopped ({why}) while this task ran on profile {prof.name!r}; "
                f"{cluster.stopped_note}"
                if began
                else f"the flow run stopped ({why}) before this task started on profile {prof.name!r}"
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
                        cancelled=cancelled,
                        ran=began,
                    )
                logger.warning("task run %s of profile %r: %s", job.task_run_id, prof.name, message)
            else:
                unreported.append(job)
                state = (Cancelled if cancelled else Crashed)(message=message)
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
                "to keep the records, start a server (`prefect server start`, then PREFECT_API_URL)",
                down,
                len(unreported),
                reason,
                ids,
                ", ..." if len(unreported) > 5 else "",
            )


def _being_cancelled(flow_run_id: Any, timeout: float = 5.0) -> bool:
    """Whether the server has flow run ``flow_run_id`` ``Cancelling`` or ``Cancelled`` (``False`` when
    it cannot tell within ``timeout``)."""
    from prefect.client.schemas.objects import StateType

    try:
        with no_client_retries(), sync_client(timeout) as client:
            state = client.read_flow_run(flow_run_id).state
    except Exception:
        return False
    return state is not None and state.type in (StateType.CANCELLING, StateType.CANCELLED)
