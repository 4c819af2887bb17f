"""The embedded Prefect server: :func:`embedded_server` and the process it runs in.

Without ``PREFECT_API_URL``, ``gpu-tasks run``, the benchmarks and scripts that use
:func:`embedded_server` get a Prefect server on 127.0.0.1 for the duration of a
``with`` block. Its process is kept out of the terminal's Ctrl-C and never outlives
its parent (:func:`embedded_server_class`).

``prefect.server`` takes about 2 s to import; it is imported only when a server is
actually started, so ``gpu-tasks serve`` and the benchmarks that import this module
(and find ``PREFECT_API_URL`` set) need not pay for it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent_hook() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel SIGKILL the child when its parent goes (Linux).

    ``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child ends, not only
    the process: the server is started from the thread that enters ``embedded_server``
    (the CLI's main thread), which outlives the context. Entering it from a short-lived
    thread would kill the server when that thread ends. Returns ``None`` where there is
    no ``prctl`` (macOS, Windows): there only the context's ``finally`` and Prefect's
    ``atexit`` hook stop the server, and a SIGKILL of the parent can orphan it.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved now: nothing is loaded after fork
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl: no signal will come
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


class _SubprocessWithPopenArgs:
    """The ``subprocess`` module as Prefect's server module sees it, its Popen given more arguments."""

    def __init__(self, **extra: Any) -> None:
        self._extra = extra

    def Popen(self, *args: Any, **kwargs: Any) -> subprocess.Popen[Any]:  # noqa: N802 (subprocess's name)
        return subprocess.Popen(*args, **{**kwargs, **self._extra})

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)


@functools.cache
def embedded_server_class() -> type[Any]:
    """``EmbeddedServer``: Prefect's ``SubprocessASGIServer`` in a session of its own that dies with its parent.

    Built on first use so that importing this module does not import ``prefect.server``.
    """
    import prefect.server.api.server as _prefect_server
    from prefect.server.api.server import SubprocessASGIServer

    class EmbeddedServer(SubprocessASGIServer):  # type: ignore[misc]
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
            hook = die_with_parent_hook()
            if hook is not None:
                extra["preexec_fn"] = hook
            _prefect_server.subprocess = _SubprocessWithPopenArgs(**extra)  # type: ignore[assignment]
            try:
                return super()._run_uvicorn_command()
            finally:
                _prefect_server.subprocess = subprocess

    return EmbeddedServer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


INTERRUPT_DRAIN_S = 2.0  # per service (events, logs): Ctrl-C must exit well within 10 s
INTERRUPT_RECORD_S = 2.0  # for the server to write the interrupted run's last states


@contextlib.contextmanager
def embedded_server(timeout: int = 120) -> Iterator[str]:
    """Use ``PREFECT_API_URL`` when set; otherwise start a Prefect server on 127.0.0.1.

    The server started here uses SQLite. Thousands of short tasks keep its single
    writer busy: the task-run recorder and tag-concurrency checks wait on each other,
    and with Prefect's defaults (10 s statement timeout, 5 client retries) a busy
    moment turns into ``503 Service Unavailable`` and a failed task. So the server
    gets a 60 s statement timeout and this run's clients (workers included: they
    inherit the run's settings) retry up to 10 times. A server you run yourself
    (``PREFECT_API_URL``) keeps its own settings.

    When the run ends, the server is stopped once it has recorded every task run's
    final state (up to 15 s). The server runs in its own session, so a terminal's
    Ctrl-C does not reach it; on Ctrl-C (``KeyboardInterrupt``) the queued events and
    logs are sent and the server gets ``INTERRUPT_RECORD_S`` to record them before it
    is stopped, so the interrupted flow run ends ``Crashed`` in its database and the
    command still exits within seconds. The server dies with the process that started
    it, even when that process is killed (Linux; see :func:`embedded_server_class`).
    """
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_CLIENT_MAX_RETRIES,
        PREFECT_SERVER_DATABASE_TIMEOUT,
        get_current_settings,
        temporary_settings,
    )

    current = get_current_settings().api.url
    if current:
        yield str(current)
        return
    with temporary_settings(updates={PREFECT_SERVER_DATABASE_TIMEOUT: max(
            60.0, get_current_settings().server.database.timeout or 0.0)}):
        server = embedded_server_class()(port=_free_port())
        server.start(timeout=timeout)
    try:
        with temporary_settings(updates={
            PREFECT_API_URL: server.api_url,
            PREFECT_CLIENT_MAX_RETRIES: max(10, get_current_settings().client.max_retries),
        }):
            interrupted = False  # a failed run is worth recording too: it is what the user will look at
            try:
                yield server.api_url
            except BaseException as exc:
                interrupted = not isinstance(exc, Exception)  # Ctrl-C: record it, but briefly
                raise
            finally:
                drain_s, record_s = (INTERRUPT_DRAIN_S, INTERRUPT_RECORD_S) if interrupted else (5.0, 15.0)
                _drain(timeout=drain_s)
                _wait_until_recorded(timeout=record_s)
    finally:
        server.stop()


def _drain(timeout: float = 5) -> None:
    """Send the run's last events and logs while the server is up (at most ``timeout`` s each)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    EventsWorker.drain_all(timeout=timeout)
    APILogWorker.drain_all(timeout=timeout)


def _wait_until_recorded(timeout: float) -> bool:
    """Wait, at most ``timeout`` s, until the server has recorded the task runs' final states.

    Task run states reach the server as events and are written by its task-run
    recorder in batches; stopping the server in the middle leaves the last task runs
    "Running" in its database for good. Done: no task run is Running and the number
    of task runs has stopped changing.
    """
    from prefect.client.orchestration import get_client

    running = {"task_runs": {"state": {"type": {"any_": ["RUNNING"]}}}}
    deadline = time.monotonic() + timeout
    last = -1
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            try:
                busy = client._client.post("/task_runs/count", json=running).json()
                total = client._client.post("/task_runs/count", json={}).json()
            except Exception:  # the run is over; an unreachable server is not its failure
                return False
            if busy == 0 and total == last:
                return True
            last = total
            time.sleep(0.2)
    return False
