"""ProfileTaskRunner: a Prefect task runner with one Dask cluster per resource profile.

Data flow of one task: ``submit`` reads the profile tag -> waits (without blocking
the flow) for upstream futures of any profile -> finds or provisions that profile's
cluster -> submits the Prefect task engine to it with the profile's Dask resources
-> pulls the final state back into the flow process when it finishes, so closing an
idle cluster loses nothing.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextvars
import datetime
import logging
import os
import re
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from contextlib import ExitStack
from functools import partial
from typing import Any

from prefect.futures import PrefectConcurrentFuture, PrefectFuture
from prefect.task_runners import TaskRunner
from prefect.utilities.collections import visit_collection

from gpu_tasks import _worker_guard
from gpu_tasks._api import for_workers, require_flow_api_url, worker_env
from gpu_tasks._slots import SlotPool, waiting
from gpu_tasks._tag_limits import extend_no_limits_cache
from gpu_tasks.allocation import WORKER_ENV_PROFILE, Allocation, allocated, current_allocation, worker_allocation
from gpu_tasks.clusters import DeviceBook, LedgerRow, ProfileCluster, worker_key
from gpu_tasks.devices import Inventory, discover
from gpu_tasks.errors import GpuOutOfMemoryError, ProfileError, UnknownProfileError, UnsatisfiableProfileError
from gpu_tasks.policy import IdleView, close_reason, desired_workers, task_resources, unsatisfiable_reason
from gpu_tasks.profiles import ResourceProfile, load_profiles_file, profile, profile_from_tags
from gpu_tasks.settings import get_settings

logger = logging.getLogger(__name__)

DEFAULT_PROFILE = "cpu"
FALLBACK_TAG = "gpu-tasks:fallback"
ESCALATED_TAG = "gpu-tasks:on-oom"


class ProfileFuture(PrefectConcurrentFuture[Any]):
    """A Prefect future for a task run on a profile's cluster.

    It wraps a ``concurrent.futures.Future`` that resolves to the task's final
    Prefect state once that state is back in the flow process.
    """

    def __init__(self, task_run_id: uuid.UUID, wrapped_future: concurrent.futures.Future[Any], profile: str):
        super().__init__(task_run_id=task_run_id, wrapped_future=wrapped_future)
        self.profile = profile

    def _block(self, timeout: float | None) -> float | None:
        """Wait here, leaving this thread's task slot to others meanwhile; the timeout left."""
        if self._wrapped_future.done():
            return timeout
        with waiting():  # a parent task waiting for its child must not hold the child's slot
            concurrent.futures.wait([self._wrapped_future], timeout=timeout)
        return timeout if self._wrapped_future.done() or timeout is None else 0

    def wait(self, timeout: float | None = None) -> None:
        super().wait(self._block(timeout))

    def result(self, timeout: float | None = None, raise_on_failure: bool = True) -> Any:
        return super().result(timeout=self._block(timeout), raise_on_failure=raise_on_failure)


# ---------------------------------------------------------------- worker side
# Built Prefect settings by the key their serialized form was sent with (see _ContextSerializer):
# validating Settings from a dict reads env, .env and toml sources and costs tens of ms per task.
_WORKER_SETTINGS: dict[str, dict[str, Any]] = {}
_WORKER_SETTINGS_LOCK = threading.Lock()
_WORKER_THREAD = threading.local()  # each worker thread's open sync Prefect client, by settings key


def _run_on_worker(
    profile_name: str, fraction: float, task: Any, kwargs: dict[str, Any], settings_key: str
) -> tuple[Any, float, float, str]:
    """Run the Prefect task engine in a worker process (context travels serialized).

    The serialized settings are validated once per worker process and settings key, and
    each worker thread keeps one open sync Prefect client per settings key; the task
    engine finds it through Prefect's ``SyncClientContext`` as it would its own.
    """
    from distributed import get_worker
    from prefect.context import SettingsContext, SyncClientContext

    try:
        address = get_worker().address
    except ValueError:  # pragma: no cover - not on a worker
        address = None
    settings = _worker_settings(settings_key, kwargs["context"]["settings_context"])
    kwargs = {**kwargs, "context": {**kwargs["context"], "settings_context": settings}}
    alloc = worker_allocation(profile_name, fraction, address)
    _worker_guard.on_orphaned(_report_orphaned)  # once per worker process (idempotent)
    flow_run = (kwargs["context"].get("flow_run_context") or {}).get("flow_run") or {}
    running = (task, flow_run.get("id"), alloc, set(task.tags))
    with _RUNNING_LOCK:
        _RUNNING[kwargs["task_run_id"]] = running
    try:
        with SettingsContext(**settings), SyncClientContext.model_construct(client=_thread_client(settings_key)):
            return _run_engine(alloc, task, kwargs)
    finally:
        with _RUNNING_LOCK:
            _RUNNING.pop(kwargs["task_run_id"], None)


# Task runs this worker process is running now, for a crash report if the flow process dies.
_RUNNING: dict[uuid.UUID, tuple[Any, Any, Allocation, set[str]]] = {}
_RUNNING_LOCK = threading.Lock()


def _report_orphaned(flow_pid: int) -> None:
    """The flow process died (SIGKILL, OOM killer): report its running task runs and flow run ``Crashed``.

    Called by the worker guard before this worker exits; bounded to a few seconds.
    """
    from prefect.client.orchestration import get_client
    from prefect.events.worker import EventsWorker
    from prefect.states import Crashed

    from gpu_tasks._crash import crash_task_run

    with _RUNNING_LOCK:
        running = dict(_RUNNING)
    flow_runs = set()
    for task_run_id, (task, flow_run_id, alloc, tags) in running.items():
        where = f"device(s) {','.join(alloc.devices)}" if alloc.devices else "CPU"
        message = (f"the flow process (pid {flow_pid}) died while this task ran on profile {alloc.profile!r}, "
                   f"{where}; its worker exited with it")
        crash_task_run(task_run_id, task, uuid.UUID(str(flow_run_id)) if flow_run_id else None, message,
                       tags=tags, wait=0.5)
        if flow_run_id:
            flow_runs.add(str(flow_run_id))
    if flow_runs:
        try:
            with get_client(sync_client=True) as client:
                for flow_run_id in flow_runs:
                    client.set_flow_run_state(
                        uuid.UUID(flow_run_id), Crashed(message=(
                            f"the flow process (pid {flow_pid}) died while gpu-tasks workers ran its tasks "
                            "(reported by a worker)")), force=True,
                    )
        except Exception:
            logger.warning("could not report the flow run Crashed", exc_info=True)
    EventsWorker.drain_all(timeout=2)


