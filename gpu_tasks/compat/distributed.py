"""The private distributed names gpu-tasks relies on (the nanny's exit hook), and worker options read
as distributed reads them.
"""

from __future__ import annotations

from typing import Any

from gpu_tasks.compat import Use, called_in, params


def nanny_class_with_exit_hook() -> type[Any]:
    """``distributed.Nanny`` whose worker-process exit calls ``self.on_worker_exit(exitcode)`` first
    (``_on_worker_exit_sync`` is the one place a nanny learns its worker's exit code)."""
    from distributed import Nanny

    class NannyWithExitHook(Nanny):
        def on_worker_exit(self, exitcode: int) -> None:
            """Called with the worker process's exit code, before the nanny reacts to it."""

        def _on_worker_exit_sync(self, exitcode: int) -> None:
            self.on_worker_exit(exitcode)
            super()._on_worker_exit_sync(exitcode)  # type: ignore[no-untyped-call]  # unannotated

    return NannyWithExitHook


def add_preload(preload: Any, preload_argv: Any, module: str, args: tuple[str, ...] = ()) -> dict[str, Any]:
    """``preload``/``preload_argv`` with ``module`` appended, given ``args``: a flat ``preload_argv``
    goes to every preload, so ``args`` join it; a list of lists has one entry per preload."""
    preload = [preload] if isinstance(preload, str) else list(preload or [])
    argv = list(preload_argv or [])
    if argv and not isinstance(argv[0], str):
        argv.append(list(args))
    else:
        argv.extend(args)
    return {"preload": [*preload, module], "preload_argv": argv}


def memory_limit(memory_limit: Any, nthreads: int) -> int | None:
    """A worker's host memory limit in bytes, read as ``distributed.Worker`` reads its ``memory_limit``
    (a size, a fraction of the system's memory, 0 or ``None`` for none, ``"auto"``)."""
    from dask.system import CPU_COUNT
    from dask.utils import parse_bytes
    from distributed.system import MEMORY_LIMIT

    if memory_limit is None:
        return None
    if memory_limit == "auto":
        memory_limit = int(MEMORY_LIMIT * min(1, nthreads / CPU_COUNT))
    try:
        number = float(memory_limit)
    except (TypeError, ValueError):
        limit = parse_bytes(memory_limit)
    else:
        limit = int(number * MEMORY_LIMIT) if number <= 1 else int(number)
    return None if limit == 0 else min(limit, MEMORY_LIMIT)


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
