"""Results of a local Dask cluster's finished tasks, fetched in batches.

Dask runs every future's done-callback on one thread per process; fetching a task's
result there (``Future.result``) is a round trip through the scheduler to the worker,
one task at a time. gpu-tasks' callbacks only queue finished futures here instead; one
thread per runner fetches everything queued with one ``Client.gather`` per cluster and
hands each result on. A lone result is fetched at once; a burst (a ``.map``'s tasks
finishing together) costs one round trip per batch instead of one per task.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("gpu_tasks.runner")

# (its key for the consumer, the Dask future)
Landing = tuple[Any, Any]


class Landings:
    """Fetches finished Dask futures' results in batches on a thread of its own.

    ``deliver(item, value, error)`` is called once per queued item, on that thread:
    with the future's result, or with ``value=None`` and the exception that fetching it
    raised (then the consumer looks at the future itself).
    """

    def __init__(self, deliver: Callable[[Any, Any, BaseException | None], None], name: str) -> None:
        self._deliver = deliver
        self._name = name
        self._queued: list[Landing] = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def put(self, item: Any, dfut: Any) -> bool:
        """Queue ``dfut``'s result for ``item``; ``False`` once closed (the caller handles it)."""
        with self._cv:
            if self._closed:
                return False
            self._queued.append((item, dfut))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify()
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Deliver what is queued, then stop the thread (waits up to ``timeout``)."""
        with self._cv:
            self._closed = True
            self._cv.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queued and not self._closed:
                    self._cv.wait()
                if not self._queued:
                    return
                batch, self._queued = self._queued, []
            self._fetch(batch)

    def _fetch(self, batch: list[Landing]) -> None:
        by_client: dict[int, list[Landing]] = {}
        for landing in batch:
            by_client.setdefault(id(landing[1].client), []).append(landing)
        for group in by_client.values():
            try:
                values = group[0][1].client.gather([dfut for _, dfut in group]) if len(group) > 1 else None
            except BaseException:  # one of them failed or was lost: each is fetched on its own
                values = None
            if values is None:
                for item, dfut in group:
                    self._one(item, dfut)
                continue
            for (item, _), value in zip(group, values, strict=True):
                self._hand_on(item, value, None)

    def _one(self, item: Any, dfut: Any) -> None:
        try:
            value = dfut.result()
        except BaseException as exc:
            self._hand_on(item, None, exc)
            return
        self._hand_on(item, value, None)

    def _hand_on(self, item: Any, value: Any, error: BaseException | None) -> None:
        try:
            self._deliver(item, value, error)
        except BaseException:  # the consumer resolves its own futures; never stop this thread
            logger.warning("gpu-tasks: could not hand on a task's result", exc_info=True)
