"""The flow process's warm-pool fork server, shared by its warm pools so flow runs one after another
pay its imports once; safe, as a bound process takes the flow's whole environment at its bind."""

from __future__ import annotations

import os
import threading
from typing import Any

from gpu_tasks.compat.cpython import ForkServerContext

_SHARED_LOCK = threading.Lock()
_SHARED: dict[str, Any] = {}  # "ctx": the ForkServerContext, "users": pools using it, "timer"


def acquire(preload: list[str]) -> ForkServerContext:
    """This process's fork server for a new pool, started with ``preload`` if none; see :func:`release`."""
    with _SHARED_LOCK:
        timer = _SHARED.pop("timer", None)
        if timer is not None:
            timer.cancel()  # used again before its keep ran out
        if "ctx" not in _SHARED:
            _SHARED["ctx"], _SHARED["users"] = ForkServerContext(preload), 0
        _SHARED["users"] += 1
        ctx: ForkServerContext = _SHARED["ctx"]
        return ctx


def release(ctx: ForkServerContext) -> None:
    """A pool closed: with none left the server ends ``GPU_TASKS_TUNE_WARM_SERVER_KEEP_SECONDS`` later."""
    from gpu_tasks.settings import get_settings

    keep = get_settings().warm_server_keep_seconds
    with _SHARED_LOCK:
        if _SHARED.get("ctx") is not ctx:  # not the shared one (forgotten after a fork)
            ctx.close()
            return
        _SHARED["users"] -= 1
        if _SHARED["users"] > 0:
            return
        if keep > 0:
            timer = threading.Timer(keep, _close_fork_server, args=(ctx,))
            timer.daemon = True
            timer.name = "gpu-tasks-fork-server-keep"
            _SHARED["timer"] = timer
            timer.start()
            return
    _close_fork_server(ctx)


def _close_fork_server(ctx: ForkServerContext) -> None:
    with _SHARED_LOCK:
        if _SHARED.get("ctx") is not ctx or _SHARED.get("users"):
            return  # in use again
        _SHARED.clear()
    ctx.close()  # it ends once the processes forked from it have


def _forget_fork_server() -> None:
    """In a forked child: the parent's fork server is not its own, and the lock may have been held."""
    global _SHARED_LOCK
    _SHARED_LOCK = threading.Lock()
    _SHARED.clear()


os.register_at_fork(after_in_child=_forget_fork_server)
