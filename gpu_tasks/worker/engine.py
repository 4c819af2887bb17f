"""Prefect's task engine on a worker's allocation: :func:`run_on_worker` in a worker process,
:func:`run_engine` in-process too. State here is per process."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import copy
import functools
import logging
import math
import os
import socket
import threading
import time
import uuid
from typing import Any

from prefect.client.schemas.objects import State
from prefect.context import SettingsContext, SyncClientContext, TaskRunContext
from prefect.states import Crashed

from gpu_tasks.allocation import (
    EMULATED_TAG,
    ESCALATED_TAG,
    PLACEMENT_FREE_ENV,
    WORKER_ENV_PROFILE,
    Allocation,
    allocated,
    current_allocation,
    worker_allocation,
)
from gpu_tasks.compat.prefect import (
    cache_qualified_names,
    ours,
    remember_without_limits,
    tag_slots_held_by_flow,
    use_no_limits_cache,
)
from gpu_tasks.compat.prefect_client import cap_client_waits
from gpu_tasks.compat.prefect_server import drain_events, keep_slim_event_contexts
from gpu_tasks.errors import GpuOutOfMemoryError, ProfileError, TaskPreempted
from gpu_tasks.policy import GPU_RESOURCE, WORKER_ENV_ON_OOM
from gpu_tasks.preemption import PreemptedRun
from gpu_tasks.prefect_api.api import sync_client
from gpu_tasks.prefect_api.backlog import wait_to_start
from gpu_tasks.prefect_api.futures import futures_to_states, unsealed
from gpu_tasks.prefect_api.states import crash_task_run, looks_like_oom, rerun_task, retry_after_crash
from gpu_tasks.prefect_api.tag_answers import limited_names, start_renewing
from gpu_tasks.profiles import profile, requested_profile
from gpu_tasks.reporting.ledger import worker_key
from gpu_tasks.settings import get_settings
from gpu_tasks.worker import guard as _worker_guard
from gpu_tasks.worker import memory_caps
from gpu_tasks.worker.blobs import opened
from gpu_tasks.worker.interrupts import INTERRUPTIBLE, INTERRUPTIBLE_LOCK, ORPHANED, watch_released
from gpu_tasks.worker.slots import SlotPool
from gpu_tasks.worker.started import mark_ended, mark_started

logger = logging.getLogger(__name__)

# Built Prefect settings by their key: validating Settings reads env, .env and toml, too slow per task.
_WORKER_SETTINGS: dict[str, dict[str, Any]] = {}
_WORKER_SETTINGS_LOCK = threading.Lock()
_WORKER_THREAD = threading.local()  # each worker thread's open sync Prefect client, by settings key
_PROCESS_READY = threading.Event()
_PROCESS_READY_LOCK = threading.Lock()
_NAMES_CACHED = threading.Event()  # Prefect's serializers resolve names once in gpu-tasks' task runs


def owned_devices(dask_worker: Any) -> int | None:
    """How many devices a worker owns: its ``GPU`` resource, rounded up (``None``: all it sees)."""
    total = getattr(getattr(dask_worker, "state", None), "total_resources", None) or {}
    gpus = float(total.get(GPU_RESOURCE, 0) or 0)
    return max(1, math.ceil(gpus - 1e-9)) if gpus > 0 else None


def prepare_process() -> None:
    """Set Prefect's logging up once, before any task runs: its lazy, lockless setup could deadlock
    tasks that start at once (docs/runner.md, "Tasks starting together in a fresh worker process")."""
    if _PROCESS_READY.is_set():
        return
    with _PROCESS_READY_LOCK:
        if not _PROCESS_READY.is_set():
            import prefect.main  # noqa: F401  (it sets logging up at import, done or not: then once)
            from prefect.logging.configuration import ensure_logging_setup  # documented for Dask workers

            ensure_logging_setup()
            _PROCESS_READY.set()


def run_on_worker(
    profile_name: str,
    fraction: float,
    task: Any,
    kwargs: dict[str, Any],
    settings_key: str,
    remote: bool = False,
    slots_held: tuple[str, ...] = (),
    started_log: str | None = None,
    free_runs: int = 0,
) -> tuple[Any, float, float, str]:
    """Run the Prefect task engine in a worker process; ``remote``: one the runner did not start,
    ``slots_held``: tag limits the flow holds (or knows absent), ``started_log``: the hand-off file,
    ``free_runs``: the task run's runs that used no retry (preempted, on_oom)."""
    from distributed import get_worker

    prepare_process()
    memory_caps.apply()
    dask_worker: Any = get_worker()
    task = opened(task)
    context = {k: opened(v) for k, v in kwargs["context"].items()}
    settings = _worker_settings(settings_key, context["settings_context"], remote)
    kwargs = {**kwargs, "context": {**context, "settings_context": settings}}
    kwargs.update(parameters=unsealed(kwargs["parameters"]), wait_for=unsealed(kwargs.get("wait_for")))
    host, own = (socket.gethostname(), owned_devices(dask_worker)) if remote else (None, None)
    alloc = worker_allocation(profile_name, fraction, dask_worker.address, host=host, own=own)
    _worker_guard.on_orphaned(_report_orphaned)
    flow_run = (kwargs["context"].get("flow_run_context") or {}).get("flow_run")
    running = (task, getattr(flow_run, "id", None), alloc, set(task.tags), settings)
    with _RUNNING_LOCK:
        _RUNNING[kwargs["task_run_id"]] = running
    mark = None
    try:
        with (
            SettingsContext(**settings),
            # the engine finds the thread's client as its own (__init__ would open a new one)
            SyncClientContext.model_construct(client=_thread_client(settings_key)),
        ):
            if remote:
                mark = _StartedMark(dask_worker)
                if mark.earlier is not None:
                    after = _after_lost_worker(task, kwargs, running[1], alloc, mark.earlier, free_runs)
                    if isinstance(after, tuple):
                        task, kwargs = after
                    else:  # no retries left: the Crashed state is final
                        now = time.time()
                        return after, now, now, worker_key(alloc.device_keys)
            with tag_slots_held_by_flow(kwargs["task_run_id"], slots_held):
                if not remote:
                    if started_log:
                        mark_started(
                            started_log, dask_worker.get_current_task(), worker_key(alloc.device_keys)
                        )
                    out = run_engine(alloc, task, kwargs)
                    if started_log and out[0].is_final():
                        mark_ended(started_log, dask_worker.get_current_task())
                    return out
                return _interruptible(dask_worker, alloc, task, kwargs)
    finally:
        if mark is not None:
            mark.clear()
        with _RUNNING_LOCK:
            _RUNNING.pop(kwargs["task_run_id"], None)


