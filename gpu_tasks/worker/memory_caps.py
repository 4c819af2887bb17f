"""Cap a ``gpu_memory_per_task`` worker's CuPy, RMM and PyTorch allocators to its tasks' shares
(docs/shared-hosts.md). On emulated devices :func:`apply` only records what it would cap, for tests."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from gpu_tasks import _gpu
from gpu_tasks.allocation import WORKER_ENV_EMULATED, WORKER_ENV_MEMORY_LIMIT

logger = logging.getLogger(__name__)

LIBRARIES = ("cupy", "rmm", "torch")
_APPLIED: dict[str, Any] = {}
_LOCK = threading.Lock()


def applied() -> dict[str, Any]:
    """What :func:`apply` did here: ``limit``, ``emulated`` and ``capped`` (library -> how, or why not)."""
    return dict(_APPLIED)


def apply() -> None:
    """Cap this worker's allocators to ``_GPU_TASKS_WORKER_GPU_MEMORY_LIMIT`` bytes, once per cap (a warm
    process bound again is capped again)."""
    with _LOCK:
        raw = os.environ.get(WORKER_ENV_MEMORY_LIMIT)
        if not raw or _APPLIED.get("limit") == int(raw):  # no cap, or this one is in force
            return
        limit = int(raw)
        emulated = os.environ.get(WORKER_ENV_EMULATED) == "1"
        capped: dict[str, str] = {}
        for name in LIBRARIES:
            if emulated:
                capped[name] = "not capped: emulated device (no allocator)"
            elif not _gpu.available(name):
                capped[name] = f"not capped: {_gpu.why_unavailable(name)}"
            else:
                try:
                    capped[name] = _CAPS[name](_gpu.load(name), limit)
                except Exception as exc:  # a library that cannot be capped must not fail the worker
                    logger.warning("could not cap %s to %d bytes", name, limit, exc_info=True)
                    capped[name] = f"not capped: {type(exc).__name__}: {exc}"
        _APPLIED.update(limit=limit, emulated=emulated, capped=capped)
        if logger.level == logging.NOTSET:  # a worker inherits Prefect's WARNING, which dropped this line
            logger.setLevel(logging.INFO)
        logger.info("worker allocators capped to %.2f GiB: %s", limit / 2**30, capped)


def _cupy(cupy: Any, limit: int) -> str:
    cupy.get_default_memory_pool().set_limit(size=limit)
    return f"default memory pool set_limit(size={limit})"


def _rmm(rmm: Any, limit: int) -> str:
    current = rmm.mr.get_current_device_resource()
    rmm.mr.set_current_device_resource(rmm.mr.LimitingResourceAdaptor(current, allocation_limit=limit))
    return f"LimitingResourceAdaptor(allocation_limit={limit}) over {type(current).__name__}"


def _torch(torch: Any, limit: int) -> str:
    if not torch.cuda.is_available():
        return "not capped: torch.cuda.is_available() is False"
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = min(1.0, limit / total)
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    return f"set_per_process_memory_fraction({fraction:.4f}) of {total} bytes"


_CAPS = {"cupy": _cupy, "rmm": _rmm, "torch": _torch}