def _worker_settings(key: str, serialized: dict[str, Any]) -> dict[str, Any]:
    """``SettingsContext`` fields (built profile and settings) for serialized settings sent under ``key``."""
    from prefect.context import SettingsContext

    with _WORKER_SETTINGS_LOCK:
        built = _WORKER_SETTINGS.get(key)
    if built is None:
        extend_no_limits_cache(get_settings().tag_limit_cache_seconds)  # once per worker and settings
        ctx = SettingsContext(**serialized)  # pydantic does not revalidate these instances later
        built = {"profile": ctx.profile, "settings": ctx.settings}
        with _WORKER_SETTINGS_LOCK:
            if len(_WORKER_SETTINGS) >= 8:  # one key per flow run's settings: keep a few
                _WORKER_SETTINGS.clear()
            _WORKER_SETTINGS[key] = built
    return built


def _thread_client(key: str) -> Any:
    """This thread's started sync Prefect client for the settings under ``key`` (active now)."""
    from prefect.client.orchestration import get_client
    from prefect.context import SettingsContext

    cached = getattr(_WORKER_THREAD, "client", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    if cached is not None:
        try:
            cached[1].__exit__(None, None, None)
        except Exception:  # pragma: no cover - closing a stale client is best effort
            logger.debug("could not close a worker's Prefect client", exc_info=True)
    client = get_client(sync_client=True).__enter__()  # left open: later tasks re-enter it
    settings = SettingsContext.get()
    if settings is None or settings.settings.client.server_version_check_enabled:
        client.raise_for_api_version_mismatch_once()
    _WORKER_THREAD.client = (key, client)
    return client


def _run_engine(alloc: Allocation, task: Any, kwargs: dict[str, Any]) -> tuple[Any, float, float, str]:
    from prefect.task_engine import run_task_async, run_task_sync

    placement = alloc.placement_tags()
    if placement and not placement <= set(task.tags):
        # the task run shows where it ran in the Prefect UI: gpu:<id> per device, emulated or not
        task = task.with_options(tags=set(task.tags) | placement)
    if alloc.profile:
        task = _oom_translated(task, alloc)
    start = time.time()
    try:
        with allocated(alloc):
            if task.isasync:
                state = asyncio.run(run_task_async(task=task, **kwargs))
            else:
                state = run_task_sync(task=task, **kwargs)
    except Exception:
        raise
    except BaseException as exc:
        # KeyboardInterrupt, SystemExit and the like raised by the task itself: Prefect's engine
        # has reported the run Crashed and re-raises; raised further it would abort the flow
        # process (in-process profiles) or kill the Dask worker (which Dask then re-runs).
        state = _crashed_by(exc, kwargs.get("task_run_id"))
    return state, start, time.time(), worker_key(alloc.devices)


def _oom_translated(task: Any, alloc: Allocation) -> Any:
    """``task`` whose out-of-memory errors (CUDA, RMM, cuDF, MemoryError) name its profile and devices."""
    import copy
    import functools

    from gpu_tasks._crash import looks_like_oom

    fn = task.fn
    if getattr(fn, "__gpu_tasks_oom__", False):
        return task

    def translated(exc: Exception) -> Exception:
        if not looks_like_oom(exc) or isinstance(exc, GpuOutOfMemoryError):
            return exc
        where = f"device(s) {','.join(alloc.devices)}" if alloc.devices else "CPU"
        if alloc.devices and alloc.emulated:
            where += " (emulated)"
        error = GpuOutOfMemoryError(
            f"out of memory on profile {alloc.profile!r}, {where}: {type(exc).__name__}: {exc}. Lower the task's "
            "memory use, or give the profile on_oom='<a larger profile>' to re-run it there once"
        )
        error.__cause__ = exc
        return error

    if asyncio.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def wrapped(*args: Any, **kwargs: Any) -> Any:
            try:
                return await fn(*args, **kwargs)
            except Exception as exc:
                raise translated(exc)  # noqa: B904 (the cause is set, or exc is re-raised as is)
    else:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                raise translated(exc)  # noqa: B904 (the cause is set, or exc is re-raised as is)

    wrapped.__gpu_tasks_oom__ = True  # type: ignore[attr-defined]
    out = copy.copy(task)
    out.fn = wrapped
    return out


def _crashed_by(exc: BaseException, task_run_id: uuid.UUID | None) -> Any:
    from prefect.states import Crashed

    words = {
        KeyboardInterrupt: "Execution was aborted by an interrupt signal.",
        SystemExit: "Execution was aborted by Python system exit call.",
    }
    message = next((m for cls, m in words.items() if isinstance(exc, cls)), None)
    state = Crashed(message=message or f"Execution was interrupted by {type(exc).__name__}: {exc}")
    state.state_details.task_run_id = task_run_id
    return state


# Nested tasks submitted by a task running in a worker process run in that process, on the
# parent's allocation, in a slot pool sized like the worker (see ProfileTaskRunner._submit_nested).
_NESTED_POOLS: dict[str, SlotPool] = {}
_NESTED_LOCK = threading.Lock()


def _nested_pool(profile_name: str) -> SlotPool:
    with _NESTED_LOCK:
        pool = _NESTED_POOLS.get(profile_name)
        if pool is None:
            try:
                from distributed import get_worker

                slots = int(get_worker().state.nthreads)
            except Exception:
                slots = 1
            pool = _NESTED_POOLS[profile_name] = SlotPool(max(1, slots), name=f"gpu-tasks-nested-{profile_name}")
        return pool


# ---------------------------------------------------------------- live state
class _ProfileState:
    """Book-keeping for one profile within one entered runner."""

    def __init__(self, cluster: ProfileCluster, idle_timeout: float):
        self.cluster = cluster
        self.idle_timeout = idle_timeout
        self.lock = threading.RLock()
        self.outstanding = 0  # submitted, not finished (waiting on upstream, queued or running)
        self.dispatched = 0  # handed to the cluster, not finished
        self.idle_since: float | None = None
        self.ever_provisioned = False
        # GPU profiles dispatch on a thread of their own: waiting for devices another
        # profile holds must block neither the flow nor other profiles' dispatch.
        self.dispatcher: concurrent.futures.ThreadPoolExecutor | None = (
            concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"gpu-tasks-{cluster.profile.name}")
            if cluster.profile.is_gpu else None
        )