def _interruptible(
    dask_worker: Any, alloc: Allocation, task: Any, kwargs: dict[str, Any]
) -> tuple[Any, float, float, str]:
    """``run_engine`` in a thread :func:`interrupt_tasks` may interrupt; a ``PreemptedRun`` if it did.
    Registered inside the ``try``, so what ``interrupt_tasks`` raises is caught here; it unregisters
    the thread as it interrupts it, so the engine handles one interrupt, never a second."""
    key = str(dask_worker.get_current_task())
    ident = threading.get_ident()
    start = time.time()
    watch_released(dask_worker)
    try:
        with INTERRUPTIBLE_LOCK:
            INTERRUPTIBLE[ident] = key
        try:
            return run_engine(alloc, task, kwargs)
        finally:
            with INTERRUPTIBLE_LOCK:
                INTERRUPTIBLE.pop(ident, None)
                ORPHANED.discard(ident)
    except (TaskPreempted, KeyboardInterrupt) as exc:
        end, wkey = time.time(), worker_key(alloc.device_keys)
        if isinstance(exc, KeyboardInterrupt):  # its flow run stopped
            return _crashed_by(exc, kwargs.get("task_run_id")), start, end, wkey
        logger.warning("task run %s was preempted on %s", kwargs.get("task_run_id"), alloc.worker)
        return PreemptedRun(start, end, wkey), start, end, wkey


