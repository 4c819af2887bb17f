"""CPython names gpu-tasks uses beyond the documented way: exit handlers run early, ``os._exit``
wrapped in worker processes, ``signal.signal`` swapped while a cluster manager's module imports."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

logger = logging.getLogger(__name__)


def run_exit_handlers() -> None:
    """Run the interpreter's exit handlers now (the private ``atexit._run_exitfuncs``): a bound warm
    process ends with ``os._exit`` right after, skipping a teardown that only frees memory."""
    atexit._run_exitfuncs()


def replace_os_exit(replacement: Callable[[int], Any]) -> Callable[[int], Any]:
    """Make ``os._exit`` call ``replacement`` in this process; returns the one it replaced.

    A worker's guard (:mod:`gpu_tasks.worker.guard`) ends the task's child processes whoever
    ends the worker that way (Dask's nanny, Prefect, the guard itself).
    """
    real = os._exit
    os._exit = replacement  # type: ignore[assignment]
    return real


@contextmanager
def signal_handlers_kept() -> Iterator[None]:
    """Within the block, ``signal.signal`` leaves handlers as they are (and says so at debug level).

    ``dask_jobqueue.runner`` sets a SIGINT handler when it is imported: on a thread other than the
    main one that import raises ``ValueError``, and on the main thread it would replace Prefect's
    Ctrl-C handling with ``sys.exit()``.
    """
    with _SIGNAL_SWAP:  # one swap at a time: two threads' nested swaps could keep `keep` for good
        real = signal.signal

        def keep(signum: Any, handler: Any) -> Any:
            logger.debug("gpu-tasks: kept the handler of signal %s while importing a cluster class", signum)
            return signal.getsignal(signum)

        signal.signal = keep  # type: ignore[assignment]
        try:
            yield
        finally:
            signal.signal = real


_SIGNAL_SWAP = threading.RLock()


def _check_exitfuncs() -> str | None:
    return None if callable(getattr(atexit, "_run_exitfuncs", None)) else "atexit has no _run_exitfuncs"


def _check_os_exit() -> str | None:
    return None if callable(getattr(os, "_exit", None)) else "os has no _exit"


def _check_signal() -> str | None:
    return None if callable(signal.signal) and callable(signal.getsignal) else "signal.signal is not callable"


def _uses() -> list[Any]:
    from gpu_tasks.compat import Use

    return [
        Use(
            "cpython",
            "atexit._run_exitfuncs",
            "private",
            "a bound warm process runs its exit handlers (Prefect's send logs and events), then exits "
            "at once",
            _check_exitfuncs,
        ),
        Use(
            "cpython",
            "os._exit",
            "patched",
            "a worker process ends its task's child processes whoever ends it with os._exit",
            _check_os_exit,
        ),
        Use(
            "cpython",
            "signal.signal",
            "patched",
            "swapped while a cluster manager's module imports, so it cannot take over Ctrl-C",
            _check_signal,
        ),
    ]


USES = _uses()
