"""Interrupting the tasks a shared cluster's worker runs, from outside their threads: preemption or
the flow run's end (:func:`interrupt_tasks`), and tasks nobody wants any more (:func:`watch_released`)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from gpu_tasks.errors import TaskPreempted

logger = logging.getLogger(__name__)

# Threads of this worker process running a shared cluster's task, by ident: its Dask key.
INTERRUPTIBLE: dict[int, str] = {}
INTERRUPTIBLE_LOCK = threading.Lock()


RELEASED_POLL_S = 0.5  # how often a shared worker looks for running tasks nobody wants any more
_RELEASE_WATCH: dict[int, threading.Thread] = {}  # by id() of the Dask worker


def released_keys(dask_worker: Any, keys: list[str]) -> list[str]:
    """Those of ``keys`` this worker still executes though its scheduler released them."""
    tasks = dask_worker.state.tasks  # distributed's documented WorkerState.tasks, TaskState.state
    return [k for k in keys if getattr(tasks.get(k), "state", None) == "cancelled"]


ORPHANED: set[int] = set()  # threads interrupted as their worker closed: their crash goes unreported


def _quiet_orphan_crash() -> None:
    """No ``Crashed`` report for an attempt interrupted as its worker closed: a late one from here
    would overwrite that of its rerun elsewhere."""
    from gpu_tasks.compat.prefect import skip_crash_reports

    def say(task_run: Any) -> None:
        logger.warning(
            "task run %s: its worker lost its scheduler, which runs it again elsewhere; this attempt "
            "was interrupted and reports nothing",
            getattr(task_run, "id", None),
        )

    skip_crash_reports(lambda: threading.get_ident() in ORPHANED, say)


def watch_released(dask_worker: Any) -> None:
    """Start, once per worker, a thread that stops the tasks whose keys the scheduler released (a
    killed flow process cannot call :func:`interrupt_tasks`), and, when the worker closes, the rest."""

    def watch() -> None:
        while getattr(dask_worker.status, "name", "") not in ("closing", "closed", "failed"):
            time.sleep(RELEASED_POLL_S)
            with INTERRUPTIBLE_LOCK:
                keys = list(INTERRUPTIBLE.values())
            gone = released_keys(dask_worker, keys) if keys else []
            hit = interrupt_tasks(gone, "stop") if gone else []  # none interrupted already
            if hit:
                logger.warning(
                    "worker %s: interrupted %d task(s) their scheduler released (their flow run's "
                    "client is gone): %s",
                    dask_worker.address,
                    len(hit),
                    ", ".join(hit),
                )
        # the worker lost its scheduler: results reach no one, and the scheduler re-runs them elsewhere
        with INTERRUPTIBLE_LOCK:
            _RELEASE_WATCH.pop(id(dask_worker), None)
            left = list(INTERRUPTIBLE.values())
            ORPHANED.update(INTERRUPTIBLE)
        if left:
            logger.warning(
                "worker %s is closing (%s): interrupting the %d task(s) it still runs, whose results "
                "can reach no one: %s",
                dask_worker.address,
                dask_worker.status.name,
                len(left),
                ", ".join(left),
            )
            interrupt_tasks(left, "stop")

    with INTERRUPTIBLE_LOCK:
        if id(dask_worker) in _RELEASE_WATCH:
            return
        _quiet_orphan_crash()
        thread = threading.Thread(target=watch, name="gpu-tasks-released-watch", daemon=True)
        _RELEASE_WATCH[id(dask_worker)] = thread
    thread.start()


def interrupt_tasks(keys: list[str], why: str = "preempt") -> list[str]:
    """Run on a worker (``Client.run``): raise ``TaskPreempted`` (``why="preempt"``) or
    ``KeyboardInterrupt`` (``"stop"``) in the threads running ``keys``; the keys interrupted. Each
    task at most once: a thread interrupted is no longer interruptible (a second exception could land
    while Prefect's engine handles the first, in a logging handler's lock, and leak that lock)."""
    exc = TaskPreempted if why == "preempt" else KeyboardInterrupt
    wanted = set(keys)
    with INTERRUPTIBLE_LOCK:
        hit = [(ident, key) for ident, key in INTERRUPTIBLE.items() if key in wanted]
        for ident, _ in hit:
            del INTERRUPTIBLE[ident]
        return [key for ident, key in hit if raise_in_thread(ident, exc)]


def raise_in_thread(ident: int, exc: type[BaseException]) -> bool:
    """Raise ``exc`` in thread ``ident`` at its next Python instruction; whether it was found."""
    import ctypes

    hit = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(exc))
    return bool(hit == 1)
