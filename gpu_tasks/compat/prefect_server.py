"""Prefect's event and log services: draining what a process queued, counting the events still
unsent, and a slim run context for each event of gpu-tasks' task runs.
"""

from __future__ import annotations

import contextvars
import functools
import threading
from typing import Any

from gpu_tasks.compat import Use, called_in, code_names, params


def drain_events(timeout: float) -> bool:
    """Send the events this process queued; whether all were sent within ``timeout``."""
    from prefect.events.worker import EventsWorker

    return _drained(EventsWorker, timeout)


def drain_logs(timeout: float) -> bool:
    """Send the run logs this process queued; whether all were sent within ``timeout``."""
    from prefect.logging.handlers import APILogWorker

    return _drained(APILogWorker, timeout)


def _drained(service: Any, timeout: float) -> bool:
    # outside an event loop drain_all returns concurrent.futures.wait's (done, not done)
    waited = service.drain_all(timeout=timeout)
    return not (isinstance(waited, tuple) and len(waited) == 2 and waited[1])


def events_backlog() -> int:
    """Events this process emitted and ``EventsWorker`` has not yet sent: a context per unsent event
    in ``_context_cache`` (its ``_queue`` stays short, as events move on to its loop at once)."""
    from prefect.events.worker import EventsWorker

    instances = list(getattr(EventsWorker, "_instances", {}).values())
    return sum(len(w._context_cache) for w in instances if isinstance(w, EventsWorker))


def _check_events_backlog() -> str | None:
    from prefect.events.worker import EventsWorker

    if not isinstance(getattr(EventsWorker, "_instances", None), dict):
        return "EventsWorker has no _instances dict"
    init = vars(EventsWorker).get("__init__")
    names = getattr(getattr(init, "__code__", None), "co_names", ())
    return None if "_context_cache" in names else "EventsWorker no longer keeps _context_cache"


_SLIM: dict[Any, Any] = {}  # task run id -> its context; ("flow", flow run id) -> flow-run context
_SLIM_LOCK = threading.Lock()
_SLIM_KEEP = 1024


def keep_slim_event_contexts() -> bool:
    """Each event of gpu-tasks' task runs waits to be sent with a slim run context (flow run, task run
    without its state, settings), not Prefect's whole copy with parameters, results and engines.
    Returns whether the slim copy is in use."""
    from prefect.events.worker import EventsWorker

    prepare = vars(EventsWorker).get("_prepare_item")
    if getattr(prepare, "_gpu_tasks_slim", False):
        return True
    if prepare is None or _check_event_contexts() is not None:
        return False
    from gpu_tasks.compat.prefect import is_ours

    @functools.wraps(prepare)  # its __wrapped__: the compat check reads Prefect's own code
    def slim_prepare(self: Any, event: Any) -> Any:
        if not is_ours():
            return prepare(self, event)
        self._context_cache[event.id] = _slim_context()
        return event

    slim_prepare._gpu_tasks_slim = True  # type: ignore[attr-defined]
    EventsWorker._prepare_item = slim_prepare  # type: ignore[method-assign]
    return True


def _slim_context() -> contextvars.Context:
    from prefect.context import FlowRunContext, SettingsContext, TaskRunContext

    task_run = getattr(TaskRunContext.get(), "task_run", None)
    key = getattr(task_run, "id", None)
    with _SLIM_LOCK:
        hit = _SLIM.get(key) if key is not None else None
    if isinstance(hit, contextvars.Context):
        return hit
    values: list[tuple[Any, Any]] = []
    settings = SettingsContext.get()
    if settings is not None:
        values.append((SettingsContext, settings))  # one per process or flow run: shared
    flow_run = getattr(FlowRunContext.get(), "flow_run", None)
    if flow_run is not None:
        values.append((FlowRunContext, _slim_flow_context(flow_run)))
    if task_run is not None:
        # a shallow copy without its state (the state holds the result); the fields the context
        # model would otherwise compute (start_time, persist_result: a settings read) are given
        slim_run = task_run.model_copy(update={"state": None})
        slim = TaskRunContext.model_construct(task_run=slim_run, start_time=None, persist_result=False)
        values.append((TaskRunContext, slim))
    context = contextvars.Context()
    for kind, value in values:
        context.run(kind.__var__.set, value)  # a context model's variable (private: __var__)
    if key is not None:
        with _SLIM_LOCK:
            if len(_SLIM) >= _SLIM_KEEP:
                _SLIM.clear()
            _SLIM[key] = context
    return context


def _slim_flow_context(flow_run: Any) -> Any:
    """One flow-run context holding ``flow_run`` alone, per flow run (built once, shared)."""
    from prefect.context import FlowRunContext

    key = ("flow", flow_run.id)
    with _SLIM_LOCK:
        hit = _SLIM.get(key)
    if hit is None:
        hit = FlowRunContext.model_construct(
            flow_run=flow_run, start_time=None, persist_result=False, flow_run_suspension_request=None
        )
        with _SLIM_LOCK:
            _SLIM[key] = hit
    return hit


def _check_event_contexts() -> str | None:
    """The events worker keeps a context per event and reads related resources from the flow-run and
    task-run contexts alone: what the slim context carries."""
    from prefect.context import FlowRunContext, SettingsContext, TaskRunContext
    from prefect.events import related
    from prefect.events.worker import EventsWorker

    for kind in (FlowRunContext, SettingsContext, TaskRunContext):
        if not isinstance(getattr(kind, "__var__", None), contextvars.ContextVar):
            return f"{kind.__name__} has no __var__ context variable"
    read = {n for n in code_names(related.related_resources_from_run_context) if n.endswith("Context")}
    if read != {"FlowRunContext", "TaskRunContext"}:
        return f"related_resources_from_run_context reads {sorted(read)}, not the flow and task run contexts"
    return (
        called_in(EventsWorker._prepare_item, "copy_context")
        or called_in(EventsWorker._handle, "temporary_context")
        or called_in(EventsWorker._handle, "attach_related_resources_from_context")
        or called_in(EventsWorker.attach_related_resources_from_context, "related_resources_from_run_context")
    )


def _check_drains() -> str | None:
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    return params(EventsWorker.drain_all, "timeout") or params(APILogWorker.drain_all, "timeout")


USES = [
    Use(
        "prefect",
        "prefect.events.worker.EventsWorker (drain_all, _instances, _context_cache, _prepare_item), "
        "prefect.logging.handlers.APILogWorker.drain_all, prefect.context's context models' __var__",
        "private",
        "send a run's last events and logs before a process stops (drain_all), count the events "
        "waiting to be sent (task runs wait while too many do), and keep a slim run context per event "
        "of gpu-tasks' task runs (_prepare_item patched, __var__ set)",
        lambda: _check_drains() or _check_events_backlog() or _check_event_contexts(),
    ),
]