class _Live:
    """Everything an entered runner owns; closed as a whole on exit."""

    def __init__(self, runner: ProfileTaskRunner):
        self.profiles, self.default = runner.resolve_profiles()
        self.settings = get_settings()
        extend_no_limits_cache(self.settings.tag_limit_cache_seconds)
        self.idle_timeout = runner.idle_timeout
        self._inventory: Inventory | None = None
        self.states: dict[str, _ProfileState] = {}
        self.ledger: list[LedgerRow] = []
        self.inflight: dict[uuid.UUID, _Job] = {}  # handed to a cluster, no final state yet
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="gpu-tasks-dispatch")
        self.monitor: threading.Thread | None = None
        self.worker_env: dict[str, str] | None = None
        self.context = _ContextSerializer()
        self.book = DeviceBook(
            reclaim=self._reclaim, stop=self.stop,
            lease_dir=self.settings.lease_dir, lease_timeout=self.settings.lease_timeout,
        )
        from prefect.context import FlowRunContext

        ctx = FlowRunContext.get()  # the runner outlives the flow run context; remember the run
        self.flow_run_id = ctx.flow_run.id if ctx is not None and ctx.flow_run is not None else None

    @property
    def inventory(self) -> Inventory:
        if self._inventory is None:
            self._inventory = discover(self.settings)
            logger.info("gpu-tasks devices: %s", self._inventory.describe())
            if self._inventory.emulated:
                logger.warning(
                    "gpu-tasks is EMULATING devices (%s): tasks get CUDA_VISIBLE_DEVICES and Dask GPU "
                    "resources as on real hardware, but compute runs on the CPU",
                    self._inventory.detail,
                )
        return self._inventory

    def state(self, prof: ResourceProfile) -> _ProfileState:
        with self.lock:
            st = self.states.get(prof.name)
            if st is None:
                if self.worker_env is None and prof.uses_processes:
                    api_url = require_flow_api_url(prof.name)
                    self.worker_env = worker_env(api_url)
                    self.context.api_url = api_url
                timeout = prof.idle_timeout if prof.idle_timeout is not None else self.idle_timeout
                cluster = ProfileCluster(
                    prof, self.inventory if prof.is_gpu else Inventory(), self.worker_env or {},
                    self.settings.provision_timeout, dashboard=self.settings.dashboard, book=self.book,
                )
                st = self.states[prof.name] = _ProfileState(cluster, timeout)
                self._start_monitor()
            return st

    def _start_monitor(self) -> None:
        if self.monitor is None:
            # The monitor and the close threads it starts run in the submitting thread's context:
            # a thread starts with an empty one, which would lose the flow run's Prefect settings
            # (an API URL set by `temporary_settings` or a test harness) and send the events of
            # idle closes to a new ephemeral Prefect server started in this process.
            self.monitor = threading.Thread(
                target=contextvars.copy_context().run, args=(self._watch,), name="gpu-tasks-idle", daemon=True
            )
            self.monitor.start()

    def _watch(self) -> None:
        closing: dict[str, threading.Thread] = {}
        while not self.stop.wait(self._interval()):
            for name, st in list(self.states.items()):
                if name in closing and closing[name].is_alive():
                    continue
                if self._idle_reason(st):
                    # close off the monitor thread so one slow close never delays another profile's
                    closing[name] = threading.Thread(
                        target=contextvars.copy_context().run, args=(self._close_if_idle, st),
                        name=f"gpu-tasks-close-{name}", daemon=True,
                    )
                    closing[name].start()
        for thread in closing.values():
            thread.join(timeout=30)

    @staticmethod
    def _idle_reason(st: _ProfileState) -> str | None:
        view = IdleView(st.cluster.running, st.outstanding, st.idle_since, st.idle_timeout)
        return close_reason(view, time.monotonic())

    def _close_if_idle(self, st: _ProfileState) -> None:
        with st.lock:  # re-check under the lock: a task may have arrived meanwhile
            reason = self._idle_reason(st)
            if reason and not self.stop.is_set():
                self._close(st, f"scaled down: {reason}")

    def _reclaim(self, wanted: set[str], by: str) -> None:
        """Close idle clusters that hold devices profile ``by`` waits for (before their timeout)."""
        for name, st in list(self.states.items()):
            if name == by or not wanted.intersection(st.cluster.devices):
                continue
            if not st.lock.acquire(blocking=False):  # busy dispatching; try again next round
                continue
            try:
                if st.cluster.running and st.outstanding == 0:
                    self._close(st, f"released its devices early: profile {by!r} is waiting for them")
            finally:
                st.lock.release()

    def _interval(self) -> float:
        timeouts = [st.idle_timeout for st in self.states.values()] or [1.0]
        return min(0.25, max(0.02, min(timeouts) / 5))

    def _close(self, st: _ProfileState, reason: str, hurry: bool = False) -> None:
        devices = st.cluster.devices
        row = st.cluster.close(reason, hurry=hurry)
        if row is not None:
            self.ledger.append(row)
            self.emit("closed", st.cluster, {
                "reason": reason, "devices": list(devices), "held_s": round(row.held_seconds, 3),
                "busy_s": round(row.busy_seconds, 3), "tasks": row.tasks,
            }, devices)

    def emit_task(self, what: str, job: _Job, payload: dict[str, Any]) -> None:
        """A Prefect event ``gpu-tasks.task.<what>`` about one task run (best effort)."""
        try:
            from prefect.events import emit_event

            related = [{"prefect.resource.id": f"prefect.task-run.{job.task_run_id}", "prefect.resource.role": "task-run"}]
            if self.flow_run_id is not None:
                related.append({"prefect.resource.id": f"prefect.flow-run.{self.flow_run_id}",
                                "prefect.resource.role": "flow-run"})
            emit_event(
                event=f"gpu-tasks.task.{what}",
                resource={"prefect.resource.id": f"gpu-tasks.task.{job.task_run_id}",
                          "prefect.resource.name": job.task.name, "gpu-tasks.profile": job.st.cluster.profile.name},
                related=related, payload=payload,
            )
        except Exception:  # events are for watching; never fail the run over one
            logger.debug("could not emit gpu-tasks.task.%s", what, exc_info=True)

    def emit(self, what: str, cluster: ProfileCluster, payload: dict[str, Any], devices: Any = None) -> None:
        """A Prefect event ``gpu-tasks.cluster.<what>``, related to this flow run (best effort)."""
        try:
            from prefect.events import emit_event

            name = cluster.profile.name
            devices = cluster.devices if devices is None else devices
            related = []
            if self.flow_run_id is not None:
                related.append({"prefect.resource.id": f"prefect.flow-run.{self.flow_run_id}",
                                "prefect.resource.role": "flow-run"})
            emit_event(
                event=f"gpu-tasks.cluster.{what}",
                resource={
                    "prefect.resource.id": f"gpu-tasks.cluster.{self.flow_run_id or 'local'}.{name}",
                    "prefect.resource.name": name,
                    "gpu-tasks.profile": name,
                    "gpu-tasks.devices": ",".join(devices) or "-",
                    "gpu-tasks.emulated": str(bool(cluster.inventory.emulated and cluster.profile.is_gpu)).lower(),
                },
                related=related,
                payload=payload,
            )
            lease_event = {"provisioned": "leased", "scaled": "leased", "closed": "released", "crashed": "released"}.get(what)
            host = socket.gethostname()
            for address in devices if lease_event else ():
                emit_event(
                    event=f"gpu-tasks.device.{lease_event}",
                    resource={
                        "prefect.resource.id": f"gpu-tasks.device.{host}.{address}",
                        "prefect.resource.name": f"gpu:{address}", "gpu-tasks.profile": name,
                    },
                    related=related, payload={"profile": name},
                )
        except Exception:  # events are for watching; never fail the run over one
            logger.debug("could not emit gpu-tasks.cluster.%s", what, exc_info=True)

    def close(self, reason: str, hurry: bool = False) -> None:
        self.stop.set()
        if self.monitor is not None:
            self.monitor.join(timeout=5)
        self.executor.shutdown(wait=False, cancel_futures=True)
        for st in list(self.states.values()):
            if st.dispatcher is not None:
                st.dispatcher.shutdown(wait=False, cancel_futures=True)
            pool = st.cluster.cluster
            if isinstance(pool, concurrent.futures.Executor):
                # Let running in-process tasks finish (as Prefect's thread pool runner does) before
                # taking the profile's lock: their completion callbacks need that lock.
                pool.shutdown(wait=True, cancel_futures=True)
        running = list(self.inflight.values())
        for st in list(self.states.values()):
            with st.lock:
                self._close(st, reason, hurry=hurry)
        self._crash_unfinished(running, reason)

    def _crash_unfinished(self, jobs: list[_Job], reason: str) -> None:
        """Report task runs that were running when their cluster closed ``Crashed`` (never left Running)."""
        from gpu_tasks._crash import crash_task_run

        first = True
        for job in jobs:
            cf = job.cf
            if cf.done() and not cf.cancelled() and cf.exception() is None:
                continue  # it finished while the clusters closed
            prof = job.st.cluster.profile
            message = (f"the flow run stopped ({reason}) while this task ran on profile {prof.name!r}; "
                       "its worker was closed")
            state, _ = crash_task_run(job.task_run_id, job.task, self.flow_run_id, message,
                                      tags=set(job.task.tags) | set(job.extra_tags), wait=1.0 if first else 0.0)
            first = False
            logger.warning("task run %s of profile %r: %s", job.task_run_id, prof.name, message)
            if not cf.done():
                cf.set_result(state)


