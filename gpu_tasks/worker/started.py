"""Which hand-offs began in a local cluster's workers, noted in a file: a task Dask had only queued
on a worker that died runs again instead of ending ``Crashed`` (docs/runner.md, "A worker process dies"),
and a task still running when the runner closes counts as busy from its start (the ledger)."""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import tempfile
import threading
import time

logger = logging.getLogger(__name__)

_FDS: dict[str, int] = {}  # a worker process's open log, by path


def hand_off_token(key: str) -> str:
    """A hand-off's Dask key (``<task name>-<task run id hex>-<attempt>``) without the task's name."""
    return "-".join(str(key).rsplit("-", 2)[-2:])


def mark_started(path: str, key: str, worker: str = "cpu") -> None:
    """In a worker: note that hand-off ``key`` begins now on ``worker`` (its devices' ledger key,
    :func:`~gpu_tasks.reporting.ledger.worker_key`); a kernel write outlives the process."""
    try:
        fd = _FDS.get(path)
        if fd is None:
            from gpu_tasks.worker import guard

            fd = _FDS[path] = os.open(path, os.O_WRONLY | os.O_APPEND)  # the flow process made it
            guard.on_orphaned(lambda _flow: _remove(path))  # a killed flow process cannot remove it
        os.write(fd, f"{hand_off_token(key)} {time.time():.3f} {worker}\n".encode())
    except OSError:
        logger.warning("gpu-tasks: could not note that %s began in %s", key, path, exc_info=True)


ENDED = "ended"  # the worker field of a hand-off's second line


def mark_ended(path: str, key: str) -> None:
    """In a worker: note that hand-off ``key`` ended in a final state its engine reported (the close
    then leaves that record alone if the result does not reach the flow process in time)."""
    mark_started(path, key, ENDED)


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
        self._seen: dict[str, tuple[float, str]] = {}  # token: (began at, worker key)
        self._ended: set[str] = set()  # tokens whose engine reported a final state
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
        if not self._read():
            return True
        with self._lock:
            return hand_off_token(key) in self._seen

    def since(self, key: str) -> tuple[float, str] | None:
        """When hand-off ``key`` began and on which worker (its ledger key); ``None``: not noted."""
        if not self._read():
            return None
        with self._lock:
            return self._seen.get(hand_off_token(key))

    def ended(self, key: str) -> bool:
        """Whether hand-off ``key``'s worker reported its final state to Prefect (noted after it)."""
        if not self._read():
            return False
        with self._lock:
            return hand_off_token(key) in self._ended

    def _read(self) -> bool:
        """Read what was added to the file since the last read (no lock held while reading); ``False``
        when there is no file or it cannot be read."""
        with self._lock:
            path, offset = self._path, self._offset
        if path is None:
            return False
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except OSError:
            return False
        end = data.rfind(b"\n") + 1
        noted, ended = {}, set()  # each line is one O_APPEND write of mark_started: "token time worker"
        for line in data[:end].decode().splitlines():
            token, at, worker = line.split(" ", 2)
            if worker == ENDED:
                ended.add(token)
            else:
                noted[token] = (float(at), worker)
        with self._lock:  # two readers at once read the same lines: the same entries
            self._seen.update(noted)
            self._ended |= ended
            self._offset = max(self._offset, offset + end)
        return True

    def close(self) -> None:
        with self._lock:
            if self._path is not None:
                _remove(self._path)
