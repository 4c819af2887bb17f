"""A warm process bound to a lease as a ``SpecCluster`` entry (:class:`PooledWorker`): from the flow
process it does what the nanny did, telling the process its devices and options and ending it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import time
from typing import Any

import dask
import psutil
from distributed.core import Status
from distributed.deploy.spec import ProcessInterface

from gpu_tasks.compat.distributed import memory_limit
from gpu_tasks.worker.exits import describe_exitcode, record_exit, record_memory_kill, remember_pid
from gpu_tasks.worker.warm import CLOSE_GRACE_S, MEMORY_POLL_S, WarmPool, WarmProcess, end_closed

logger = logging.getLogger(__name__)


class _Bound(ProcessInterface):
    """A ``SpecCluster`` entry run by one warm process: closing it asks the process to close, then ends it."""

    pool: WarmPool
    timeout: float
    warm: WarmProcess | None = None
    _watch: asyncio.Task[None] | None = None

    def _released(self, warm: WarmProcess) -> None:
        """``warm`` has ended after a close."""

    async def _bind(self, warm: WarmProcess, msg: tuple[Any, ...], failed: str) -> None:
        """Send ``msg`` to ``warm`` and wait for its server's address (else stop it, raise ``failed``)."""
        warm.conn.send(msg)
        answer = await asyncio.to_thread(_receive, warm, self.timeout)
        if answer[0] != "up":
            await asyncio.to_thread(warm.stop)
            raise RuntimeError(f"{failed} {warm.pid}: {answer[1]}")
        self.address = answer[1]

    async def close(self) -> None:
        warm, self.warm = self.warm, None
        if warm is not None:
            with contextlib.suppress(OSError, ValueError):
                warm.conn.send(("close",))
            await asyncio.to_thread(end_closed, warm, CLOSE_GRACE_S)
            with contextlib.suppress(OSError):
                warm.conn.close()
            self._released(warm)
        if self._watch is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._watch), 1.0)
        await super().close()  # type: ignore[no-untyped-call]


class PooledWorker(_Bound):
    """A ``SpecCluster`` worker entry that binds a warm process instead of spawning one; of the Nanny's
    options, ``env`` and ``silence_logs`` apply in the process, the rest go to its ``Worker``."""

    def __init__(
        self,
        scheduler: str,
        *,
        pool: WarmPool,
        timeout: float,
        env: dict[str, str] | None = None,
        silence_logs: int | None = None,
        cuda: dict[str, Any] | None = None,
        **worker_kwargs: Any,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.scheduler = scheduler
        self.pool = pool
        self.timeout = timeout
        self.env = dict(env or {})
        self.silence_logs = silence_logs
        self.cuda = cuda  # dask-cuda's worker setup, applied once bound
        self.worker_kwargs = worker_kwargs
        self.name = worker_kwargs.get("name")
        self.process: Any = None  # the multiprocessing.Process (its pid: the runner's terminate)
        self.worker_address: str | None = None
        self.ended_at: float | None = None  # when its process ended though no one closed it

    async def start(self) -> None:
        self.warm = warm = await asyncio.to_thread(self.pool.take, self.timeout)
        self.process = warm.process
        env = warm.bind_environ(self.env)
        config = dask.config.config
        msg = ("bind", self.scheduler, self.worker_kwargs, env, config, self.silence_logs, self.cuda)
        await self._bind(warm, msg, f"worker {self.name!r} did not start in warm process")
        self.worker_address = self.address
        remember_pid(self.worker_address, warm.pid)
        self._watch = asyncio.ensure_future(self._watch_process())
        await super().start()  # type: ignore[no-untyped-call]

    async def _watch_process(self) -> None:
        """Record how the process ended; terminate it past the memory limit (the nanny's jobs)."""
        warm = self.warm
        assert warm is not None
        proc = warm.process
        limit = _terminate_at(self.worker_kwargs)
        ps = None
        if limit:
            with contextlib.suppress(psutil.Error):
                ps = psutil.Process(proc.pid)
        while proc.is_alive():
            # wakes as soon as the process exits (its sentinel), else every poll interval
            await asyncio.to_thread(multiprocessing.connection.wait, [proc.sentinel], MEMORY_POLL_S)
            if ps is None or limit is None:
                continue
            try:
                rss = ps.memory_info().rss
            except Exception:
                continue
            if rss > limit:
                logger.warning(
                    "worker %r exceeded %d%% of its memory limit (%d MiB resident); terminating it",
                    self.name,
                    int(dask.config.get("distributed.worker.memory.terminate") * 100),
                    rss // 2**20,
                )
                record_memory_kill(self.worker_address, rss, proc.pid)
                proc.terminate()
                break
        await asyncio.to_thread(proc.join)
        record_exit(self.worker_address, proc.exitcode, proc.pid)
        if self.warm is not None:  # not closed by its cluster
            self.ended_at = time.monotonic()
        self.pool.released(warm)
        self.status = Status.closed
        self._event_finished.set()

    def _released(self, warm: WarmProcess) -> None:
        self.pool.released(warm)


class PooledScheduler(_Bound):
    """A ``SpecCluster`` scheduler entry: Dask's ``Scheduler`` in a process forked from the warm pool's
    fork server, not in the flow process (:mod:`gpu_tasks.worker.serve` says why)."""

    def __init__(
        self, *, pool: WarmPool, timeout: float, silence_logs: int | None = None, **scheduler_kwargs: Any
    ):
        super().__init__()  # type: ignore[no-untyped-call]
        self.pool = pool
        self.timeout = timeout
        self.silence_logs = silence_logs
        self.scheduler_kwargs = scheduler_kwargs

    async def start(self) -> None:
        self.warm = warm = await asyncio.to_thread(self.pool.own, self.timeout)
        env = warm.bind_environ({})
        msg = ("scheduler", self.scheduler_kwargs, env, dask.config.config, self.silence_logs)
        await self._bind(warm, msg, "the scheduler did not start in process")
        self._watch = asyncio.ensure_future(self._watch_process())
        await super().start()  # type: ignore[no-untyped-call]

    @property
    def gone(self) -> bool:
        """Whether its process ended though its cluster has not closed it (killed, out of memory)."""
        warm = self.warm
        return warm is not None and not warm.process.is_alive()

    async def _watch_process(self) -> None:
        """A scheduler process that ends (killed, out of memory) is closed to its cluster."""
        assert self.warm is not None
        proc = self.warm.process
        await asyncio.to_thread(proc.join)
        if self.warm is not None:  # not closed by the cluster
            logger.warning(
                "the scheduler process %s at %s %s", proc.pid, self.address, describe_exitcode(proc.exitcode)
            )
        self.status = Status.closed
        self._event_finished.set()


def _receive(warm: WarmProcess, timeout: float) -> tuple[Any, ...]:
    """The process's answer to a bind: ``("up", address)`` or ``("error", why)``."""
    if not warm.conn.poll(timeout):
        return ("error", f"no answer within {timeout:g}s")
    try:
        msg: tuple[Any, ...] = warm.conn.recv()
    except (EOFError, OSError):
        return ("error", warm._died())
    return msg


def _terminate_at(worker_kwargs: dict[str, Any]) -> int | None:
    """Bytes of resident memory past which the nanny would terminate this worker."""
    fraction = dask.config.get("distributed.worker.memory.terminate")
    if not fraction:
        return None
    limit = memory_limit(worker_kwargs.get("memory_limit", "auto"), worker_kwargs.get("nthreads") or 1)
    return int(limit * fraction) if limit else None
