"""dask-cuda's worker setup outside ``LocalCUDACluster`` (its undocumented ``worker_common``), for a
warm process once bound to a real GPU.
"""

from __future__ import annotations

from typing import Any

from gpu_tasks import _gpu
from gpu_tasks.compat import NotInstalled, Use, params


def worker_options(cuda: dict[str, Any], worker_kwargs: dict[str, Any]) -> dict[str, Any]:
    """What ``LocalCUDACluster`` gives one worker (``data``, ``plugins``, ``preload``,
    ``preload_argv``), from ``cuda`` (a profile's CudaOptions as a dict) and the ``Worker``'s kwargs."""
    import os

    from gpu_tasks.compat.distributed import add_preload, memory_limit

    _gpu.load("dask_cuda")
    from dask_cuda.worker_common import worker_data_function, worker_plugins

    # the device's NVML index as an int (its plugins take a string "0" for something else: TypeError
    # on a real GPU), or its UUID (GPU-..., MIG-...)
    first = os.environ["CUDA_VISIBLE_DEVICES"].split(",")[0]
    device_index: int | str = int(first) if first.isnumeric() else first
    data = worker_data_function(
        # "default": read by dask-cuda for this worker's own device (LocalCUDACluster reads its first)
        device_memory_limit="default",
        memory_limit=memory_limit(
            worker_kwargs.get("memory_limit", "auto"), worker_kwargs.get("nthreads") or 1
        ),
        enable_cudf_spill=cuda["enable_cudf_spill"],
    )(device_index)
    plugins = worker_plugins(**_plugin_kwargs(device_index, cuda))
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


def _plugin_kwargs(device_index: int | str, cuda: dict[str, Any]) -> dict[str, Any]:
    """The arguments of dask-cuda's ``worker_plugins``, as ``LocalCUDACluster`` gives them."""
    return dict(
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


def without_cpu_affinity(plugins: Any) -> set[Any]:
    """``plugins`` less dask-cuda's ``CPUAffinity`` (gpu-tasks pins its workers itself), matched by
    name so that dask-cuda is not imported."""
    return {
        p
        for p in plugins or ()
        if not (type(p).__name__ == "CPUAffinity" and str(type(p).__module__).split(".")[0] == "dask_cuda")
    }


_NO_CUDA_OPTIONS = {"rmm_pool_size": None, "rmm_async": False, "enable_cudf_spill": False}


def _check_worker_common() -> str | None:
    if not _gpu.available("dask_cuda"):
        raise NotInstalled(_gpu.why_unavailable("dask_cuda") or "dask_cuda")
    _gpu.load("dask_cuda")
    from dask_cuda import worker_common

    return params(
        worker_common.worker_data_function, "device_memory_limit", "memory_limit", "enable_cudf_spill"
    ) or params(worker_common.worker_plugins, *_plugin_kwargs(0, _NO_CUDA_OPTIONS))


USES = [
    Use(
        "dask-cuda",
        "dask_cuda.worker_common.worker_data_function / worker_plugins",
        "undocumented",
        "a warm process bound to a real GPU gets LocalCUDACluster's worker setup (RMM, affinity, spilling)",
        _check_worker_common,
    ),
]
