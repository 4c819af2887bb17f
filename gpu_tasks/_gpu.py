"""The one guarded place where GPU libraries are imported.

Importing :mod:`gpu_tasks` never imports cuDF, dask-cuda, rmm or pynvml. Callers
ask this module for a library; it imports it lazily, caches the outcome, and
records *why* a library is unavailable so logs and the CLI can say so.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any


class GpuLibraryUnavailable(ImportError):
    """A GPU library could not be imported; ``reason`` says why."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name} is not available: {reason}")
        self.library = name
        self.reason = reason


@functools.cache
def _try_import(name: str) -> ModuleType | str:
    try:
        return importlib.import_module(name)
    except Exception as exc:  # ImportError, but also CUDA errors raised at import
        hint = (
            "install the GPU extra: pip install 'gpu-tasks[gpu]'"
            if isinstance(exc, ModuleNotFoundError)
            else f"{type(exc).__name__}: {exc}"
        )
        return hint


def load(name: str) -> ModuleType:
    """Import a GPU library (``cudf``, ``dask_cuda``, ``dask_cudf``, ``rmm``, ``pynvml``).

    Raises:
        GpuLibraryUnavailable: with the reason the import failed.
    """
    outcome = _try_import(name)
    if isinstance(outcome, str):
        raise GpuLibraryUnavailable(name, outcome)
    return outcome


def available(name: str) -> bool:
    """Whether ``name`` imports on this machine (the result is cached)."""
    return not isinstance(_try_import(name), str)


def why_unavailable(name: str) -> str | None:
    """The reason ``name`` does not import, or ``None`` when it does."""
    outcome = _try_import(name)
    return outcome if isinstance(outcome, str) else None


def dask_cuda_worker_options(cuda: dict[str, Any], worker_kwargs: dict[str, Any]) -> dict[str, Any]:
    """What dask-cuda's ``LocalCUDACluster`` gives one worker, for a worker started elsewhere.

    Called in a warm worker process (:mod:`gpu_tasks._warm`) once it is bound to its device,
    so ``CUDA_VISIBLE_DEVICES`` is set before dask-cuda (or anything it loads) is imported.
    The same plugins (CPU affinity, RMM, cuDF setup and spilling), device-to-host spilling
    store and ``dask_cuda.initialize --create-cuda-context`` preload as dask-cuda's own workers.

    Args:
        cuda: a profile's :class:`~gpu_tasks.profiles.CudaOptions`, as a dict.
        worker_kwargs: the Dask ``Worker`` keyword arguments (``memory_limit``, ``nthreads``,
            ``preload``, ``preload_argv``).

    Returns:
        ``data``, ``plugins``, ``preload`` and ``preload_argv`` for the ``Worker``.
    """
    import logging
    import os

    from distributed.worker_memory import parse_memory_limit

    load("dask_cuda")
    from dask_cuda.utils import nvml_device_index, parse_device_memory_limit
    from dask_cuda.worker_common import worker_data_function, worker_plugins

    # the string, as LocalCUDACluster passes it: from a list dask-cuda returns the item as is ("0"),
    # which its plugins then take for an index (TypeError on a real GPU, docs/gpu.md)
    device_index = nvml_device_index(0, os.environ["CUDA_VISIBLE_DEVICES"])
    memory_limit = parse_memory_limit(
        worker_kwargs.get("memory_limit", "auto"),
        worker_kwargs.get("nthreads") or 1,
        logger=logging.getLogger("distributed.worker"),
    )
    data = worker_data_function(
        device_memory_limit=parse_device_memory_limit("default", device_index=device_index),
        memory_limit=memory_limit,
        enable_cudf_spill=cuda["enable_cudf_spill"],
    )(device_index)
    plugins = worker_plugins(
        device_index=device_index,
        rmm_initial_pool_size=cuda["rmm_pool_size"],
        rmm_maximum_pool_size=None,
        rmm_managed_memory=False,
        rmm_async_alloc=cuda["rmm_async"],
        rmm_release_threshold=None,
        rmm_log_directory=None,
        rmm_track_allocations=False,
        rmm_allocator_external_lib_list=None,
        pre_import=None,
        enable_cudf_spill=cuda["enable_cudf_spill"],
        cudf_spill_stats=False,
    )
    from gpu_tasks._worker_guard import add_preload

    return {
        **({"data": data} if data is not None else {}),
        "plugins": set(plugins) | set(worker_kwargs.get("plugins") or ()),
        **add_preload(
            worker_kwargs.get("preload"),
            worker_kwargs.get("preload_argv"),
            "dask_cuda.initialize",
            ("--create-cuda-context",),
        ),
    }