class _ContextSerializer:
    """Prefect's ``serialize_context``, with the settings serialized once per settings context.

    Dumping the settings is nearly all of ``serialize_context``'s cost, and a flow run's
    settings context does not change between its tasks (``temporary_settings`` enters a
    new one). The rest (flow run, task run, tags, asset and deployment context) is
    serialized for every task as Prefect does.
    """

    def __init__(self) -> None:
        self.api_url: str | None = None  # the flow run's API: workers report there, never to a server of their own
        self._settings: tuple[Any, dict[str, Any], str] | None = None
        self._result_store: tuple[Any, dict[str, Any]] | None = None

    def serialize(self, asset_ctx_kwargs: dict[str, Any] | None = None) -> tuple[dict[str, Any], str]:
        """The serialized context, and a key that names its settings (equal keys, equal settings)."""
        from prefect import context as pctx

        settings_ctx = pctx.SettingsContext.get()
        cached = self._settings
        if cached is None or cached[0] is not settings_ctx:
            serialized = settings_ctx.serialize() if settings_ctx else {}
            if self.api_url is not None:
                serialized = for_workers(serialized, self.api_url)
            cached = self._settings = (settings_ctx, serialized, uuid.uuid4().hex)
        flow_run_ctx = pctx.EngineContext.get()
        task_run_ctx = pctx.TaskRunContext.get()
        tags_ctx = pctx.TagsContext.get()
        deployment_id = pctx._deployment_id.get()
        context = {
            "flow_run_context": self._flow_run(flow_run_ctx) if flow_run_ctx else {},
            "task_run_context": task_run_ctx.serialize() if task_run_ctx else {},
            "tags_context": tags_ctx.serialize() if tags_ctx else {},
            "settings_context": cached[1],
            "asset_context": (
                pctx.AssetContext.from_task_and_inputs(**asset_ctx_kwargs).serialize() if asset_ctx_kwargs else {}
            ),
            "deployment_id": str(deployment_id) if deployment_id else None,
            "deployment_parameters": pctx._deployment_parameters.get(),
        }
        return context, cached[2]

    def _flow_run(self, ctx: Any) -> dict[str, Any]:
        """``ctx.serialize()``, with its result store (a block: costly to dump) dumped once per store."""
        store = ctx.result_store
        if store is None:
            return ctx.serialize()
        serialized = ctx.model_copy(update={"result_store": None}).serialize()  # shallow copy, all else shared
        cached = self._result_store
        if cached is None or cached[0] is not store:
            dumped = store.model_dump(serialize_as_any=True, exclude_unset=True, context={"include_secrets": True})
            cached = self._result_store = (store, dumped)
        serialized["result_store"] = cached[1]
        return serialized


@dataclass(eq=False)
class _Job:
    """One submitted task, from submit to its final state (a crash re-run keeps its job)."""

    st: _ProfileState
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


_LIVE_RUNNERS: weakref.WeakSet[ProfileTaskRunner] = weakref.WeakSet()


