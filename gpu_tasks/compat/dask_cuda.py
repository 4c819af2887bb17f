"""dask-cuda's worker setup outside ``LocalCUDACluster``: its undocumented ``worker_common``
functions, used by a warm process once bound to a real GPU. Without dask-cuda (no ``gpu`` extra)
the check raises :class:`~gpu_tasks.compat.NotInstalled`; ``tests/test_cuda_options.py`` runs the
same calls against a stand-in. What was checked on which GPU: docs/gpu.md.
"""

from __future__ import annotations

from typing import Any

from gpu_tasks import _gpu
from gpu_tasks.compat import NotInstalled, Use, params


def worker_options(cuda: dict[str, Any], worker_kwargs: dict[str, Any]) -> dict[str, Any]:
    """What dask-cuda's ``LocalCUDACluster`` gives one worker (plugins, spilling store, the
    ``dask_cuda.initialize --create-cuda-context`` preload), for a warm worker process once bound to
    its device, so ``CUDA_VISIBLE_DEVICES`` is set before dask-cuda is imported.

    Args:
        cuda: a profile's :class:`~gpu_tasks.profiles.CudaOptions`, as a dict.
        worker_kwargs: the Dask ``Worker`` keyword arguments (``memory_limit``, ``nthreads``,
            ``preload``, ``preload_argv``).

    Returns:
        ``data``, ``plugins``, ``preload`` and ``preload_argv`` for the ``Worker``.
    """
    import os

    from gpu_tasks.compat.distributed import add_preload, memory_limit

    _gpu.load("dask_cuda")
    from dask_cuda.worker_common import worker_data_function, worker_plugins

    # as LocalCUDACluster gives it: the device's NVML index as an int (a string, "0", its plugins
    # take for something else: TypeError on a real GPU, docs/gpu.md), or its UUID (GPU-..., MIG-...)
    first = os.environ["CUDA_VISIBLE_DEVICES"].split(",")[0]
    device_index: int | str = int(first) if first.isnumeric() else first
    data = worker_data_function(
        # "default", read by dask-cuda for this worker's own device: 80% of its memory, or no
        # spilling on a device without memory of its own (LocalCUDACluster reads it for its first device)
        device_memory_limit="default",
        memory_limit=memory_limit(
            worker_kwargs.get("memory_limit", "auto"), worker_kwargs.get("nthreads") or 1
        ),
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


def without_cpu_affinity(plugins: Any) -> set[Any]:
    """``plugins`` less dask-cuda's ``CPUAffinity``: gpu-tasks pins its workers itself
    (:mod:`gpu_tasks.worker.affinity`). Matched by class name and module, so no dask-cuda import."""
    return {
        p
        for p in plugins or ()
        if not (type(p).__name__ == "CPUAffinity" and str(type(p).__module__).split(".")[0] == "dask_cuda")
    }


# ---------------------------------------------------------------- the uses, with feature checks
def _check_worker_common() -> str | None:
    if not _gpu.available("dask_cuda"):
        raise NotInstalled(_gpu.why_unavailable("dask_cuda") or "dask_cuda")
    _gpu.load("dask_cuda")
    from dask_cuda import worker_common

    return params(
        worker_common.worker_data_function, "device_memory_limit", "memory_limit", "enable_cudf_spill"
    ) or params(
        worker_common.worker_plugins,
        "device_index",
        "rmm_initial_pool_size",
        "rmm_maximum_pool_size",
        "rmm_managed_memory",
        "rmm_async_alloc",
        "rmm_release_threshold",
        "rmm_log_directory",
        "rmm_track_allocations",
        "rmm_allocator_external_lib_list",
        "pre_import",
        "enable_cudf_spill",
        "cudf_spill_stats",
    )


USES = [
    Use(
        "dask-cuda",
        "dask_cuda.worker_common.worker_data_function / worker_plugins",
        "undocumented",
        "a warm process bound to a real GPU gets LocalCUDACluster's worker setup (RMM, affinity, spilling)",
        _check_worker_common,
    ),
]
