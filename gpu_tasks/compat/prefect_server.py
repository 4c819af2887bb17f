"""Prefect's client internals gpu-tasks uses around a server: draining the events and logs a process
queued, and counting the events still waiting to be sent.

Part of the compat layer (:mod:`gpu_tasks.compat`).
"""

from __future__ import annotations

from typing import Any

from gpu_tasks.compat import Use, params


def drain_events(timeout: float) -> bool:
    """Send the events this process queued (``EventsWorker.drain_all``, undocumented); whether all
    were sent within ``timeout``."""
    from prefect.events.worker import EventsWorker

    return _all_done(EventsWorker.drain_all(timeout=timeout))


def drain_logs(timeout: float) -> bool:
    """Send the run logs this process queued (``APILogWorker.drain_all``, undocumented); whether
    all were sent within ``timeout``."""
    from prefect.logging.handlers import APILogWorker

    return _all_done(APILogWorker.drain_all(timeout=timeout))


def _all_done(waited: Any) -> bool:
    """``drain_all`` outside an event loop returns ``concurrent.futures.wait``'s (done, not done)."""
    return not (isinstance(waited, tuple) and len(waited) == 2 and waited[1])


def events_backlog() -> int:
    """Events this process has emitted and Prefect's ``EventsWorker`` has not yet sent to the server
    (private: ``_QueueServiceBase._instances`` and each worker's ``_context_cache``, the copy of
    the run context it keeps per event until it sends it; 0 when none runs). Its ``_queue`` alone
    stays short: events move on to its event loop at once and wait there."""
    from prefect.events.worker import EventsWorker

    instances = list(getattr(EventsWorker, "_instances", {}).values())
    return sum(len(w._context_cache) for w in instances if isinstance(w, EventsWorker))


def _check_events_backlog() -> str | None:
    from prefect.events.worker import EventsWorker

    if not isinstance(getattr(EventsWorker, "_instances", None), dict):
        return "EventsWorker has no _instances dict"
    init = vars(EventsWorker).get("__init__")
    names = getattr(getattr(init, "__code__", None), "co_names", ())  # prefect 3.8.8
    return None if "_context_cache" in names else "EventsWorker no longer keeps _context_cache"


# ---------------------------------------------------------------- the uses, with feature checks
def _check_drains() -> str | None:
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    return params(EventsWorker.drain_all, "timeout") or params(APILogWorker.drain_all, "timeout")


USES = [
    Use(
        "prefect",
        "prefect.events.worker.EventsWorker (drain_all, _instances, _context_cache), "
        "prefect.logging.handlers.APILogWorker.drain_all",
        "private",
        "Prefect's queue services of events and logs: send a run's last events and logs before a "
        "process or the embedded server stops (drain_all), and count the events waiting to be sent "
        "(_instances, _context_cache: task runs wait to start while too many do)",
        lambda: _check_drains() or _check_events_backlog(),
    ),
]