@atexit.register
def _close_leftovers() -> None:  # pragma: no cover - interpreter exit
    for runner in list(_LIVE_RUNNERS):
        try:
            runner._shutdown("interpreter exit")
        except Exception:
            logger.warning("gpu-tasks: error closing clusters at exit", exc_info=True)


# ---------------------------------------------------------------- the runner
class ProfileTaskRunner(TaskRunner[ProfileFuture]):
    """Runs each task on the Dask cluster of its resource profile.

    Args:
        profiles: The profiles tasks may name with ``profile:<name>`` tags. Profiles
            from ``GPU_TASKS_PROFILES_FILE`` are added and override same-named ones, so a
            deployment can change hardware without a code change.
        default: Profile of untagged tasks (default ``"cpu"``; a plain CPU profile is
            added when no profile of that name exists).
        idle_timeout: Seconds a cluster may sit idle before it is closed, for profiles
            that do not set their own; ``None`` takes ``GPU_TASKS_IDLE_TIMEOUT``.

    Clusters start when a profile's first task is submitted, never in ``__enter__``
    (Prefect enters a copy of the runner on workers while hydrating context).
    """

    def __init__(
        self,
        profiles: Iterable[ResourceProfile] | None = None,
        default: str | None = None,
        idle_timeout: float | None = None,
    ) -> None:
        super().__init__()
        self._profiles_arg: tuple[ResourceProfile, ...] = tuple(profiles or ())
        for p in self._profiles_arg:
            if not isinstance(p, ResourceProfile):
                raise ProfileError(f"profiles must be ResourceProfile objects; got {p!r}")
        names = [p.name for p in self._profiles_arg]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ProfileError(f"profiles must have distinct names; {', '.join(dupes)} given more than once")
        self._default_arg = default
        if idle_timeout is not None and idle_timeout < 0:
            raise ProfileError(f"idle_timeout must be >= 0 seconds; got {idle_timeout}")
        self._idle_timeout_arg = idle_timeout
        self._live: _Live | None = None
        self._exit_stack = ExitStack()

    # ------------------------------------------------------------ configuration
    @property
    def idle_timeout(self) -> float:
        """The runner-wide idle timeout (argument, else GPU_TASKS_IDLE_TIMEOUT)."""
        if self._idle_timeout_arg is not None:
            return self._idle_timeout_arg
        return get_settings().idle_timeout

    def resolve_profiles(self) -> tuple[dict[str, ResourceProfile], str]:
        """The profiles in force (code, then GPU_TASKS_PROFILES_FILE) and the default name."""
        profiles = {p.name: p for p in self._profiles_arg}
        file_default = None
        path = get_settings().profiles_file
        if path is not None:
            loaded, file_default = load_profiles_file(path)
            profiles.update(loaded)
        default = self._default_arg or file_default or DEFAULT_PROFILE
        if default not in profiles:
            if default != DEFAULT_PROFILE:
                raise UnknownProfileError(
                    f"default profile {default!r} is not defined; known profiles: {', '.join(sorted(profiles)) or 'none'}"
                )
            profiles[DEFAULT_PROFILE] = ResourceProfile(name=DEFAULT_PROFILE)
        for p in profiles.values():
            if p.on_oom is not None and p.on_oom not in profiles:
                raise UnknownProfileError(
                    f"profile {p.name!r} sets on_oom={p.on_oom!r}, which this runner does not know; known profiles: "
                    f"{', '.join(sorted(profiles))}. Add a ResourceProfile(name={p.on_oom!r}, ...) or remove on_oom"
                )
        if profiles[default].is_gpu:
            raise ProfileError(f"default profile {default!r} must be a CPU profile (gpus=0); untagged tasks run there")
        return profiles, default

    def duplicate(self) -> ProfileTaskRunner:
        return type(self)(profiles=self._profiles_arg, default=self._default_arg, idle_timeout=self._idle_timeout_arg)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ProfileTaskRunner)
            and self._profiles_arg == other._profiles_arg
            and self._default_arg == other._default_arg
            and self._idle_timeout_arg == other._idle_timeout_arg
        )

    __hash__ = object.__hash__

    def __getstate__(self) -> dict[str, Any]:
        # Prefect pickles the flow (and so this runner) into every remote task's context.
        return {
            "_profiles_arg": self._profiles_arg, "_default_arg": self._default_arg,
            "_idle_timeout_arg": self._idle_timeout_arg,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            profiles=state["_profiles_arg"], default=state["_default_arg"], idle_timeout=state["_idle_timeout_arg"]
        )

    # ------------------------------------------------------------ lifetime
    def __enter__(self) -> ProfileTaskRunner:
        super().__enter__()
        self._exit_stack = ExitStack()
        return self

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        try:
            reason = "flow run ended" if exc_type is None else f"flow run ended with {exc_type.__name__}"
            self._shutdown(reason, hurry=exc_type is not None)
            self._exit_stack.close()
        finally:
            super().__exit__(exc_type, exc_value, traceback)

    def _shutdown(self, reason: str, hurry: bool = False) -> None:
        live, self._live = self._live, None
        _LIVE_RUNNERS.discard(self)
        if live is not None:
            live.close(reason, hurry=hurry)
            self._last_ledger = list(live.ledger)
            _publish_ledger(self._last_ledger, live.flow_run_id)

    def _ensure_live(self) -> _Live:
        if not self._started:
            raise RuntimeError("The task runner must be started before submitting work.")
        if self._live is None:
            self._live = _Live(self)
            _LIVE_RUNNERS.add(self)
        return self._live

    # ------------------------------------------------------------ routing
    def profile_for(self, task: Any) -> ResourceProfile:
        """The profile a task submitted now would run on (after fallback).

        Raises:
            UnknownProfileError: the tag names no known profile.
            UnsatisfiableProfileError: no device can ever satisfy it and fallback is "error".
        """
        return self._route(task)[0]

    def _route(self, task: Any) -> tuple[ResourceProfile, str, str | None]:
        """The profile to run on, the profile asked for, and why they differ (fallback) if so."""
        live = self._ensure_live()
        name = _requested_profile(task) or live.default
        prof = live.profiles.get(name)
        if prof is None:
            raise UnknownProfileError(
                f"task {task.name!r} asks for profile {name!r}, which this runner does not know; known profiles: "
                f"{', '.join(sorted(live.profiles))}. Add a ResourceProfile(name={name!r}, ...) to "
                "ProfileTaskRunner(profiles=[...]) or to GPU_TASKS_PROFILES_FILE"
            )
        reason = unsatisfiable_reason(prof, live.inventory) if prof.is_gpu else None
        if reason is None:
            return prof, name, None
        if prof.fallback == "cpu":
            return live.profiles[live.default], name, reason
        raise UnsatisfiableProfileError(
            f"task {task.name!r} cannot run: {reason}. Lower the request, fix gpu_model/gpu_memory, "
            "or set fallback='cpu' on the profile"
        )

    # ------------------------------------------------------------ submit
    def submit(  # type: ignore[override]
        self,
        task: Any,
        parameters: dict[str, Any],
        wait_for: Iterable[PrefectFuture[Any]] | None = None,
        dependencies: dict[str, set[Any]] | None = None,
    ) -> ProfileFuture:
        """Submit a task to its profile's cluster; returns at once with a future."""
        if os.environ.get(WORKER_ENV_PROFILE):  # called by a task running in one of our worker processes
            return self._submit_nested(task, parameters, wait_for, dependencies)
        live = self._ensure_live()
        prof, requested, fallback_reason = self._route(task)
        extra_tags = [profile(prof.name)]
        if fallback_reason is not None:
            extra_tags.append(FALLBACK_TAG)
            _flow_logger().warning(
                "Task %r asks for profile %r, which cannot be satisfied (%s); running it on CPU profile %r "
                "because the profile sets fallback='cpu'",
                task.name, requested, fallback_reason, prof.name,
            )
        st = live.state(prof)
        with st.lock:
            st.outstanding += 1
            st.idle_since = None
        job = _Job(
            st=st, task=task, task_run_id=uuid.uuid4(), parameters=parameters, wait_for=wait_for,
            dependencies=dependencies, extra_tags=extra_tags, cf=concurrent.futures.Future(),
            ctx=contextvars.copy_context(),
        )
        future = ProfileFuture(job.task_run_id, job.cf, profile=prof.name)
        run = partial(self._dispatch, live, job)
        upstream = _pending_futures((parameters, list(wait_for or ())))
        executor = st.dispatcher or live.executor
        if not upstream and st.dispatcher is None:
            run()  # CPU profiles: dispatch right here, the cheapest path
        elif not upstream:
            executor.submit(run)
        else:
            _when_all_done(upstream, lambda: executor.submit(run))
        return future

    def _submit_nested(
        self, task: Any, parameters: dict[str, Any], wait_for: Iterable[PrefectFuture[Any]] | None,
        dependencies: dict[str, set[Any]] | None,
    ) -> ProfileFuture:
        """A task submitted by a task running in a worker process: run it there, on the parent's devices.

        The child shares its parent's allocation and slots (the parent leaves its slot while it
        waits), so nesting never waits for devices the parent holds, at any depth.

        Raises:
            ProfileError: the child names another profile than the worker's.
        """
        from prefect import tags

        here = os.environ[WORKER_ENV_PROFILE]
        profiles, default = self.resolve_profiles()
        # the child's own tag first: the tags context it inherits carries its parent's profile
        wanted = profile_from_tags(set(task.tags)) or _requested_profile(task) or default
        if wanted != here:
            raise ProfileError(
                f"task {task.name!r} asks for profile {wanted!r} but was submitted by a task running in a "
                f"worker of profile {here!r}; nested tasks run on their parent's profile. Tag it "
                f"profile({here!r}), or submit it from the flow instead of from inside a task"
            )
        alloc = current_allocation()
        pool = _nested_pool(here)
        task_run_id = uuid.uuid4()

        def run() -> Any:
            kwargs: dict[str, Any] = dict(
                task_run_id=task_run_id, parameters=_futures_to_states(parameters),
                wait_for=_futures_to_states(list(wait_for)) if wait_for else None,
                dependencies=dependencies, return_type="state",
            )
            with tags(profile(here)):
                return _run_engine(alloc, task, kwargs)[0]

        cf = pool.submit(contextvars.copy_context().run, run)
        return ProfileFuture(task_run_id, cf, profile=here)

    def _dispatch(self, live: _Live, job: _Job) -> None:
        try:
            job.ctx.run(self._dispatch_in_context, live, job)
        except BaseException as exc:
            self._finish(live, job, exc=exc)
            if not isinstance(exc, Exception):
                raise

    def _dispatch_in_context(self, live: _Live, job: _Job) -> None:
        from prefect import tags

        st = job.st
        prof = st.cluster.profile
        parameters = _futures_to_states(job.parameters)
        wait_for = _futures_to_states(list(job.wait_for)) if job.wait_for else None
        with st.lock:
            if live.stop.is_set():
                raise RuntimeError("the task runner is shutting down")
            cluster = st.cluster
            want = desired_workers(prof, st.dispatched + 1, cluster.worker_count, cluster.limit)
            if not cluster.running:
                cluster.start(want)
                st.ever_provisioned = True
                live.emit("provisioned", cluster, {
                    "workers": cluster.worker_count, **{k: round(v, 3) for k, v in cluster.startup.items()},
                })
                _publish_dashboard(cluster)
            elif want > cluster.worker_count:
                before = set(cluster.devices)
                cluster.scale_to(want)
                added = [d for d in cluster.devices if d not in before]
                if added:
                    live.emit("scaled", cluster, {"workers": cluster.worker_count, "added": added}, added)
            st.dispatched += 1
            live.inflight[job.task_run_id] = job
        task = job.task
        kwargs: dict[str, Any] = dict(
            task_run_id=job.task_run_id, parameters=parameters, wait_for=wait_for,
            dependencies=job.dependencies, return_type="state",
        )
        if job.task_run is not None:  # a re-run after a crash continues the same task run
            kwargs["task_run"] = job.task_run
            task = task.with_options(retries=max(0, (task.retries or 0) - job.crashes))
        key = f"{task.name}-{job.task_run_id.hex}-{job.crashes}"
        with tags(*job.extra_tags):
            if not prof.uses_processes:
                alloc = Allocation(profile=prof.name, worker="in-process")
                dfut = cluster.submit(
                    contextvars.copy_context().run, _run_engine, alloc, task, kwargs, key=key, resources=None
                )
            else:
                kwargs["context"], settings_key = live.context.serialize(
                    asset_ctx_kwargs={
                        "task": task, "task_run_id": job.task_run_id,
                        "task_inputs": job.dependencies or {}, "copy_to_child_ctx": True,
                    }
                )
                dfut = cluster.submit(
                    _run_on_worker, prof.name, float(prof.share), task, kwargs, settings_key, key=key,
                    resources=task_resources(prof),
                )
        dfut.add_done_callback(partial(self._on_done, live, job))

    def _on_done(self, live: _Live, job: _Job, dfut: Any) -> None:
        try:
            state, start, end, wkey = dfut.result()
        except BaseException as exc:
            if _is_worker_death(exc) and not live.stop.is_set():
                # off Dask's callback thread: reporting may wait on the server, a retry on devices
                threading.Thread(
                    target=job.ctx.copy().run, args=(self._worker_died, live, job, exc),
                    name=f"gpu-tasks-crash-{job.st.cluster.profile.name}", daemon=True,
                ).start()
                return
            self._finish(live, job, exc=exc, dispatched=True)
            return
        job.st.cluster.record(wkey, start, end)
        prof = job.st.cluster.profile
        if (prof.on_oom and job.escalated_from is None and state.is_failed()
                and GpuOutOfMemoryError.__name__ in (state.message or "") and not live.stop.is_set()):
            with job.st.lock:
                job.st.dispatched -= 1
                live.inflight.pop(job.task_run_id, None)
            threading.Thread(
                target=job.ctx.copy().run, args=(self._escalate_guarded, live, job, state, None, state.message or "out of memory"),
                name=f"gpu-tasks-oom-{prof.name}", daemon=True,
            ).start()
            return
        self._finish(live, job, result=state, dispatched=True)

    def _escalate_guarded(self, live: _Live, job: _Job, state: Any, task_run: Any, why: str) -> None:
        try:
            self._escalate(live, job, state, task_run, why)
        except BaseException as err:  # never leave the future unresolved
            logger.warning("gpu-tasks: could not re-run an out-of-memory task on its on_oom profile", exc_info=True)
            self._finish(live, job, exc=err)

    def _escalate(self, live: _Live, job: _Job, state: Any, task_run: Any, why: str) -> None:
        """Re-run ``job`` once on its profile's ``on_oom`` profile, continuing the same task run."""
        from gpu_tasks._crash import await_retry, read_task_run

        source = job.st.cluster.profile
        target = live.profiles[source.on_oom]  # type: ignore[index]
        if task_run is None:
            task_run = read_task_run(job.task_run_id, job.task, live.flow_run_id, set(job.task.tags), wait=2.0)
        old, new = job.st, live.state(target)
        with old.lock:
            old.outstanding -= 1
            if old.outstanding == 0:
                old.idle_since = time.monotonic()
        with new.lock:
            new.outstanding += 1
            new.idle_since = None
        job.st = new
        job.extra_tags = [profile(target.name), ESCALATED_TAG]
        job.escalated_from = source.name
        task_run.tags = sorted(set(task_run.tags or ()) | {profile(target.name), ESCALATED_TAG})
        await_retry(task_run, live.flow_run_id)
        job.task_run = task_run
        _flow_logger().warning(
            "Task run %r ran out of memory on profile %r (%s); re-running it once on profile %r (on_oom)",
            task_run.name, source.name, why, target.name,
        )
        live.emit_task("escalated", job, {"from_profile": source.name, "to_profile": target.name, "reason": why})
        self._dispatch(live, job)

    def _worker_died(self, live: _Live, job: _Job, exc: BaseException) -> None:
        """The worker running ``job`` died: report the crash, give its devices back, retry if allowed."""
        try:
            retry = self._report_worker_death(live, job, exc)
        except BaseException as err:  # never leave the future unresolved
            logger.warning("gpu-tasks: error while handling a dead worker", exc_info=True)
            self._finish(live, job, exc=err)
            return
        if retry is None:
            return
        delay, state = retry
        if live.stop.wait(delay):
            self._finish(live, job, result=state)
            return
        self._dispatch(live, job)

    def _report_worker_death(self, live: _Live, job: _Job, exc: BaseException) -> tuple[float, Any] | None:
        """Crash report and ledger for a dead worker; ``(delay, crashed state)`` when the task is retried."""
        from gpu_tasks._crash import await_retry, crash_task_run, worker_exit

        st = job.st
        prof = st.cluster.profile
        ws = getattr(exc, "last_worker", None)
        name = str(getattr(ws, "name", "") or "")
        address = getattr(ws, "address", None)
        ended = worker_exit(address) if address else None
        how = ended.describe() if ended else "died"
        with st.lock:
            devices = st.cluster.worker_devices(name) or st.cluster.devices
            row = st.cluster.retire(name, f"worker crashed: {how}")
            st.dispatched -= 1
            live.inflight.pop(job.task_run_id, None)
        where = f"device(s) {','.join(devices)}" if devices else "CPU"
        if prof.is_gpu and st.cluster.inventory.emulated:
            where += " (emulated)"
        pid = f", pid {ended.pid}" if ended and ended.pid else ""
        message = (
            f"{'Out of memory: ' if ended and ended.memory_kill else ''}the worker process of profile "
            f"{prof.name!r} on {where} ({name or address}{pid}) {how} while running this task"
        )
        if row is not None:
            live.ledger.append(row)
            live.emit("crashed", st.cluster, {
                "reason": message, "devices": list(row.devices), "worker": name, "pid": ended.pid if ended else None,
                "exitcode": ended.exitcode if ended else None, "out_of_memory": bool(ended and ended.memory_kill),
                "held_s": round(row.held_seconds, 3), "busy_s": round(row.busy_seconds, 3),
            }, row.devices)
        tags = set(job.task.tags) | set(job.extra_tags)
        state, task_run = crash_task_run(job.task_run_id, job.task, live.flow_run_id, message, tags=tags)
        if ended and ended.memory_kill and prof.on_oom and job.escalated_from is None and task_run is not None:
            self._escalate(live, job, state, task_run, message)
            return None
        attempts = max(job.crashes + 1, int(getattr(task_run, "run_count", 0) or 0))
        retries = int(job.task.retries or 0)
        log = _flow_logger()
        if task_run is None or attempts > retries:
            log.error("Task run %s crashed: %s%s", job.task_run_id, message,
                      f"; no retries left ({retries} allowed)" if retries else "")
            self._finish(live, job, result=state)
            return None
        delay = _retry_delay(job.task, job.crashes)
        await_retry(task_run, live.flow_run_id, delay)
        job.crashes += 1
        job.task_run = task_run
        log.warning("Task run %r crashed: %s; retrying it on a new worker (retry %d of %d) in %gs",
                    task_run.name, message, attempts, retries, delay)
        return delay, state

    def _finish(
        self, live: _Live, job: _Job, result: Any = None, exc: BaseException | None = None, dispatched: bool = False,
    ) -> None:
        st, cf = job.st, job.cf
        with st.lock:
            st.outstanding -= 1
            if dispatched:
                st.dispatched -= 1
                live.inflight.pop(job.task_run_id, None)
            if st.outstanding == 0:
                st.idle_since = time.monotonic()
        if cf.done():
            return
        if exc is not None:
            cf.set_exception(exc)
        else:
            cf.set_result(result)

    # ------------------------------------------------------------ inspection
    def status(self) -> dict[str, dict[str, Any]]:
        """Each profile's state (``absent``, ``running``, ``closed``), workers and devices."""
        live = self._live
        if live is None:
            profiles, _ = self.resolve_profiles()
            return {name: _status_row("absent", p, None, 0) for name, p in profiles.items()}
        out = {}
        for name, prof in live.profiles.items():
            st = live.states.get(name)
            if st is None or not st.ever_provisioned:
                out[name] = _status_row("absent", prof, None, st.outstanding if st else 0)
            elif st.cluster.running:
                out[name] = _status_row("running", prof, st.cluster, st.outstanding)
            else:
                row = _status_row("closed", prof, None, st.outstanding)
                row["emulated"] = bool(prof.is_gpu and st.cluster.inventory.emulated)
                out[name] = row
        return out

    @property
    def ledger(self) -> list[LedgerRow]:
        """Closed cluster lifetimes so far (the ledger of the last run after exit)."""
        if self._live is not None:
            return list(self._live.ledger)
        return list(getattr(self, "_last_ledger", []))

    @property
    def inventory(self) -> Inventory:
        """The device inventory this runner schedules on."""
        return self._ensure_live().inventory


