"""Prefect's server and client internals gpu-tasks uses: the ephemeral server's URL, the embedded
server in a session of its own, counting task runs, and draining queued events and logs.

Part of the compat layer (:mod:`gpu_tasks.compat`).
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import threading
from collections.abc import Callable
from typing import Any

from gpu_tasks.compat import Use, attr, params, warn_if_changed

logger = logging.getLogger(__name__)


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


class _SubprocessWithPopenArgs:
    """The ``subprocess`` module as Prefect's server module sees it, its Popen given more arguments."""

    def __init__(self, **extra: Any) -> None:
        self._extra = extra

    def Popen(self, *args: Any, **kwargs: Any) -> subprocess.Popen[Any]:
        return subprocess.Popen(*args, **{**kwargs, **self._extra})

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)


def server_in_own_session_class(
    preexec_fn: Callable[[], None] | None, stderr_line: Callable[[bytes], None] | None = None
) -> type[Any]:
    """Prefect's ``SubprocessASGIServer``, its server process started in a session of its own.

    Overrides the private ``SubprocessASGIServer._run_uvicorn_command`` and, for that one
    call, swaps the ``subprocess`` module its module sees (prefect 3.8.8), so that Prefect
    still builds the command line and environment. Built on first use so that importing
    gpu-tasks does not import ``prefect.server``.

    Args:
        preexec_fn: run in the server process before it starts (``PR_SET_PDEATHSIG``).
        stderr_line: given each line the server process writes to its stderr (from a daemon
            thread that reads it as it comes, so the pipe never fills).
    """
    import prefect.server.api.server as _prefect_server
    from prefect.server.api.server import SubprocessASGIServer

    warn_if_changed()  # the server's private names, now that the process uses them

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
            if stderr_line is not None:
                extra["stderr"] = subprocess.PIPE
            vars(_prefect_server)["subprocess"] = _SubprocessWithPopenArgs(**extra)
            try:
                process = super()._run_uvicorn_command()
            finally:
                vars(_prefect_server)["subprocess"] = subprocess
            if stderr_line is not None and process.stderr is not None:
                threading.Thread(
                    target=_read_lines,
                    args=(process.stderr, stderr_line),
                    name="gpu-tasks-server-stderr",
                    daemon=True,
                ).start()
            return process

    return EmbeddedServer


def _read_lines(stream: Any, each: Callable[[bytes], None]) -> None:
    with contextlib.suppress(OSError, ValueError):  # closed with the process
        for line in iter(stream.readline, b""):
            each(line)


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
def _check_asgi_server() -> str | None:
    import prefect.server.api.server as server_module
    from prefect.server.api.server import SubprocessASGIServer

    return (
        attr(SubprocessASGIServer, "_instances", dict)
        or params(SubprocessASGIServer._run_uvicorn_command, "self")
        or attr(server_module, "subprocess")
        or attr(SubprocessASGIServer, "stop")
        or next(
            (
                f"SubprocessASGIServer no longer sets {a}"
                for a in ("running", "server_process", "_instance_key")
                if a not in SubprocessASGIServer.__init__.__code__.co_names
            ),
            None,
        )
    )


def _check_drains() -> str | None:
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    return params(EventsWorker.drain_all, "timeout") or params(APILogWorker.drain_all, "timeout")


USES = [
    Use(
        "prefect",
        "prefect.server.api.server.SubprocessASGIServer (_instances, _run_uvicorn_command)",
        "private",
        "the ephemeral server's URL for workers; the embedded server in its own session",
        _check_asgi_server,
        needs="prefect.server.api.server",  # imported by Prefect's ephemeral mode or a server start
    ),
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
