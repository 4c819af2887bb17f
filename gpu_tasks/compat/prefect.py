"""The private Prefect task-engine APIs gpu-tasks relies on; each wrapper degrades to Prefect's own
behaviour where the name is gone (docs/runner.md, "Tagged task runs and Prefect's tag-limit checks").
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

from gpu_tasks.compat import Use, callables, called_in, code_names, code_strings, params

logger = logging.getLogger(__name__)


# gpu-tasks' own "no limits for this tag set" answers, for its own task runs alone (:func:`ours`).
_OWN_NO_LIMITS: dict[str, Any] = {}
_OWN_LOCK = threading.Lock()


def use_no_limits_cache(seconds: float, ask_limited: Callable[[list[str]], set[str]] | None = None) -> float:
    """Keep gpu-tasks' own "no tag limits" answers ``seconds`` long, learning unknown tag sets from
    ``ask_limited(names)``; returns the time-to-live in force (never shortened within a process)."""
    import cachetools

    _install_tag_slot_skip()
    with _OWN_LOCK:
        if ask_limited is not None and seconds > 0:
            _OWN_NO_LIMITS["ask"] = ask_limited
        cache = _OWN_NO_LIMITS.get("cache")
        if cache is None or seconds > cache.ttl:
            longer: cachetools.TTLCache[Any, Any] = cachetools.TTLCache(maxsize=1000, ttl=max(seconds, 0.001))
            if cache is not None:
                longer.update(cache.items())
            _OWN_NO_LIMITS["cache"] = cache = longer
        return float(cache.ttl)


def remembered_tag_sets() -> tuple[float, list[frozenset[str]]]:
    """gpu-tasks' own cache: its time-to-live and the tag sets it holds an answer for."""
    with _OWN_LOCK:
        cache = _OWN_NO_LIMITS.get("cache")
        return (float(cache.ttl), list(cache.keys())) if cache is not None else (0.0, [])


def renew_answers(renew: Iterable[frozenset[str]], drop: Iterable[frozenset[str]]) -> int:
    """Restart these answers' time-to-live, forget those; how many renewed. ``renew`` was just read to
    have no limit: an answer that expired during that read comes back, one a task run turned to "ask
    Prefect" meanwhile (a limit found, or no answer) stays so."""
    with _OWN_LOCK:
        cache = _OWN_NO_LIMITS.get("cache")
        if cache is None:
            return 0
        for key in drop:
            cache.pop(key, None)
        kept = [key for key in renew if cache.get(key) is not False]
        cache.update(dict.fromkeys(kept, True))
    return len(kept)


# The layout of Prefect's ``serialize_context()``, which gpu-tasks builds for its workers.
CONTEXT_KEYS = frozenset(
    {
        "flow_run_context",
        "task_run_context",
        "tags_context",
        "settings_context",
        "asset_context",
        "deployment_id",
        "deployment_parameters",
    }
)


def context_for_workers(**parts: Any) -> dict[str, Any]:
    """What Prefect's ``serialize_context()`` returns, from its parts (:data:`CONTEXT_KEYS`, by name):
    the one place gpu-tasks copies that layout. ``TypeError`` for a part missing or unknown."""
    if set(parts) != CONTEXT_KEYS:
        raise TypeError(f"Prefect's serialized context has {sorted(CONTEXT_KEYS)}; got {sorted(parts)}")
    return dict(parts)


# The `tag:<tag>` slots the flow process took for a task run before its device was leased: the
# engine's own acquisition leaves them out inside `tag_slots_held_by_flow`, never waiting twice.
_FLOW_HOLDS: contextvars.ContextVar[tuple[Any, frozenset[str]] | None] = contextvars.ContextVar(
    "gpu_tasks_flow_holds_tag_slots", default=None
)
# True inside a task run gpu-tasks runs: what gpu-tasks changes in Prefect applies there alone.
_OURS: contextvars.ContextVar[bool] = contextvars.ContextVar("gpu_tasks_runs_this_task", default=False)


def is_ours() -> bool:
    """Whether the code runs inside a task run gpu-tasks runs."""
    return _OURS.get()


@contextlib.contextmanager
def ours() -> Iterator[None]:
    """Within the block, a task run gpu-tasks runs (the engine is called inside it)."""
    token = _OURS.set(True)
    try:
        yield
    finally:
        _OURS.reset(token)


def can_skip_engine_tag_slots() -> bool:
    """Whether this Prefect's task engine takes tag slots where gpu-tasks can skip them."""
    import prefect.task_engine as engine

    return callables(engine, "prefect.task_engine", "_concurrency", "_aconcurrency") is None


