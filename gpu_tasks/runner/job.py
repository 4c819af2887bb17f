"""One profile's state and inbox (:class:`ProfileState`), the events its controller receives, and one
submitted task from submit to its final state (:class:`Job`)."""

from __future__ import annotations

import collections
import concurrent.futures
import contextvars
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from prefect.futures import PrefectFuture

from gpu_tasks.cluster.local import ProfileCluster
from gpu_tasks.policy import IdleView
from gpu_tasks.prefect_api.futures import futures_to_states
from gpu_tasks.profiles import ResourceProfile
from gpu_tasks.profiles.tags import is_profile_tag
from gpu_tasks.reporting.logs import flow_logger

logger = logging.getLogger("gpu_tasks.runner")


class LostWorker(NamedTuple):
    """A profile's worker that died or was lost, as its crash reports name it."""

    name: str
    devices: tuple[str, ...]
    ended: Any  # its gpu_tasks.worker.exits.WorkerExit (how it ended), if known
    worker_address: Any  # its Dask address, if known


NO_WORKER = LostWorker("", (), None, None)


class Arrived(NamedTuple):
    """A task of the profile was submitted, or moved here (``on_oom``)."""


class Dispatch(NamedTuple):
    """``job`` is admitted (upstream done, tag slots held): provision, then hand it to the cluster."""

    job: Job


class Left(NamedTuple):
    """``job`` ended (its future is resolved): no longer on the cluster, if it was."""

    job: Job


class Counted(NamedTuple):
    """A task began (+1) or ended (-1) waiting for tag slots; a cached result was read."""

    waiting_for_slots: int = 0
    cache_hits: int = 0


class WorkerDied(NamedTuple):
    """The worker running ``job`` died (or was lost with its cluster): ``exc`` says how."""

    job: Job
    exc: BaseException


class OutOfMemory(NamedTuple):
    """``job`` failed out of GPU memory: it runs once more on its profile's ``on_oom`` profile."""

    job: Job
    why: str


class Requeue(NamedTuple):
    """``job`` was interrupted on a shared scheduler for a waiter: it is reported and queued again."""

    job: Job
    reason: str
    by: dict[str, Any]


class Preempt(NamedTuple):
    """A higher-priority waiter is due the devices at ``addresses``: stop the workers on them."""

    addresses: list[str]
    waiter: dict[str, Any]


class Board(NamedTuple):
    """The profile's shared scheduler preempted for it (``preempting``) or interrupted its tasks."""

    what: str
    info: dict[str, Any]


class Tick(NamedTuple):
    """The idle monitor's beat: retire lost workers, close the cluster when idle."""


class Reclaim(NamedTuple):
    """A profile waits for devices among ``wanted``: give them back now if idle (``by``: that profile,
    in words: ``profile 'p'``, or ``profile 'p' of flow run 'x'`` for another runner's)."""

    wanted: frozenset[str]
    by: str
    growing: bool = False  # ``by`` runs and could use more workers: only a profile idle a while gives back


Event = (
    Arrived
    | Dispatch
    | Left
    | Counted
    | WorkerDied
    | OutOfMemory
    | Requeue
    | Preempt
    | Board
    | Tick
    | Reclaim
)
COALESCED = (Tick, Reclaim, Preempt)  # one queued is enough (the monitor and waiters post them often)
Handler = Callable[[Event, bool], None]  # a controller: one event, and whether others are queued behind it


