"""One profile's book-keeping in an entered runner (:class:`ProfileState`) and one submitted task
from submit to its final state (:class:`Job`): each field of a task's state has one writer, the
job's own methods or the one step of its path named beside the field."""

from __future__ import annotations

import concurrent.futures
import contextvars
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from prefect.futures import PrefectFuture

from gpu_tasks.cluster.local import ProfileCluster
from gpu_tasks.policy import IdleView
from gpu_tasks.profiles import ResourceProfile
from gpu_tasks.reporting.logs import flow_logger


class LostWorker(NamedTuple):
    """A profile's worker that died or was lost, as its crash reports name it."""

    name: str
    devices: tuple[str, ...]
    ended: Any  # its gpu_tasks.worker.exits.WorkerExit (how it ended), if known
    address: Any  # its Dask address, if known


NO_WORKER = LostWorker("", (), None, None)


class ProfileState:
    """Book-keeping for one profile within one entered runner.

    ``outstanding`` counts tasks submitted and not finished (waiting on upstream or for
    Prefect tag slots, queued or running); ``dispatched`` those handed to the cluster;
    ``waiting_for_slots`` those waiting for tag slots now, which hold no device and do not
    keep a cluster from idling out. They change only through the methods below (and
    :meth:`gpu_tasks.runner.session.Live.running` / ``landed`` for ``dispatched``), under
    ``counts_lock``, a lock no one holds while waiting. ``lock`` is the cluster's: held while its
    workers start, grow, close or retire, devices awaited included. A submit, a finish or a landed
    result never takes it, so none waits for a device or a cluster start (an arrival during an idle
    close is dispatched after it and provisions again).
    """

    def __init__(self, cluster: ProfileCluster, idle_timeout: float):
        self.cluster = cluster
        self.idle_timeout = idle_timeout
        self.lock = threading.RLock()
        self.counts_lock = threading.Lock()
        self.outstanding = 0
        self.dispatched = 0
        self.waiting_for_slots = 0
        self.cache_hits = 0  # tasks whose result Prefect had cached: run in the flow process, no device
        self.idle_since: float | None = None
        self.ever_provisioned = False
        # when its cluster last failed to start, and why: a remote profile's tasks submitted before
        # then fail with it at once instead of trying again (gpu_tasks.runner.dispatch)
        self.start_failed: tuple[float, Exception] | None = None
        # GPU profiles dispatch on a thread of their own: waiting for devices another
        # profile holds must block neither the flow nor other profiles' dispatch.
        self.dispatcher: concurrent.futures.ThreadPoolExecutor | None = (
            concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"gpu-tasks-{cluster.profile.name}"
            )
            if cluster.profile.is_gpu
            else None
        )
        # hand-offs made on that thread and not yet sent to the cluster, and dispatches queued for
        # it: the thread sends its hand-offs as one batch when none is left (gpu_tasks.runner.dispatch)
        self.outbox: list[tuple[Job, int, tuple[Any, ...]]] = []
        self.queued = 0  # under counts_lock

    def arrive(self) -> None:
        """A task of this profile was submitted (or moved here)."""
        with self.counts_lock:
            self.outstanding += 1
            self._active_changed()

    def leave(self, dispatched: bool = False) -> None:
        """A task of this profile finished (or moved away).

        Args:
            dispatched: it had been handed to the cluster.
        """
        with self.counts_lock:
            self.outstanding -= 1
            if dispatched:
                self.dispatched -= 1
            self._active_changed()

    def count(self, waiting_for_slots: int = 0, cache_hits: int = 0) -> None:
        """A task began (+1) or ended (-1) waiting for tag slots; a task's result came from the cache."""
        with self.counts_lock:
            self.waiting_for_slots += waiting_for_slots
            self.cache_hits += cache_hits
            self._active_changed()

    def _active_changed(self) -> None:
        # idle from the moment nothing but slot waits is outstanding (call under counts_lock)
        if self.outstanding - self.waiting_for_slots > 0:
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = time.monotonic()

    def idle_view(self) -> IdleView:
        """What the idle policy needs to decide (a task waiting for tag slots is not work)."""
        with self.counts_lock:
            active = self.outstanding - self.waiting_for_slots
            return IdleView(self.cluster.running, active, self.idle_since, self.idle_timeout)


@dataclass(eq=False)
class Job:
    """One submitted task, from submit to its final state (a crash re-run keeps its job)."""

    st: ProfileState
    task: Any
    task_run_id: uuid.UUID
    parameters: dict[str, Any]
    wait_for: Iterable[PrefectFuture[Any]] | None
    dependencies: dict[str, set[Any]] | None
    extra_tags: list[str]
    cf: concurrent.futures.Future[Any]
    ctx: contextvars.Context
    crashes: int = 0  # times its worker died under it
    task_run: Any = None  # the task run a re-run continues (run count, name)
    escalated_from: str | None = None  # the profile it ran out of memory on (on_oom re-runs once)
    # tag concurrency limits the flow process holds a slot of for it, or knows do not exist: its
    # worker's engine does not take them again (gpu_tasks.prefect_api.tag_slots)
    slot_names: tuple[str, ...] = ()
    hold: Any = None  # its gpu_tasks.prefect_api.tag_slots.Hold: the slots, from the wait until the task ends
    slot_waited: float = 0.0  # seconds it waited for its slots (holding no device), for the ledger
    attempt: int = 0  # its hand-offs to a cluster (hand_off); a preempted one's late outcome is ignored
    key: str = ""  # the Dask key of its current hand-off
    preemptions: int = 0  # times it was stopped for a higher-priority waiter (no retry used)
    quota_lease: Any = None  # an address profile's quota slots while its task is handed off
    submitted_at: float = field(default_factory=time.monotonic)

    @property
    def profile(self) -> ResourceProfile:
        return self.st.cluster.profile

    @property
    def tags(self) -> set[str]:
        return set(self.task.tags) | set(self.extra_tags)

    def hand_off(self, name: str) -> str:
        """A new hand-off of task ``name`` to its cluster: the next attempt, and its Dask key."""
        self.attempt += 1
        self.key = f"{name}-{self.task_run_id.hex}-{self.attempt}"
        return self.key

    def continues(self, task_run: Any) -> None:
        """Its next run continues ``task_run`` (a crash retry, an escalation, a preemption, a lost cache)."""
        self.task_run = task_run

    def slots_held(self, waited: float) -> None:
        """Its tag slots were granted after ``waited`` s (reported once, by :meth:`slot_wait`)."""
        self.slot_waited = waited

    def slot_wait(self) -> float:
        """Seconds it waited for tag slots, once: a re-run reports none."""
        waited, self.slot_waited = self.slot_waited, 0.0
        return waited

    def disown(self) -> None:
        """What its current hand-off reports is not its outcome (it was preempted and runs again)."""
        self.attempt += 1

    def say(self, level: int, msg: str, *args: Any) -> None:
        """A line in the flow run's logs (from any thread: the logger is looked up in the job's context)."""
        self.ctx.copy().run(lambda: flow_logger().log(level, msg, *args))

    def off_thread(self, fn: Callable[..., Any], *args: Any, name: str) -> None:
        """``fn(*args)`` in the job's context on a thread of its own (it may wait on the server, devices)."""
        threading.Thread(target=self.ctx.copy().run, args=(fn, *args), name=name, daemon=True).start()
