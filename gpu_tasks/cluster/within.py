"""A blocking start with a deadline: :func:`within`; a Dask client that fails cleanly: :func:`dask_client`."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from gpu_tasks.settings import get_settings

T = TypeVar("T")


def within(seconds: float, fn: Callable[[], T], what: str, hint: str | None = None) -> T:
    """``fn()`` in a daemon thread, giving up after ``seconds`` (a SpecCluster can wait forever on a
    worker process that fails while starting); a late result is closed. ``hint``: the timeout's advice."""
    box: dict[str, Any] = {}
    done = threading.Event()
    lock = threading.Lock()

    def run() -> None:
        try:
            value = fn()
        except BaseException as exc:  # handed to the caller below
            box["error"] = exc
        else:
            with lock:
                box["value"] = value
                late = box.get("abandoned", False)
            if late:
                with contextlib.suppress(Exception):
                    value.close()  # type: ignore[attr-defined]  # a cluster
        finally:
            done.set()

    threading.Thread(target=run, name=f"gpu-tasks-start-{what}", daemon=True).start()
    if not done.wait(seconds):
        with lock:
            box["abandoned"] = True
            value = box.get("value")
        if value is None and hint:
            raise TimeoutError(
                f"{what} did not start within {seconds:g}s (GPU_TASKS_PROVISION_TIMEOUT). {hint}"
            )
        if value is None:
            from gpu_tasks.worker.warm import provision_timeout_advice

            settings = get_settings()  # nanny workers and spawned warm ones re-import the flow's script
            spawned = settings.warm_workers == 0 or settings.warm_start == "spawn"
            raise TimeoutError(provision_timeout_advice(f"{what} did not start", seconds, spawned))
    if "error" in box:
        raise box["error"]
    result: T = box["value"]
    return result


def dask_client(*args: Any, **kwargs: Any) -> Any:
    """``distributed.Client(*args, **kwargs)``. One whose constructor raised is collected here, while its
    loop runs: the traceback of its error (kept: a failed start fails the tasks after it too) holds it,
    and its ``__del__`` at interpreter exit would wait on a stopped loop (the process hung)."""
    from distributed import Client

    try:
        return Client(*args, **kwargs)
    except Exception as exc:
        error = exc
    chained: BaseException | None = error
    while chained is not None:
        chained.__traceback__ = None
        chained = chained.__cause__ or chained.__context__
    gc.collect()
    raise error