def _left_to_take(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The engine's ``_concurrency`` arguments less the names the flow process holds for its holder
    (none when the "no limits" cache knows those left have no limit)."""
    held = _FLOW_HOLDS.get()
    holder = kwargs.get("holder")
    if not _OURS.get() or holder is None or getattr(holder, "type", None) != "task_run":
        return args, kwargs  # not a task run gpu-tasks runs: as Prefect ships
    names = kwargs.get("names", args[0] if args else [])
    names = [names] if isinstance(names, str) else list(names)
    if held is not None and getattr(holder, "id", None) == held[0]:
        names = [n for n in names if n not in held[1]]
    if names and all(n.startswith("tag:") for n in names) and known_without_limits(names):
        names = []  # Prefect's own answer from its cache, without its thread hops
    return (), {**kwargs, "names": names}


def _busy_wait(kwargs: dict[str, Any]) -> Any:
    """How a gpu-tasks task run's tag-slot check waits out a busy API (``None``: as Prefect ships)."""
    if not _OURS.get() or not kwargs.get("names"):
        return None
    from gpu_tasks.compat.api_busy import BusyWait

    return BusyWait(f"the tag-slot check of {list(kwargs['names'])}")


_ENGINE_ORIGINALS: dict[str, Any] = {}  # Prefect's own, once gpu-tasks' wrappers are installed


def _learn(kwargs: dict[str, Any]) -> None:
    """After Prefect's check of a gpu-tasks task run's tags, learn an unknown tag set's answer."""
    names = kwargs.get("names")
    if not _OURS.get() or not names or isinstance(names, str) or not all(n.startswith("tag:") for n in names):
        return
    key = frozenset(names)
    with _OWN_LOCK:
        own, ask = _OWN_NO_LIMITS.get("cache"), _OWN_NO_LIMITS.get("ask")
        if own is None or ask is None or key in own:
            return
    try:
        known = not ask(sorted(key))
    except Exception:  # a busy or unreachable server: Prefect's check, without a read per task run
        logger.debug("gpu-tasks: could not read the limits of %s", sorted(key), exc_info=True)
        known = False  # asked again once this answer expires
    with _OWN_LOCK:
        own[key] = known


def _install_tag_slot_skip() -> None:
    import prefect.task_engine as engine

    if getattr(engine, "_gpu_tasks_tag_slot_skip", False) or not can_skip_engine_tag_slots():
        return
    sync_cm = getattr(engine, "_concurrency")  # noqa: B009 - not exported by Prefect
    async_cm = getattr(engine, "_aconcurrency")  # noqa: B009
    _ENGINE_ORIGINALS.update(_concurrency=sync_cm, _aconcurrency=async_cm)

    @contextlib.contextmanager
    def concurrency(*args: Any, **kwargs: Any) -> Iterator[None]:
        args, kwargs = _left_to_take(args, kwargs)
        with contextlib.ExitStack() as stack:
            wait = _busy_wait(kwargs)
            while True:
                try:
                    stack.enter_context(sync_cm(*args, **kwargs))  # no names left: returns at once
                    break
                except Exception as exc:
                    if wait is None:
                        raise
                    time.sleep(wait.next_wait(exc))
            _learn(kwargs)
            yield

    @contextlib.asynccontextmanager
    async def aconcurrency(*args: Any, **kwargs: Any) -> AsyncIterator[None]:
        args, kwargs = _left_to_take(args, kwargs)
        async with contextlib.AsyncExitStack() as stack:
            wait = _busy_wait(kwargs)
            while True:
                try:
                    await stack.enter_async_context(async_cm(*args, **kwargs))
                    break
                except Exception as exc:
                    if wait is None:
                        raise
                    await asyncio.sleep(wait.next_wait(exc))
            _learn(kwargs)
            yield

    setattr(engine, "_concurrency", concurrency)  # noqa: B010 - a private name of Prefect's module
    setattr(engine, "_aconcurrency", aconcurrency)  # noqa: B010
    setattr(engine, "_gpu_tasks_tag_slot_skip", True)  # noqa: B010


@contextlib.contextmanager
def tag_slots_held_by_flow(task_run_id: Any, names: Iterable[str]) -> Iterator[None]:
    """Within the block, the task engine takes no slot of ``names`` for ``task_run_id`` (the flow
    process holds them)."""
    held = frozenset(names)
    _install_tag_slot_skip()
    with ours():
        token = _FLOW_HOLDS.set((task_run_id, held)) if held else None
        try:
            yield
        finally:
            if token is not None:
                _FLOW_HOLDS.reset(token)


def known_without_limits(names: list[str]) -> bool:
    """Whether gpu-tasks' own cache says the concurrency limits ``names`` do not exist."""
    with _OWN_LOCK:
        own = _OWN_NO_LIMITS.get("cache")
        return own is not None and bool(own.get(frozenset(names), False))


def remember_without_limits(names: list[str]) -> None:
    """Record in gpu-tasks' own cache that the limits ``names`` do not exist."""
    with _OWN_LOCK:
        own = _OWN_NO_LIMITS.get("cache")
        if own is not None:
            own[frozenset(names)] = True


_QUALIFIED_KEEP = 512


def cache_qualified_names() -> bool:
    """Let Prefect's serializers resolve each qualified name once in gpu-tasks' task runs (each
    resolution tries a failed module import); returns whether they now use the cache."""
    import prefect.serializers as serializers

    resolve = getattr(serializers, "from_qualified_name", None)
    if resolve is None:
        return False
    if getattr(resolve, "_gpu_tasks_cached", False):
        return True
    found: dict[str, Any] = {}
    lock = threading.Lock()

    def cached(name: str) -> Any:
        if not _OURS.get():
            return resolve(name)
        with lock:
            if name in found:
                return found[name]
        value = resolve(name)
        with lock:
            if len(found) < _QUALIFIED_KEEP:
                found[name] = value
        return value

    cached._gpu_tasks_cached = True  # type: ignore[attr-defined]
    setattr(serializers, "from_qualified_name", cached)  # noqa: B010 - not exported by Prefect
    return True


def skip_crash_reports(skip: Callable[[], bool], say: Callable[[Any], None]) -> None:
    """Prefect's task engines, sync and async, report no ``Crashed`` state while ``skip()`` is true in
    the crashing thread; ``say(task_run)`` is called instead."""
    from prefect.task_engine import AsyncTaskRunEngine, SyncTaskRunEngine

    sync_original, async_original = SyncTaskRunEngine.handle_crash, AsyncTaskRunEngine.handle_crash

    def skipped(self: Any, exc: BaseException) -> bool:
        if not skip():
            return False
        say(self.task_run)
        self._raised = exc
        return True

    def handle_crash(self: Any, exc: BaseException) -> None:
        if not skipped(self, exc):
            sync_original(self, exc)

    async def ahandle_crash(self: Any, exc: BaseException) -> None:
        if not skipped(self, exc):
            await async_original(self, exc)

    for engine, patched in ((SyncTaskRunEngine, handle_crash), (AsyncTaskRunEngine, ahandle_crash)):
        if not getattr(engine.handle_crash, "_gpu_tasks_skip", False):
            patched._gpu_tasks_skip = True  # type: ignore[union-attr]
            setattr(engine, "handle_crash", patched)  # noqa: B010 - an engine internal


def _check_handle_crash() -> str | None:
    from prefect import task_engine

    for name in ("SyncTaskRunEngine", "AsyncTaskRunEngine"):
        engine = getattr(task_engine, name)
        unused = called_in(engine, "handle_crash")  # a crash reported elsewhere would skip the patch
        if unused:
            return unused
        if not hasattr(engine, "_raised") and "_raised" not in getattr(engine, "__dataclass_fields__", {}):
            return f"{name} has no _raised"
        problem = params(engine.handle_crash, "self", "exc")
        if problem:
            return f"{name}.handle_crash: {problem}"
    return None


def _check_engine_concurrency() -> str | None:
    import prefect.task_engine as engine

    for name in ("_concurrency", "_aconcurrency"):
        fn = _ENGINE_ORIGINALS.get(name, getattr(engine, name, None))  # Prefect's, not gpu-tasks' wrapper
        if fn is None:
            return f"prefect.task_engine has no {name}"
        problem = params(getattr(fn, "__wrapped__", fn), "names", "holder")
        if problem:
            return f"{name}: {problem}"
    # the engines must still take tag slots there, else a worker waits for a slot its own flow
    # holds (f"tag:{tag}" leaves its "tag:" among the classes' constants)
    for cls_name, call in (("SyncTaskRunEngine", "_concurrency"), ("AsyncTaskRunEngine", "_aconcurrency")):
        cls = getattr(engine, cls_name, None)
        if cls is None or call not in code_names(cls) or "tag:" not in code_strings(cls):
            return f"prefect.task_engine.{cls_name} no longer takes its tag slots through {call}"
    return None


def _check_context_layout() -> str | None:
    from prefect.context import serialize_context

    keys = set(serialize_context())
    if keys != CONTEXT_KEYS:
        return f"serialize_context() returns {sorted(keys)}; gpu-tasks builds {sorted(CONTEXT_KEYS)}"
    return None


def _check_serializers() -> str | None:
    import prefect.serializers as serializers

    return params(getattr(serializers, "from_qualified_name", None), "name") or called_in(
        serializers.JSONSerializer.dumps, "from_qualified_name"
    )


USES = [
    Use(
        "prefect",
        "prefect.task_engine._concurrency / _aconcurrency",
        "private",
        "the engine's tag-slot acquisition, wrapped (gpu-tasks' task runs only) to leave out slots "
        "the flow process holds and tags known to have no limit",
        _check_engine_concurrency,
    ),
    Use(
        "prefect",
        "prefect.context.serialize_context (its layout)",
        "undocumented",
        "the flow run's context for workers, built with the settings serialized once per flow run",
        _check_context_layout,
    ),
    Use(
        "prefect",
        "prefect.serializers.from_qualified_name",
        "patched",
        "resolved once per name in gpu-tasks' task runs (a failed import per cache key otherwise)",
        _check_serializers,
    ),
    Use(
        "prefect",
        "prefect.task_engine.SyncTaskRunEngine.handle_crash, AsyncTaskRunEngine.handle_crash",
        "patched",
        "an attempt interrupted as its worker lost its scheduler reports no Crashed over its retry",
        _check_handle_crash,
    ),
]
