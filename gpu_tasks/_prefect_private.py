"""The private Prefect APIs gpu-tasks relies on, each with why and the versions checked.

Checked against prefect 3.8.8 (pinned in pyproject.toml). Each wrapper degrades to
Prefect's shipped behaviour, or fails with a clear error, on a release where the
private name is gone, so a Prefect upgrade breaks here, in one place.

**The tag "no limits" cache** (``prefect.concurrency.services._no_limits_cache``).
Prefect's task engine asks the server for tag concurrency slots before every task
run that has tags, and every gpu-tasks task run has tags (``profile:<name>``,
``gpu:<id>``). Prefect caches a "no limits for this tag set" answer per process
for 5 seconds. Each time that cache expires, the next check goes to the server,
and on a busy SQLite server (thousands of short tasks, the task-run recorder
writing) every task carrying the same tags waits behind that one request. Measured
on 2 cores with 10,000 tagged tasks on Prefect's own ThreadPoolTaskRunner: 141 s
with the 5 s cache, 53 s (linear in the task count) with a longer one.

gpu-tasks lengthens that cache in the flow process and in its worker processes to
``GPU_TASKS_TAG_LIMIT_CACHE_SECONDS`` (default 60; 0 keeps Prefect's). Limits that
exist when a tag set is first checked are always honoured, since only "no limits"
answers are cached; a limit created in the middle of a run applies within that many
seconds instead of 5. The cache is a private part of Prefect: when it is not found
(another Prefect release), nothing is changed and Prefect behaves as it ships.

**Tag slots the flow process holds** (``prefect.task_engine._concurrency`` and
``_aconcurrency``): see :func:`tag_slots_held_by_flow`; the "no limits" cache is read and
written as the engine does (:func:`known_without_limits`, :func:`remember_without_limits`).
The same wrapper answers a check whose tags the cache knows have no limit without calling
Prefect's slot service: the outcome Prefect's own cached path gives (no lease), without its
two thread hops and made-up HTTP response, which were 13% of a worker process's CPU per
task.
**Cache keys computed before a device is leased** (``gpu_tasks._cache``) follow the
engine's ``compute_transaction_key`` and call ``ResultStore.update_for_task(task,
_sync=True)`` as the engine does (its ``async_dispatch`` keyword).

**Names the serializers resolve** (``prefect.serializers.from_qualified_name``): see
:func:`cache_qualified_names`.

**The in-process ephemeral server** (``SubprocessASGIServer._instances``): see
:func:`ephemeral_server_url`.

**The deployment context** (``prefect.context._deployment_id`` and
``_deployment_parameters``): see :func:`deployment_context`.

**The embedded server's process** (``SubprocessASGIServer._run_uvicorn_command``):
see :func:`server_in_own_session_class`; **counting task runs** (the client's
``_client``): see :func:`count_task_runs`.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import subprocess
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

logger = logging.getLogger(__name__)


def extend_no_limits_cache(seconds: float) -> float | None:
    """Make Prefect's per-process "no tag limits" cache keep answers ``seconds`` long.

    Never shortens it. Returns the cache's time-to-live afterwards, or ``None`` when
    this Prefect has no such cache (nothing changed). Where it has one, the task engine's
    tag checks in this process are also answered from it directly (:func:`_left_to_take`).
    """
    try:
        import cachetools
        from prefect.concurrency import services
    except ImportError:  # pragma: no cover - prefect always brings cachetools
        return None
    cache = getattr(services, "_no_limits_cache", None)
    lock = getattr(services, "_cache_lock", None)
    if not isinstance(cache, cachetools.TTLCache) or lock is None:
        logger.debug("gpu-tasks: Prefect has no tag 'no limits' cache here; leaving tag checks as they are")
        return None
    _install_tag_slot_skip()
    if seconds <= cache.ttl:
        return float(cache.ttl)
    with lock:
        longer: cachetools.TTLCache[Any, Any] = cachetools.TTLCache(maxsize=cache.maxsize, ttl=seconds)
        for key, value in cache.items():
            longer[key] = value
        services._no_limits_cache = longer
    return float(seconds)


def ephemeral_server_url() -> str | None:
    """The URL of the ephemeral API server this process started, if one runs.

    Prefect's client starts a ``SubprocessASGIServer`` when there is no
    ``PREFECT_API_URL`` and keeps its URL in no setting; Prefect keeps one instance
    per requested port (the default client asks for port ``None``) in the private
    ``_instances``. Any running instance in this process is the one the flow run
    talks to; the default-port one is preferred.
    """
    from prefect.server.api.server import SubprocessASGIServer

    instances = getattr(SubprocessASGIServer, "_instances", None)
    if not isinstance(instances, dict):  # pragma: no cover - another Prefect release
        logger.debug("gpu-tasks: Prefect has no SubprocessASGIServer._instances here")
        return None
    servers = sorted(instances.values(), key=lambda s: getattr(s, "_instance_key", None) is not None)
    for server in servers:
        process = server.server_process
        if server.running and process is not None and process.poll() is None:
            return str(server.api_url)
    return None


def deployment_context() -> tuple[str | None, Any]:
    """The deployment id (as a string) and parameters of the run in this context.

    Prefect's ``serialize_context`` sends them to remote task runs from the private
    context variables ``_deployment_id`` and ``_deployment_parameters``; gpu-tasks
    serializes context itself (``gpu_tasks._context``) and sends the same.
    """
    from prefect import context as pctx

    deployment_id = pctx._deployment_id.get()
    return (str(deployment_id) if deployment_id else None), pctx._deployment_parameters.get()


class _SubprocessWithPopenArgs:
    """The ``subprocess`` module as Prefect's server module sees it, its Popen given more arguments."""

    def __init__(self, **extra: Any) -> None:
        self._extra = extra

    def Popen(self, *args: Any, **kwargs: Any) -> subprocess.Popen[Any]:
        return subprocess.Popen(*args, **{**kwargs, **self._extra})

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)


