"""Which hand-offs began in a local cluster's workers, noted in a file: a task Dask had only queued
on a worker that died runs again instead of ending ``Crashed`` (docs/runner.md, "A worker process dies")."""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import tempfile
import threading

logger = logging.getLogger(__name__)

_FDS: dict[str, int] = {}  # a worker process's open log, by path


def hand_off_token(key: str) -> str:
    """A hand-off's Dask key (``<task name>-<task run id hex>-<attempt>``) without the task's name."""
    return "-".join(str(key).rsplit("-", 2)[-2:])


def mark_started(path: str, key: str) -> None:
    """In a worker: note that hand-off ``key`` begins (a kernel write outlives the process)."""
    try:
        fd = _FDS.get(path)
        if fd is None:
            from gpu_tasks.worker import guard

            fd = _FDS[path] = os.open(path, os.O_WRONLY | os.O_APPEND)  # the flow process made it
            guard.on_orphaned(lambda _flow: _remove(path))  # a killed flow process cannot remove it
        os.write(fd, f"{hand_off_token(key)}\n".encode())
    except OSError:
        logger.warning("gpu-tasks: could not note that %s began in %s", key, path, exc_info=True)


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _remove_stale(folder: str) -> None:
    """Remove the files of flow processes that are gone (killed with all their workers)."""
    import psutil

    for path in glob.glob(os.path.join(folder, "gpu-tasks-started-*-*.log")):
        pid = os.path.basename(path).split("-")[3]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            _remove(path)


class StartedLog:
    """The flow run's file of begun hand-offs: made at the first hand-off, read when a worker dies."""

    def __init__(self) -> None:
        self._path: str | None = None
        self._seen: set[str] = set()
        self._offset = 0
        self._lock = threading.Lock()

    @property
    def path(self) -> str:
        with self._lock:
            if self._path is None:
                _remove_stale(tempfile.gettempdir())
                fd, self._path = tempfile.mkstemp(prefix=f"gpu-tasks-started-{os.getpid()}-", suffix=".log")
                os.close(fd)
            return self._path

    def began(self, key: str) -> bool:
        """Whether hand-off ``key`` began; ``True`` when unreadable (reported a crash, never run twice)."""
        with self._lock:
            if self._path is None:
                return True
            try:
                with open(self._path, "rb") as f:
                    f.seek(self._offset)
                    data = f.read()
            except OSError:
                return True
            end = data.rfind(b"\n") + 1
            self._offset += end
            self._seen.update(data[:end].decode().split())
            return hand_off_token(key) in self._seen

    def close(self) -> None:
        with self._lock:
            if self._path is not None:
                _remove(self._path)