class ProfileState:
    """One profile's state in an entered runner, and its controller's inbox. Every field is written by
    the controller thread alone; other threads read them and :meth:`post`, which never waits."""

    def __init__(
        self, cluster: ProfileCluster, idle_timeout: float, controller: Callable[[ProfileState], Handler]
    ) -> None:
        self.cluster = cluster
        self.idle_timeout = idle_timeout
        self.outstanding = 0  # submitted and not finished (waiting on upstream or slots, queued, running)
        self.waiting_for_slots = 0  # waiting for tag slots now: no device held, no hold on idling out
        self.cache_hits = 0  # tasks whose result Prefect had cached: run in the flow process, no device
        self.idle_since: float | None = None
        self.ever_provisioned = False
        self.inflight: dict[uuid.UUID, Job] = {}  # handed to the cluster, no final state yet
        # when its cluster last failed to start, and why: a shared cluster's earlier tasks fail with it
        self.start_failed: tuple[float, Exception] | None = None
        # hand-offs not yet sent to the cluster: sent as one graph when the inbox is empty
        self.outbox: list[tuple[Job, int, tuple[Any, ...]]] = []
        # the last worker found dead or lost: the crash reports of the tasks lost with it name it
        self.last_lost: LostWorker | None = None
        # tasks handed to gpu_tasks.runner.recovery (out of inflight), on threads of their own: the
        # runner's close waits for them a moment, then reports those still unresolved
        self.recovering: list[tuple[Job, threading.Thread]] = []
        self._inbox: collections.deque[Event] = collections.deque()
        self._queued: set[type] = set()  # coalesced kinds in the inbox now
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self.closing = False
        self._ctx = contextvars.copy_context()  # the flow run's, as when the profile's first task came
        self._handle = controller(self)

    @property
    def profile(self) -> ResourceProfile:
        return self.cluster.profile

    def post(self, event: Event) -> bool:
        """Queue ``event`` for the controller (never waits); ``False`` once the profile is closed."""
        with self._cv:
            if self.closing:
                return False
            kind = type(event)
            if kind in COALESCED:
                if kind in self._queued:
                    return True
                self._queued.add(kind)
            self._inbox.append(event)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._ctx.copy().run,
                    args=(self._run,),
                    name=f"gpu-tasks-{self.profile.name}",
                    daemon=True,
                )
                self._thread.start()
            self._cv.notify()
        return True

    def queued_jobs(self) -> list[Job]:
        """The jobs whose dispatch waits in the inbox now (behind the event being handled)."""
        with self._cv:
            return [e.job for e in self._inbox if isinstance(e, Dispatch)]

    def close(self) -> None:
        """Take no more events; wait until the controller handled those queued."""
        with self._cv:
            self.closing = True
            self._cv.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._inbox and not self.closing:
                    self._cv.wait()
                if not self._inbox:
                    return
                event = self._inbox.popleft()
                self._queued.discard(type(event))
                more = bool(self._inbox)
            try:
                self._handle(event, more)
            except BaseException:  # the controller resolves its own futures; it never stops early
                logger.warning(
                    "gpu-tasks: profile %r could not handle %s",
                    self.profile.name,
                    type(event).__name__,
                    exc_info=True,
                )

    def active_changed(self) -> None:
        """Idle from the moment nothing but slot waits is outstanding."""
        if self.outstanding - self.waiting_for_slots > 0:
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = time.monotonic()

    @property
    def dispatched(self) -> int:
        """Tasks handed to the cluster, without a final state yet."""
        return len(self.inflight)

    def idle_view(self) -> IdleView:
        """What the idle policy needs to decide (a task waiting for tag slots is not work)."""
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
    def free_runs(self) -> int:
        """Its runs that used no retry: preempted, or moved to its ``on_oom`` profile."""
        return self.preemptions + (self.escalated_from is not None)

    @property
    def tags(self) -> set[str]:
        """Its task run's tags as Prefect's engine makes them: the task's, and :func:`run_tags` of the
        blocks around its submit (a state reported before its engine ran carries them too)."""
        from prefect.context import TagsContext

        around = self.ctx.copy().run(TagsContext.get)  # a copy: the job's own may be entered elsewhere
        return set(self.task.tags) | run_tags(around.current_tags if around else (), self.extra_tags)

    def tags_context(self) -> Any:
        """Prefect's tags context its task run is made in (:func:`run_tags`); entered in the job's
        context (:attr:`ctx`), whose blocks it reads."""
        from prefect.context import TagsContext

        around = TagsContext.get()
        return TagsContext(current_tags=run_tags(around.current_tags if around else (), self.extra_tags))

    def hand_off(self, name: str) -> str:
        """A new hand-off of task ``name`` to its cluster: the next attempt, and its Dask key."""
        self.attempt += 1
        self.key = f"{name}-{self.task_run_id.hex}-{self.attempt}"
        return self.key

    def slot_wait(self) -> float:
        """Seconds it waited for tag slots, once: a re-run reports none."""
        waited, self.slot_waited = self.slot_waited, 0.0
        return waited

    def dispatch(self) -> None:
        """Ask its profile's controller to run it; once the runner closes, fail its future instead."""
        if not self.st.post(Dispatch(self)) and not self.cf.done():
            self.cf.set_exception(RuntimeError("the task runner is shutting down"))

    def engine_kwargs(self) -> dict[str, Any]:
        """Prefect's engine's keyword arguments for this task run (its upstream futures are done)."""
        return dict(
            task_run_id=self.task_run_id,
            parameters=futures_to_states(self.parameters),
            wait_for=futures_to_states(list(self.wait_for)) if self.wait_for else None,
            dependencies=self.dependencies,
            return_type="state",
        )

    def say(self, level: int, msg: str, *args: Any) -> None:
        """A line in the flow run's logs (from any thread: the job's context finds the logger)."""
        self.ctx.copy().run(lambda: flow_logger().log(level, msg, *args))

    def off_thread(self, fn: Callable[..., Any], *args: Any, name: str) -> threading.Thread:
        """``fn(*args)`` in the job's context on a thread of its own (started)."""
        thread = threading.Thread(target=self.ctx.copy().run, args=(fn, *args), name=name, daemon=True)
        thread.start()
        return thread


def run_tags(around: Iterable[str], extra: Iterable[str]) -> set[str]:
    """A task run's tags from the blocks around its submit: those, less the profile tags of other
    profiles (a task submitted by a task body sits inside its parent's profile tag, whose Prefect tag
    limits it must not take: parent and child then waited for one slot), plus the runner's ``extra``
    (its own profile's)."""
    extra = set(extra)
    return {t for t in around if not is_profile_tag(t) or t in extra} | extra
