"""A thread pool with a fixed number of task slots that a waiting task gives back, as Dask's
``secede``/``rejoin``: a task waiting for its child would otherwise hold the slot the child needs."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

_CURRENT = threading.local()  # the pool whose slot this thread holds, if any


class SlotPool(concurrent.futures.Executor):
    """Runs submitted callables on threads, at most ``slots`` of them at a time (less waiters)."""

    def __init__(self, slots: int, name: str = "gpu-tasks-slot") -> None:
        if slots < 1:
            raise ValueError(f"a slot pool needs at least one slot; got {slots}")
        self.slots = slots
        self._free = slots
        self._rejoining = 0
        self._queue: collections.deque[
            tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...]]
        ] = collections.deque()
        self._cond = threading.Condition()
        self._shutdown = False
        # threads are made as needed and reused; more than ``slots`` exist only while tasks wait
        self._threads = concurrent.futures.ThreadPoolExecutor(max_workers=4096, thread_name_prefix=name)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        if kwargs:
            fn = functools.partial(fn, **kwargs)
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cond:
            if self._shutdown:
                raise RuntimeError("cannot submit to a slot pool that was shut down")
            self._queue.append((future, fn, args))
            self._pump()
        return future

    def _pump(self) -> None:
        """Start queued work while slots are free and nobody waits to rejoin (under ``_cond``)."""
        while self._free > 0 and self._queue and self._rejoining == 0:
            future, fn, args = self._queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            self._free -= 1
            self._threads.submit(self._run, future, fn, args)

    def _run(
        self, future: concurrent.futures.Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]
    ) -> None:
        _CURRENT.pool = self
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the future, as ThreadPoolExecutor does
            future.set_exception(exc)
        else:
            future.set_result(result)
        finally:
            _CURRENT.pool = None
            self.secede()

    def secede(self) -> None:
        """Give this thread's slot back (it must hold one)."""
        with self._cond:
            self._free += 1
            self._cond.notify_all()
            self._pump()

    def rejoin(self) -> None:
        """Take a slot again, before any queued task."""
        with self._cond:
            self._rejoining += 1
            try:
                while self._free <= 0:
                    self._cond.wait()
                self._free -= 1
            finally:
                self._rejoining -= 1
                self._pump()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._cond:
            self._shutdown = True
            if cancel_futures:
                while self._queue:
                    self._queue.popleft()[0].cancel()
        self._threads.shutdown(wait=wait, cancel_futures=cancel_futures)


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Leave this thread's slot (if it holds one) for the duration of a blocking wait."""
    pool: SlotPool | None = getattr(_CURRENT, "pool", None)
    if pool is None:
        yield
        return
    pool.secede()
    _CURRENT.pool = None  # a nested wait inside this one does not secede twice
    try:
        yield
    finally:
        pool.rejoin()
        _CURRENT.pool = pool
