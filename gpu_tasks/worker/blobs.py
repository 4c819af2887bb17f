"""Objects pickled once in the flow process and loaded once per worker process: cloudpickle walks
``sys.modules`` for each task's ``Task`` and flow run context. Both caches drop the least recently used."""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from typing import Any

KEEP = 256  # objects per process: a flow run's tasks and contexts, and a few flow runs'
KEEP_BYTES = 256 * 2**20  # and at most this many pickled bytes' worth of them


class Blob:
    """``obj`` pickled once; it pickles as its bytes, so Dask's scheduler never unpickles ``obj``."""

    __slots__ = ("data", "key", "kind")

    def __init__(self, key: str, data: bytes, kind: str) -> None:
        self.key, self.data, self.kind = key, data, kind

    def __reduce__(self) -> tuple[Any, tuple[str, bytes, str]]:
        return Blob, (self.key, self.data, self.kind)

    def open(self) -> Any:
        """The object, unpickled at the first call for this blob in this process."""
        return _load(self.key, self.data, self.kind)


def opened(value: Any) -> Any:
    """``value``'s object if it is a :class:`Blob`, else ``value``."""
    return value.open() if isinstance(value, Blob) else value


_LOADED: OrderedDict[str, tuple[Any, int]] = OrderedDict()  # key -> (object loaded here, its bytes)
_LOCK = threading.Lock()


class Blobs:
    """The flow side: one per runner; it keeps the objects it pickled alive, so an ``id`` is not reused."""

    def __init__(self) -> None:
        self._made: OrderedDict[int, tuple[Any, Blob]] = OrderedDict()  # id(obj) -> (obj, its blob)
        self._lock = threading.Lock()

    def blob(self, obj: Any, kind: str = "") -> Blob:
        """``obj``'s blob, pickled at the first call for it: later changes to ``obj`` reach no worker."""
        import cloudpickle  # type: ignore[import-untyped]

        with self._lock:
            made = self._made.get(id(obj))
            if made is not None and made[0] is obj:
                self._made.move_to_end(id(obj))
                return made[1]
        out = Blob(uuid.uuid4().hex, cloudpickle.dumps(obj), kind)
        with self._lock:
            self._made[id(obj)] = (obj, out)
            while len(self._made) > KEEP:
                self._made.popitem(last=False)
        return out


def _load(key: str, data: bytes, kind: str) -> Any:
    """The object a blob holds, unpickled at its first arrival in this process."""
    import pickle

    with _LOCK:
        if key in _LOADED:
            _LOADED.move_to_end(key)
            return _LOADED[key][0]
    if threading.current_thread() is threading.main_thread():
        loaded = pickle.loads(data)  # our own flow process pickled it
    else:  # what a worker thread imports may not set signal handlers (dask_jobqueue.runner does)
        from gpu_tasks.compat.cpython import signal_handlers_kept

        with signal_handlers_kept():
            loaded = pickle.loads(data)
    obj = _prepared(loaded, kind)
    with _LOCK:
        obj = _LOADED.setdefault(key, (obj, len(data)))[0]  # two threads may load it at once: one wins
        while len(_LOADED) > 1 and (
            len(_LOADED) > KEEP or sum(size for _, size in _LOADED.values()) > KEEP_BYTES
        ):
            _LOADED.popitem(last=False)
    return obj


def _prepared(obj: Any, kind: str) -> Any:
    """Work done once per loaded blob instead of in every task that uses it."""
    if kind == "flow_run_context":
        # Prefect's hydrated_context validates these dicts for every task; a model instance is kept
        from prefect.client.schemas.objects import FlowRun
        from prefect.results import ResultStore

        obj = dict(obj)
        if isinstance(obj.get("flow_run"), dict):
            obj["flow_run"] = FlowRun.model_validate(obj["flow_run"])
        if isinstance(obj.get("result_store"), dict):
            obj["result_store"] = ResultStore.model_validate(obj["result_store"])
    return obj
