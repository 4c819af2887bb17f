"""gpu-tasks: GPU-aware stages for Prefect. :class:`ProfileTaskRunner` provisions one Dask cluster per
resource profile when its first task arrives and closes it when idle; importing never needs a GPU."""

import sys
import warnings
from pathlib import Path
from typing import Any

if sys.argv and Path(sys.argv[0]).stem == "gpu-tasks":  # the CLI reports it in one line, with the fix
    warnings.filterwarnings("ignore", "Failed to create the Prefect home directory", UserWarning)

from gpu_tasks.allocation import Allocation, current_allocation
from gpu_tasks.devices.discovery import Device, Inventory, discover
from gpu_tasks.errors import (
    ClusterError,
    DeviceDiscoveryError,
    EnvironmentProblem,
    GpuOutOfMemoryError,
    GpuTasksError,
    ProfileError,
    SettingsError,
    UnknownProfileError,
    UnsatisfiableProfileError,
)
from gpu_tasks.profiles import (
    CudaOptions,
    ResourceProfile,
    TlsOptions,
    load_profiles_file,
    profile,
    profile_tag,
    use_profile,
)
from gpu_tasks.runner import ProfileFuture, ProfileTaskRunner
from gpu_tasks.settings import GpuTasksSettings, get_settings

__all__ = [
    "Allocation",
    "ClusterError",
    "CudaOptions",
    "TlsOptions",
    "Device",
    "DeviceDiscoveryError",
    "EnvironmentProblem",
    "GpuOutOfMemoryError",
    "GpuTasksError",
    "GpuTasksSettings",
    "Inventory",
    "ProfileError",
    "ProfileFuture",
    "ProfileTaskRunner",
    "ResourceProfile",
    "SettingsError",
    "UnknownProfileError",
    "UnsatisfiableProfileError",
    "current_allocation",
    "discover",
    "get_settings",
    "load_profiles_file",
    "per_device_client",
    "profile",
    "profile_tag",
    "use_profile",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "per_device_client":  # imports distributed: only when asked for
        from gpu_tasks.cluster.backends import per_device_client

        return per_device_client
    if name == "PipelineInputError":  # the example pipeline's error; the plugin never imports the pipeline
        raise AttributeError(
            "gpu_tasks.PipelineInputError is the example pipeline's error and lives with it: "
            "from gpu_tasks.pipeline.errors import PipelineInputError"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
