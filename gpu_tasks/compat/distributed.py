"""The private Dask/distributed APIs gpu-tasks relies on, each with why and the versions checked.

Checked against distributed 2026.7.1 (the lowest of the tested range, and dask-cuda 26.10's
pin) and 2026.8.0 (the compat stage). Each wrapper degrades to a logged no-op or a clear
error on a version where the private name is gone; tests/test_compat.py fails there.

The nanny's private ``_on_worker_exit_sync`` hook is overridden here too
(:func:`nanny_class_with_exit_hook`), so :class:`gpu_tasks.worker.exits.WatchedNanny` uses a public
method of its own.
"""

from __future__ import annotations

import logging
from typing import Any

from gpu_tasks.compat import Use, called_in, params

logger = logging.getLogger(__name__)


def memory_limit(memory_limit: Any, nthreads: int) -> int | None:
    """A worker's host memory limit in bytes, as Dask reads ``memory_limit`` (``"auto"``, a size,
    a fraction): the undocumented ``distributed.worker_memory.parse_memory_limit``."""
    from distributed.worker_memory import parse_memory_limit

    out = parse_memory_limit(memory_limit, nthreads, logger=logger)
    return None if out is None else int(out)


def nanny_class_with_exit_hook() -> type[Any]:
    """``distributed.Nanny`` whose worker-process exit calls ``self.on_worker_exit(exitcode)`` first.

    The nanny's process watcher calls the private ``Nanny._on_worker_exit_sync(exitcode)``: the
    one place a nanny learns its worker's exit code (crash reports name it).
    """
    from distributed import Nanny

    class NannyWithExitHook(Nanny):
        def on_worker_exit(self, exitcode: int) -> None:
            """Called with the worker process's exit code, before the nanny reacts to it."""

        def _on_worker_exit_sync(self, exitcode: int) -> None:
            self.on_worker_exit(exitcode)
            super()._on_worker_exit_sync(exitcode)  # type: ignore[no-untyped-call]  # unannotated

    return NannyWithExitHook


# ---------------------------------------------------------------- public helpers
def add_preload(preload: Any, preload_argv: Any, module: str, args: tuple[str, ...] = ()) -> dict[str, Any]:
    """``preload``/``preload_argv`` with ``module`` appended, given ``args``.

    Dask gives a flat ``preload_argv`` to every preload, so ``args`` join it (as dask-cuda
    adds its own); a list of lists has one entry per preload, so ``args`` become one.
    """
    preload = [preload] if isinstance(preload, str) else list(preload or [])
    argv = list(preload_argv or [])
    if argv and not isinstance(argv[0], str):
        argv.append(list(args))
    else:
        argv.extend(args)
    return {"preload": [*preload, module], "preload_argv": argv}


# ---------------------------------------------------------------- the uses, with feature checks
def _check_nanny_exit() -> str | None:
    from distributed import Nanny

    # the nanny hands it to its worker process as on_exit: a hook no longer called learns nothing
    return params(getattr(Nanny, "_on_worker_exit_sync", None), "exitcode") or called_in(
        Nanny, "_on_worker_exit_sync"
    )


USES = [
    Use(
        "distributed",
        "distributed.Nanny._on_worker_exit_sync",
        "private",
        "learn a worker process's exit code for crash reports",
        _check_nanny_exit,
    ),
]
