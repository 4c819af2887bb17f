"""What a running task was given: :func:`current_allocation`."""

from __future__ import annotations

import contextvars
import os
from collections.abc import Iterator
from contextlib import contextmanager

from pydantic import BaseModel, ConfigDict

WORKER_ENV_PROFILE = "_GPU_TASKS_WORKER_PROFILE"
WORKER_ENV_EMULATED = "_GPU_TASKS_WORKER_EMULATED"
WORKER_ENV_DEVICES = "_GPU_TASKS_WORKER_DEVICES"
# a gpu_memory_per_task profile's worker: each task's share, and its allocators' cap (slots x share)
WORKER_ENV_MEMORY_PER_TASK = "_GPU_TASKS_WORKER_GPU_MEMORY_PER_TASK"
WORKER_ENV_MEMORY_LIMIT = "_GPU_TASKS_WORKER_GPU_MEMORY_LIMIT"
EMULATED_TAG = "gpu-tasks:emulated"
ESCALATED_TAG = "gpu-tasks:on-oom"  # a task run moved to its profile's on_oom profile
# when (epoch seconds) the flow process found, before the lease, no concurrency limit on a placement tag
PLACEMENT_FREE_ENV = "_GPU_TASKS_PLACEMENT_TAGS_FREE_AT"


class Allocation(BaseModel):
    """The resources a task holds while it runs.

    Attributes:
        profile: Name of the profile the task runs on (``None`` outside a profiled task).
        devices: Device ids the task may use, as in ``CUDA_VISIBLE_DEVICES`` (empty for CPU).
        fraction: Share of each device the task holds (0.25 for a quarter; 0 for CPU).
        worker: Address of the Dask worker running the task.
        emulated: Whether the devices are emulated (no real GPU: the task computes on the CPU).
        device_names: Names of the devices, in the order of ``devices``.
        host: The worker's host for an ``address`` or ``cluster_class`` profile (else ``None``).
        memory_per_task: Device memory the task asked for (``gpu_memory_per_task``, bytes).
        memory_limit: The cap of the worker's allocators in bytes (``None``: uncapped).
    """

    model_config = ConfigDict(frozen=True)

    profile: str | None = None
    devices: tuple[str, ...] = ()
    fraction: float = 0.0
    worker: str | None = None
    emulated: bool = False
    device_names: tuple[str, ...] = ()
    host: str | None = None
    memory_per_task: int | None = None
    memory_limit: int | None = None

    @property
    def in_profile(self) -> bool:
        """Whether this is a task run by :class:`~gpu_tasks.ProfileTaskRunner`."""
        return self.profile is not None

    @property
    def has_gpu(self) -> bool:
        """Whether the task holds real (not emulated) devices."""
        return bool(self.devices) and not self.emulated

    @property
    def device_keys(self) -> tuple[str, ...]:
        """The devices as the ledger and tags name them: ``<host>:<id>`` on another host's worker."""
        return tuple(f"{self.host}:{d}" for d in self.devices) if self.host else self.devices

    def label(self) -> str:
        """Short text for logs and tags, e.g. ``gpu:0,1 (emulated)`` or ``cpu``."""
        if not self.devices:
            return "cpu"
        text = "gpu:" + ",".join(self.device_keys)
        return f"{text} (emulated)" if self.emulated else text

    def placement_tags(self) -> set[str]:
        """Task-run tags naming the devices (``gpu:<id>`` or ``gpu:<host>:<id>``), plus the emulated tag."""
        tags = {f"gpu:{d}" for d in self.device_keys}
        if tags and self.emulated:
            tags.add(EMULATED_TAG)
        return tags


_CURRENT: contextvars.ContextVar[Allocation | None] = contextvars.ContextVar(
    "gpu_tasks_allocation", default=None
)


def current_allocation() -> Allocation:
    """The allocation of the task running in this thread.

    Outside a ProfileTaskRunner task: ``profile=None`` and no devices (never an exception).
    """
    return _CURRENT.get() or Allocation()


@contextmanager
def allocated(alloc: Allocation) -> Iterator[Allocation]:
    """Make ``alloc`` the current allocation for the duration of the block."""
    token = _CURRENT.set(alloc)
    try:
        yield alloc
    finally:
        _CURRENT.reset(token)


def worker_allocation(
    profile: str, fraction: float, worker: str | None, host: str | None = None, own: int | None = None
) -> Allocation:
    """The allocation of a task on a worker process, from its environment; ``host``: a worker the runner
    did not start, whose ``own`` devices are discovered instead."""
    per_task: str | None = None
    limit: str | None = None
    if host is not None:
        from gpu_tasks.devices.discovery import worker_devices

        ids, device_names, emulated = worker_devices(own) if fraction > 0 else ((), (), False)
    else:
        ids = tuple(d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d)
        device_names = tuple(n for n in os.environ.get(WORKER_ENV_DEVICES, "").split("|") if n)
        emulated = os.environ.get(WORKER_ENV_EMULATED) == "1"
        per_task, limit = os.environ.get(WORKER_ENV_MEMORY_PER_TASK), os.environ.get(WORKER_ENV_MEMORY_LIMIT)
        if per_task and limit and fraction > 0:  # the device's share its tasks hold together
            fraction = min(1.0, int(per_task) / max(1, int(limit)))
    return Allocation(
        profile=profile,
        devices=ids,
        fraction=fraction,
        worker=worker,
        emulated=emulated,
        device_names=device_names,
        host=host,
        memory_per_task=int(per_task) if per_task else None,
        memory_limit=int(limit) if limit else None,
    )