def _status_row(state: str, prof: ResourceProfile, cluster: ProfileCluster | None, outstanding: int) -> dict[str, Any]:
    return {
        "state": state,
        "gpus": prof.gpus,
        "workers": cluster.worker_count if cluster else 0,
        "devices": list(cluster.devices) if cluster else [],
        "emulated": bool(cluster and cluster.inventory.emulated and prof.is_gpu),
        "outstanding": outstanding,
        "dashboard": cluster.dashboard_link if cluster else None,
        # seconds the last start spent waiting for devices and starting workers
        "startup": dict(cluster.startup) if cluster else {},
    }


def _requested_profile(task: Any) -> str | None:
    """The profile a task's own tags and the enclosing ``prefect.tags`` blocks name, if any."""
    from prefect.context import TagsContext

    tags_ctx = TagsContext.get()
    return profile_from_tags(set(task.tags) | set(tags_ctx.current_tags if tags_ctx else ()))


def _publish_dashboard(cluster: ProfileCluster) -> None:
    """A link artifact to the cluster's Dask dashboard, when dashboards are on (best effort)."""
    link = cluster.dashboard_link
    if not link:
        return
    try:
        from prefect.artifacts import create_link_artifact

        name = cluster.profile.name
        create_link_artifact(link=link, link_text=f"Dask dashboard of profile {name!r}",
                             key=f"dask-dashboard-{re.sub(r'[^a-z0-9-]', '-', name.lower())}")
    except Exception:
        logger.warning("could not publish the dashboard link artifact", exc_info=True)