class _StartedMark:
    """Metadata a task on a shared scheduler leaves there while it runs (``Client.set_metadata`` under
    its Dask key, which the scheduler drops with the task): its worker's address. The scheduler re-runs a
    task whose worker died under the same key: a mark found (:attr:`earlier`) says so. Read with
    ``get_metadata``'s default: ``Variable.get(timeout=0)`` logged an ERROR on the scheduler per task."""

    def __init__(self, dask_worker: Any) -> None:
        from distributed import get_client

        self.earlier: str | None = None
        self._client: Any = None
        self._worker = dask_worker
        self._path = [dask_worker.get_current_task(), "gpu-tasks-started"]
        try:
            client = get_client()
            earlier = client.get_metadata(self._path, default=None)
            self.earlier = None if earlier is None else str(earlier)
            client.set_metadata(self._path, str(dask_worker.address))
            self._client = client
        except Exception:  # the scheduler refused: run it as a first run
            logger.warning("could not mark task %s started on its scheduler", self._path[0], exc_info=True)

    def clear(self) -> None:
        """Clear the mark, no reply awaited; not for a task its scheduler released (gone with it there)."""
        from gpu_tasks.worker.interrupts import released_keys

        client, path = self._client, self._path
        if client is None or released_keys(self._worker, path[:1]):
            return

        async def clear() -> None:
            with contextlib.suppress(Exception):  # the scheduler went away: nothing left to clear
                await client.scheduler.set_metadata(keys=path, value=None)

        with contextlib.suppress(Exception):
            client.loop.add_callback(clear)


def _after_lost_worker(
    task: Any, kwargs: dict[str, Any], flow_run_id: Any, alloc: Allocation, dead: str, free_runs: int
) -> tuple[Any, dict[str, Any]] | Any:
    """A shared scheduler re-ran a task whose worker ``dead`` died: follow the runner's rules instead.
    ``(task, kwargs)`` to run it as a retry of the same task run, or ``Crashed`` with no retry left."""
    from gpu_tasks.prefect_api.states import ToFlow

    flow_run = uuid.UUID(str(flow_run_id)) if flow_run_id else None
    message = (
        f"the worker process running this task on profile {alloc.profile!r} ({dead}) died; its Dask "
        f"scheduler re-ran it on {alloc.worker} ({alloc.label()})"
    )
    state, task_run = crash_task_run(kwargs["task_run_id"], task, flow_run, message, tags=set(task.tags))
    told = ToFlow(logger, flow_run, alloc.profile)  # its line reaches the flow run's log too
    delay = retry_after_crash(task, task_run, flow_run, free_runs, 1, message, told)
    if delay is None:
        return state
    time.sleep(delay)  # as Prefect's own retries wait retry_delay_seconds
    return rerun_task(task, task_run, free_runs, 1), {**kwargs, "task_run": task_run}


# Task runs this process runs now, for a crash report if the flow process dies.
# each running task run: its task, flow run id, allocation, tags and flow run's settings
_RUNNING: dict[uuid.UUID, tuple[Any, Any, Allocation, set[str], dict[str, Any]]] = {}
_RUNNING_LOCK = threading.Lock()


def _report_orphaned(flow_pid: int) -> None:
    """The flow process died: report its running task runs and flow run ``Crashed``, in a few seconds,
    to the server of each one's flow run (its settings name it, the flow process's ephemeral server
    included); never to a server of the worker's own settings, which may name none (one would start)."""
    from prefect.client.orchestration import get_client

    with _RUNNING_LOCK:
        running = dict(_RUNNING)
    why = (
        f"the flow process (pid {flow_pid}) died while gpu-tasks workers ran its tasks (reported by a worker)"
    )
    flow_runs: dict[uuid.UUID, dict[str, Any]] = {}
    for task_run_id, (task, flow_run_id, alloc, tags, settings) in running.items():
        if not settings["settings"].api.url:
            logger.warning("no Prefect server to report task run %s Crashed to", task_run_id)
            continue
        where = f"device(s) {','.join(alloc.devices)}" if alloc.devices else "CPU"
        message = (
            f"the flow process (pid {flow_pid}) died while this task ran on profile {alloc.profile!r}, "
            f"{where}; its worker exited with it"
        )
        flow_run = uuid.UUID(str(flow_run_id)) if flow_run_id else None
        with SettingsContext(**settings):
            crash_task_run(task_run_id, task, flow_run, message, tags=tags, wait=0.5)
        if flow_run:
            flow_runs[flow_run] = settings
    for flow_run, settings in flow_runs.items():
        try:
            with SettingsContext(**settings), get_client(sync_client=True) as client:
                client.set_flow_run_state(flow_run, Crashed(message=why), force=True)
        except Exception:
            logger.warning("could not report the flow run Crashed", exc_info=True)
    drain_events(2)