def server_in_own_session_class(preexec_fn: Callable[[], None] | None) -> type[Any]:
    """Prefect's ``SubprocessASGIServer``, its server process started in a session of its own.

    Overrides the private ``SubprocessASGIServer._run_uvicorn_command`` and, for that one
    call, swaps the ``subprocess`` module its module sees (prefect 3.8.8), so that Prefect
    still builds the command line and environment. Built on first use so that importing
    gpu-tasks does not import ``prefect.server``.

    Args:
        preexec_fn: run in the server process before it starts (``PR_SET_PDEATHSIG``).
    """
    import prefect.server.api.server as _prefect_server
    from prefect.server.api.server import SubprocessASGIServer

    class EmbeddedServer(SubprocessASGIServer):
        def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
            # The one change to Prefect's server process. A terminal's Ctrl-C sends SIGINT to
            # every process of the foreground process group; a server in that group dies
            # before the interrupted flow run's final states reach it, and they stay
            # "Running" in its database for good. In a session of its own it keeps serving
            # until ``stop()``; PR_SET_PDEATHSIG still kills it with its parent, even when
            # the parent is SIGKILLed. Prefect's method still builds the command line and
            # environment; only the Popen it calls gets ``start_new_session`` and
            # ``preexec_fn``. The swap is visible to that module alone, for this one call.
            extra: dict[str, Any] = {"start_new_session": True}
            if preexec_fn is not None:
                extra["preexec_fn"] = preexec_fn
            vars(_prefect_server)["subprocess"] = _SubprocessWithPopenArgs(**extra)
            try:
                return super()._run_uvicorn_command()
            finally:
                vars(_prefect_server)["subprocess"] = subprocess

    return EmbeddedServer


def count_task_runs(client: Any, task_run_filter: dict[str, Any]) -> int:
    """How many task runs match ``task_run_filter`` (the API's filter JSON), on a sync client.

    Prefect's client has no ``count_task_runs``; the server's ``POST /task_runs/count``
    is reached through the client's private HTTP client ``_client`` (prefect 3.8.8).
    """
    return int(client._client.post("/task_runs/count", json=task_run_filter).json())


# ---------------------------------------------------------------- tag slots the flow process holds
# A GPU task must not hold a device while it waits for a Prefect tag concurrency slot. The flow
# process takes the task run's `tag:<tag>` slots before it leases a device (gpu_tasks._slotgate) and
# holds them until the task ends; the task engine on the worker would take them a second time (and
# wait forever under a limit of 1), so inside `tag_slots_held_by_flow` the engine's own
# acquisition for that task run leaves out the names the flow holds (it still takes the others,
# such as the `gpu:<id>` tags a worker adds). Prefect 3.8.8's task engine takes them with
# `prefect.task_engine._concurrency` / `_aconcurrency(names=[...], holder=ConcurrencyLeaseHolder(
# type="task_run", id=...))`, imported into that module under those private names.
_FLOW_HOLDS: contextvars.ContextVar[tuple[Any, frozenset[str]] | None] = contextvars.ContextVar(
    "gpu_tasks_flow_holds_tag_slots", default=None
)


def can_skip_engine_tag_slots() -> bool:
    """Whether this Prefect's task engine takes tag slots where gpu-tasks can skip them."""
    import prefect.task_engine as engine

    return callable(getattr(engine, "_concurrency", None)) and callable(
        getattr(engine, "_aconcurrency", None)
    )


