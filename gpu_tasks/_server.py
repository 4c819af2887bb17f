"""The embedded Prefect server's process: out of the terminal's Ctrl-C, never outliving its parent.

Imported only when :func:`gpu_tasks.main_job.embedded_server` starts a server:
``prefect.server`` takes about 2 s to import, which ``gpu-tasks serve`` and the
benchmarks that import ``main_job`` need not pay.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import prefect.server.api.server as _prefect_server
from prefect.server.api.server import SubprocessASGIServer

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


class EmbeddedServer(SubprocessASGIServer):
    """Prefect's ``SubprocessASGIServer`` in a session of its own that dies with its parent."""

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