LEDGER_ARTIFACT_KEY = "resource-ledger"


def _publish_ledger(rows: list[LedgerRow], flow_run_id: uuid.UUID | None) -> None:
    """Attach the run's resource ledger to the flow run as a table artifact (best effort)."""
    if not rows or flow_run_id is None:
        return
    table = []
    for row in rows:
        item = row.as_dict()
        for key in ("provisioned_at", "closed_at"):
            item[key] = datetime.datetime.fromtimestamp(item[key], tz=datetime.timezone.utc).isoformat(timespec="seconds")
        table.append(item)
    held = sum(r.held_seconds for r in rows if r.devices)
    busy = sum(r.busy_seconds for r in rows if r.devices)
    emulated = any(r.emulated for r in rows)
    description = (
        f"gpu-tasks resource ledger: one row per profile cluster lifetime. Devices held {held:.1f} "
        f"device-s, busy {busy:.1f} device-s" + (" (EMULATED devices)" if emulated else "")
    )
    try:
        import json

        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import ArtifactCreate

        with get_client(sync_client=True) as client:
            client.create_artifact(ArtifactCreate(
                key=LEDGER_ARTIFACT_KEY, type="table", data=json.dumps(table, default=str),
                description=description, flow_run_id=flow_run_id,
            ))
    except Exception:  # the ledger must never fail a flow run that succeeded
        logger.warning("could not publish the resource ledger artifact", exc_info=True)