def _left_to_take(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The engine's ``_concurrency`` arguments less the names the flow process holds for its holder,
    and none at all when this process's "no limits" cache knows those left have no limit."""
    held = _FLOW_HOLDS.get()
    holder = kwargs.get("holder")
    if holder is None or getattr(holder, "type", None) != "task_run":
        return args, kwargs
    names = kwargs.get("names", args[0] if args else [])
    names = [names] if isinstance(names, str) else list(names)
    if held is not None and getattr(holder, "id", None) == held[0]:
        names = [n for n in names if n not in held[1]]
    if names and all(n.startswith("tag:") for n in names) and known_without_limits(names):
        # what Prefect's own check would answer from the same cache (no lease, no limits), without
        # its two thread hops and a made-up HTTP response: ~13% of a worker's CPU per task
        names = []
    return (), {**kwargs, "names": names}


def _install_tag_slot_skip() -> None:
    import prefect.task_engine as engine

    if getattr(engine, "_gpu_tasks_tag_slot_skip", False) or not can_skip_engine_tag_slots():
        return
    sync_cm = getattr(engine, "_concurrency")  # noqa: B009 - not exported by Prefect
    async_cm = getattr(engine, "_aconcurrency")  # noqa: B009

    @contextlib.contextmanager
    def concurrency(*args: Any, **kwargs: Any) -> Iterator[None]:
        args, kwargs = _left_to_take(args, kwargs)
        with sync_cm(*args, **kwargs):  # no names left: Prefect's returns at once
            yield

    @contextlib.asynccontextmanager
    async def aconcurrency(*args: Any, **kwargs: Any) -> AsyncIterator[None]:
        args, kwargs = _left_to_take(args, kwargs)
        async with async_cm(*args, **kwargs):
            yield

    setattr(engine, "_concurrency", concurrency)  # noqa: B010 - a private name of Prefect's module
    setattr(engine, "_aconcurrency", aconcurrency)  # noqa: B010
    setattr(engine, "_gpu_tasks_tag_slot_skip", True)  # noqa: B010


@contextlib.contextmanager
def tag_slots_held_by_flow(task_run_id: Any, names: Iterable[str]) -> Iterator[None]:
    """Within the block, the task engine takes no slot of ``names`` for ``task_run_id`` (the flow
    process holds them, or knows they have no limit)."""
    held = frozenset(names)
    _install_tag_slot_skip()  # also answers tag checks from the "no limits" cache (_left_to_take)
    if not held:
        yield
        return
    token = _FLOW_HOLDS.set((task_run_id, held))
    try:
        yield
    finally:
        _FLOW_HOLDS.reset(token)


def _no_limits() -> tuple[Any, Any] | None:
    """Prefect's "no limits for this tag set" cache and its lock (``None`` on another release)."""
    from prefect.concurrency import services

    cache = getattr(services, "_no_limits_cache", None)
    lock = getattr(services, "_cache_lock", None)
    return None if cache is None or lock is None else (cache, lock)


def known_without_limits(names: list[str]) -> bool:
    """Whether this process's cached answer says the concurrency limits ``names`` do not exist.

    Prefect's ``prefect.concurrency.services._no_limits_cache`` (keyed by the frozenset of
    names; see :func:`extend_no_limits_cache`). ``False`` when unknown or absent.
    """
    found = _no_limits()
    if found is None:
        return False
    with found[1]:
        return bool(found[0].get(frozenset(names), False))


def remember_without_limits(names: list[str]) -> None:
    """Record in that cache that the limits ``names`` do not exist, as Prefect's engine does."""
    found = _no_limits()
    if found is not None:
        with found[1]:
            found[0][frozenset(names)] = True


_QUALIFIED_KEEP = 512


def cache_qualified_names() -> bool:
    """Let Prefect's serializers in this process resolve each qualified name once.

    ``JSONSerializer.dumps`` resolves its ``object_encoder``
    (``prefect.serializers.prefect_json_object_encoder``) by name at every call, and
    ``from_qualified_name`` first tries to import that name as a module: a failed import,
    with the import lock and a search of ``sys.path``, for every cache key the task engine
    computes (each task run with a cache policy: Prefect's default one). That was 10% of a
    worker process's CPU per task. Called in gpu-tasks' worker processes only; the flow
    process is left as Prefect ships. Returns whether the serializers now use the cache
    (``False`` on a Prefect without that name: nothing changed).
    """
    import threading

    try:
        import prefect.serializers as serializers
    except ImportError:  # pragma: no cover - part of every prefect
        return False
    resolve = getattr(serializers, "from_qualified_name", None)
    if resolve is None:
        return False
    if getattr(resolve, "_gpu_tasks_cached", False):
        return True
    found: dict[str, Any] = {}
    lock = threading.Lock()

    def cached(name: str) -> Any:
        with lock:
            if name in found:
                return found[name]
        value = resolve(name)  # raises as Prefect's does for a name that does not resolve
        with lock:
            if len(found) < _QUALIFIED_KEEP:
                found[name] = value
        return value

    cached._gpu_tasks_cached = True  # type: ignore[attr-defined]  # a marker on the function
    setattr(serializers, "from_qualified_name", cached)  # noqa: B010 - not exported by Prefect
    return True