def _worker_settings(key: str, serialized: dict[str, Any], remote: bool = False) -> dict[str, Any]:
    """``SettingsContext`` fields for serialized settings sent under ``key``, built once. The cap on
    Prefect's client waits covers a ``remote`` worker's gpu-tasks task runs alone (others share it)."""
    with _WORKER_SETTINGS_LOCK:
        built = _WORKER_SETTINGS.get(key)
    if built is None:
        use_no_limits_cache(get_settings().tag_limit_cache_seconds, limited_names)  # once per settings
        cap_client_waits(get_settings().api_longest_wait, whole_process=not remote)
        ctx = SettingsContext(**serialized)  # pydantic does not revalidate these instances later
        built = {"profile": ctx.profile, "settings": ctx.settings}
        # asking the flow run's server: the worker's own settings may name none (an embedded server)
        start_renewing(ctx.profile, ctx.settings)
        with _WORKER_SETTINGS_LOCK:
            if len(_WORKER_SETTINGS) >= 8:  # one key per flow run's settings: keep a few
                _WORKER_SETTINGS.clear()
            _WORKER_SETTINGS[key] = built
    return built


def _thread_client(key: str) -> Any:
    """This thread's started sync Prefect client for the settings under ``key`` (active now)."""
    cached = getattr(_WORKER_THREAD, "client", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    if cached is not None:
        try:
            cached[1].__exit__(None, None, None)
        except Exception:  # pragma: no cover - closing a stale client is best effort
            logger.debug("could not close a worker's Prefect client", exc_info=True)
    client = sync_client().__enter__()  # left open: later tasks re-enter it
    settings = SettingsContext.get()
    if settings is None or settings.settings.client.server_version_check_enabled:
        client.raise_for_api_version_mismatch_once()
    _WORKER_THREAD.client = (key, client)
    return client


# Tasks as run on an allocation (with_options is costly); each entry keeps its task, so no id is reused.
_PREPARED: dict[tuple[int, Allocation], tuple[Any, Any]] = {}
_PREPARED_LOCK = threading.Lock()
_PREPARED_KEEP = 256


def _prepared(task: Any, alloc: Allocation) -> Any:
    """``task`` as it runs on ``alloc``: tagged with its devices, its out-of-memory errors named."""
    key = (id(task), alloc)
    with _PREPARED_LOCK:
        hit = _PREPARED.get(key)
    if hit is not None and hit[0] is task:
        return hit[1]
    out = task
    placement = alloc.placement_tags()
    _placement_unlimited(placement)
    if placement and not placement <= set(task.tags):
        # the task run shows where it ran in the Prefect UI: gpu:<id> per device, emulated or not
        out = out.with_options(tags=set(out.tags) | placement)
    if alloc.profile:
        out = _oom_translated(out, alloc)
    with _PREPARED_LOCK:
        if len(_PREPARED) >= _PREPARED_KEEP:
            _PREPARED.clear()
        _PREPARED[key] = (task, out)
    return out


def _placement_unlimited(placement: set[str]) -> None:
    """The flow process found no limit on the placement tags lately (``PLACEMENT_FREE_ENV``): the
    engine's check is answered from the "no limits" cache, with no request while the device is held."""
    found = os.environ.get(PLACEMENT_FREE_ENV)
    if not placement or not found:
        return
    try:
        age = time.time() - float(found)
    except ValueError:
        return
    if 0 <= age < get_settings().tag_limit_cache_seconds:
        remember_without_limits(sorted(f"tag:{t}" for t in placement))


def run_engine(alloc: Allocation, task: Any, kwargs: dict[str, Any]) -> tuple[Any, float, float, str]:
    from prefect.task_engine import run_task_async, run_task_sync

    if not _NAMES_CACHED.is_set():
        cache_qualified_names()
        keep_slim_event_contexts()
        _NAMES_CACHED.set()
    own, task = set(task.tags), _prepared(task, alloc)
    run = kwargs.get("task_run")
    if run is not None:  # a re-run continues its task run: tagged where it runs now, as a first run is
        stale = {t for t in run.tags or () if (t.startswith("gpu:") or t == EMULATED_TAG) and t not in own}
        run.tags = sorted((set(run.tags or ()) - stale) | set(task.tags))
    wait_to_start()  # while this process's Prefect events back up
    start = time.time()
    try:
        with allocated(alloc), ours():  # what gpu-tasks changes in Prefect applies in here alone
            if task.isasync:
                state = asyncio.run(run_task_async(task=task, **kwargs))
            else:
                state = run_task_sync(task=task, **kwargs)
    except (Exception, TaskPreempted):
        raise
    except BaseException as exc:
        # raised by the task (reported Crashed): further, it would abort the flow or kill the Dask worker
        state = _crashed_by(exc, kwargs.get("task_run_id"))
    return state, start, time.time(), worker_key(alloc.device_keys)


def _oom_translated(task: Any, alloc: Allocation) -> Any:
    """``task`` whose out-of-memory errors name its profile and devices."""
    fn = task.fn
    if getattr(fn, "__gpu_tasks_oom__", False):
        return task

    def translated(exc: Exception) -> Exception:
        if not looks_like_oom(exc) or isinstance(exc, GpuOutOfMemoryError):
            return exc
        where = f"device(s) {','.join(alloc.devices)}" if alloc.devices else "CPU"
        if alloc.devices and alloc.emulated:
            where += " (emulated)"
        on_oom = os.environ.get(WORKER_ENV_ON_OOM)  # set on the workers of a profile with on_oom
        run = TaskRunContext.get()
        if run is not None and ESCALATED_TAG in (run.task_run.tags or ()):
            fix = "It ran here after running out of memory on another profile (on_oom moves a task once): "
            fix += "lower the task's memory use, or run it on a larger profile"
        elif on_oom:
            fix = f"The task re-runs once on profile {on_oom!r} (the profile's on_oom)"
        else:
            fix = "Lower the task's memory use, or give the profile on_oom='<a larger profile>' to re-run "
            fix += "it there once"
        error = GpuOutOfMemoryError(
            f"out of memory on profile {alloc.profile!r}, {where}: {type(exc).__name__}: {exc}. {fix}"
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

    wrapped.__gpu_tasks_oom__ = True  # type: ignore[attr-defined]  # a marker on the function
    out = copy.copy(task)
    out.fn = wrapped
    return out


def _crashed_by(exc: BaseException, task_run_id: uuid.UUID | None) -> Any:
    if isinstance(exc, KeyboardInterrupt):
        message = "Execution was aborted by an interrupt signal."
    elif isinstance(exc, SystemExit):
        message = "Execution was aborted by Python system exit call."
    else:
        message = f"Execution was interrupted by {type(exc).__name__}: {exc}"
    state: State[Any] = Crashed(message=message)
    state.state_details.task_run_id = task_run_id
    return state


# Nested tasks run in their parent's worker process, on its allocation, in a slot pool sized like it.
_NESTED_POOLS: dict[str, SlotPool] = {}
_NESTED_LOCK = threading.Lock()


def nested_pool(profile_name: str) -> SlotPool:
    with _NESTED_LOCK:
        pool = _NESTED_POOLS.get(profile_name)
        if pool is None:
            try:  # as many threads as the Dask worker this runs in
                from distributed import get_worker

                threads = max(1, int(get_worker().state.nthreads))
            except Exception:  # not on a worker
                threads = 1
            pool = _NESTED_POOLS[profile_name] = SlotPool(threads, name=f"gpu-tasks-nested-{profile_name}")
        return pool


def submit_nested(
    task: Any,
    parameters: dict[str, Any],
    wait_for: Any,
    dependencies: dict[str, set[Any]] | None,
    default: str,
) -> tuple[uuid.UUID, concurrent.futures.Future[Any], str]:
    """Run a task submitted by a task in this worker process here, on the parent's allocation and
    slots (it leaves its slot while it waits): ``(task run id, future of its final state, profile)``."""
    from prefect import tags

    here = os.environ[WORKER_ENV_PROFILE]
    wanted = requested_profile(task) or default  # its own tag first: inherited tags carry the parent's
    if wanted != here:
        raise ProfileError(
            f"task {task.name!r} asks for profile {wanted!r} but was submitted by a task running in a "
            f"worker of profile {here!r}; nested tasks run on their parent's profile. Tag it "
            f"profile({here!r}), or submit it from the flow instead of from inside a task"
        )
    alloc = current_allocation()
    task_run_id = uuid.uuid4()

    def run() -> Any:
        kwargs: dict[str, Any] = dict(
            task_run_id=task_run_id,
            parameters=futures_to_states(parameters),
            wait_for=futures_to_states(list(wait_for)) if wait_for else None,
            dependencies=dependencies,
            return_type="state",
        )
        with tags(profile(here)):
            return run_engine(alloc, task, kwargs)[0]

    return task_run_id, nested_pool(here).submit(contextvars.copy_context().run, run), here


def in_worker_process() -> bool:
    """Whether this process is one of a profile's worker processes."""
    return bool(os.environ.get(WORKER_ENV_PROFILE))
