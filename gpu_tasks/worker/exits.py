"""How a profile's worker processes ended, for the runner's crash report (:func:`worker_exit`).
It imports distributed (:class:`WatchedNanny`): import it lazily."""

from __future__ import annotations

import dataclasses
import functools
import logging
import signal
import threading
import time
from typing import Any

from gpu_tasks.compat.distributed import nanny_class_with_exit_hook


@dataclasses.dataclass(frozen=True)
class WorkerExit:
    """How a worker process ended."""

    address: str
    pid: int | None
    exitcode: int | None
    memory_kill: bool = False  # Dask's nanny terminated it for exceeding its memory limit
    rss: int | None = None

    def describe(self) -> str:
        """``killed by signal 9 (SIGKILL)``, ``exited with status 3``, or the memory kill."""
        if self.memory_kill:
            mib = f" ({self.rss / 2**20:.0f} MiB resident when stopped)" if self.rss else ""
            return f"ran out of memory: it exceeded its Dask memory limit and was terminated{mib}"
        return describe_exitcode(self.exitcode)


def quiet_worker(cls: Any, *args: Any, silence_logs: int | None = None, **kwargs: Any) -> Any:
    """``cls(...)`` in a nanny's worker process, Dask's loggers there at ``silence_logs`` first
    (GPU_TASKS_TUNE_DASK_LOG_LEVEL): Dask's nanny sets only its own logger's level there."""
    if silence_logs:
        logging.getLogger("distributed").setLevel(silence_logs)
    return cls(*args, silence_logs=silence_logs, **kwargs)


def describe_exitcode(exitcode: int | None) -> str:
    """A process exit code in words (negative codes are signals)."""
    if exitcode is None:
        return "died (exit status unknown)"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "unknown signal"
        words = f"was killed by signal {-exitcode} ({name})"
        if -exitcode == signal.SIGKILL:
            words += "; the kernel's out-of-memory killer sends this signal too"
        return words
    return f"exited with status {exitcode}"


_EXITS: dict[str, WorkerExit] = {}
_PIDS: dict[str, int] = {}  # live workers' process ids, by address
_EXITS_LOCK = threading.Lock()


def worker_exit(address: str, wait: float = 2.0) -> WorkerExit | None:
    """How the worker at ``address`` ended, waiting up to ``wait`` s for its nanny to tell."""
    deadline = time.monotonic() + wait
    while True:
        with _EXITS_LOCK:
            found = _EXITS.get(address)
        if found is not None or time.monotonic() >= deadline:
            return found
        time.sleep(0.05)


def _record(address: str | None, **fields: Any) -> None:
    if not address:
        return
    with _EXITS_LOCK:
        if len(_EXITS) > 1000:  # one entry per dead worker: keep the recent ones
            for key in list(_EXITS)[:500]:
                del _EXITS[key]
        old = _EXITS.get(address) or WorkerExit(address, None, None)
        _EXITS[address] = dataclasses.replace(old, **fields)


def remember_pid(address: str | None, pid: int | None) -> None:
    """Note the process id of the live worker at ``address`` (for its crash report)."""
    if address and pid:
        with _EXITS_LOCK:
            if len(_PIDS) > 1000:
                _PIDS.clear()
            _PIDS[address] = pid


def record_exit(address: str | None, exitcode: int | None, pid: int | None = None) -> None:
    """Note how the worker at ``address`` ended (a ``PooledWorker`` has no nanny)."""
    if not address:
        return
    with _EXITS_LOCK:
        known = _PIDS.pop(address, None)
    _record(address, exitcode=exitcode, pid=pid or known)


def record_memory_kill(address: str | None, rss: int | None, pid: int | None) -> None:
    """Note that the worker at ``address`` is being terminated for exceeding its memory limit."""
    _record(address, memory_kill=True, rss=rss, pid=pid)


class WatchedNanny(nanny_class_with_exit_hook()):  # type: ignore[misc]  # a class built at import
    """Dask's nanny, noting how its worker process ended (exit code, memory kill) for crash reports."""

    def __init__(self, *args: Any, worker_class: Any = None, **kwargs: Any) -> None:
        from distributed import Worker

        quiet = functools.partial(quiet_worker, worker_class or Worker)  # GPU_TASKS_TUNE_DASK_LOG_LEVEL
        super().__init__(*args, worker_class=quiet, **kwargs)

    async def instantiate(self) -> Any:
        status = await super().instantiate()
        remember_pid(self.worker_address, getattr(self.process, "pid", None))
        return status

    def on_worker_exit(self, exitcode: int) -> None:  # the nanny's process watcher, via gpu_tasks.compat
        record_exit(self.worker_address, exitcode)

    def log_event(self, topic: Any, msg: Any) -> None:
        if topic == "worker-restart-memory" and isinstance(msg, dict):
            record_memory_kill(msg.get("worker"), msg.get("rss"), msg.get("pid"))
        super().log_event(topic, msg)
