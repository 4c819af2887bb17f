"""gpu-tasks: GPU-aware stages for Prefect.

Tasks carry resource profiles (``profile:<name>`` tags); :class:`ProfileTaskRunner`
provisions one Dask cluster per profile when its first task arrives and closes it
when idle. Importing this package never needs a GPU or the RAPIDS libraries.
"""

from gpu_tasks.allocation import Allocation, current_allocation
from gpu_tasks.devices import Device, Inventory, discover
from gpu_tasks.errors import (
    ClusterError,
    DeviceDiscoveryError,
    GpuTasksError,
    PipelineInputError,
    ProfileError,
    UnknownProfileError,
    UnsatisfiableProfileError,
)
from gpu_tasks.profiles import CudaOptions, ResourceProfile, load_profiles_file, profile, use_profile
from gpu_tasks.runner import ProfileFuture, ProfileTaskRunner
from gpu_tasks.settings import GpuTasksSettings, get_settings

__all__ = [
    "Allocation",
    "ClusterError",
    "CudaOptions",
    "Device",
    "DeviceDiscoveryError",
    "GpuTasksError",
    "GpuTasksSettings",
    "Inventory",
    "PipelineInputError",
    "ProfileError",
    "ProfileFuture",
    "ProfileTaskRunner",
    "ResourceProfile",
    "UnknownProfileError",
    "UnsatisfiableProfileError",
    "current_allocation",
    "discover",
    "get_settings",
    "load_profiles_file",
    "profile",
    "use_profile",
]

__version__ = "0.1.0"
