"""Exceptions raised by gpu-tasks: each names the thing at fault and the fix; foreign errors are
translated with ``raise ... from exc`` so the cause is kept."""

from __future__ import annotations


class GpuTasksError(Exception):
    """Base class for every error gpu-tasks raises on purpose."""


class SettingsError(GpuTasksError, ValueError):
    """A ``GPU_TASKS_*`` environment variable holds a value its setting does not take."""


class ProfileError(GpuTasksError, ValueError):
    """A resource profile (or its TOML file) is invalid."""

    fields: tuple[tuple[str, ...], ...] = ()  # the fields at fault (dotted paths), where known


class UnknownProfileError(GpuTasksError, KeyError):
    """A task names a profile the runner does not know."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class UnsatisfiableProfileError(GpuTasksError, RuntimeError):
    """The device inventory can never satisfy a profile's request."""


class DeviceDiscoveryError(GpuTasksError, RuntimeError):
    """Devices could not be discovered (bad emulation spec, failing discovery command)."""


class ClusterError(GpuTasksError, RuntimeError):
    """A profile's Dask cluster could not be provisioned or used."""


class GpuOutOfMemoryError(GpuTasksError, RuntimeError):
    """A task ran out of (device) memory. Not a ``MemoryError``: tblib cannot rebuild one in the flow
    process when gpu-tasks was imported before distributed."""


class TaskPreempted(BaseException):
    """Raised in a task's thread on a shared cluster's worker to preempt it; a ``BaseException`` so
    neither the task's ``except Exception`` nor Prefect's retries take it for the task's failure."""


class EnvironmentProblem(GpuTasksError, RuntimeError):
    """The environment Prefect runs in is broken (``PREFECT_HOME``, its database, a full disk,
    ``PREFECT_API_URL``): one line naming the cause, the path or URL, and the fix."""