def _flow_logger() -> logging.Logger | logging.LoggerAdapter[logging.Logger]:
    from prefect.logging import get_run_logger

    try:
        return get_run_logger()
    except Exception:
        return logger


def _pending_futures(expr: Any) -> list[PrefectFuture[Any]]:
    found: list[PrefectFuture[Any]] = []

    def visit(x: Any) -> Any:
        if isinstance(x, PrefectFuture):
            found.append(x)
        return x

    visit_collection(expr, visit_fn=visit, return_data=False)
    return [f for f in found if not _is_done(f)]


def _is_done(f: PrefectFuture[Any]) -> bool:
    wrapped = getattr(f, "wrapped_future", None)
    if isinstance(wrapped, concurrent.futures.Future):
        return wrapped.done()
    return f.state.is_final()


def _when_all_done(futures: list[PrefectFuture[Any]], then: Any) -> None:
    remaining = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Any) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            then()

    for f in futures:
        f.add_done_callback(one_done)


def _futures_to_states(expr: Any) -> Any:
    """Replace Prefect futures by their final states, which travel to any cluster."""

    def visit(x: Any) -> Any:
        if isinstance(x, PrefectFuture):
            x.wait()
            return x.state
        return x

    return visit_collection(expr, visit_fn=visit, return_data=True)
