"""What a running task was given: :func:`current_allocation`."""

from __future__ import annotations

import contextvars
import os
from collections.abc import Iterator
from contextlib import contextmanager

from pydantic import BaseModel, ConfigDict

WORKER_ENV_PROFILE = "GPU_TASKS_WORKER_PROFILE"
WORKER_ENV_EMULATED = "GPU_TASKS_WORKER_EMULATED"
WORKER_ENV_DEVICES = "GPU_TASKS_WORKER_DEVICES"


EMULATED_TAG = "gpu-tasks:emulated"


class Allocation(BaseModel):
    """The resources a task holds while it runs.

    Attributes:
        profile: Name of the profile the task runs on (``None`` outside a profiled task).
        devices: Device ids the task may use, as in ``CUDA_VISIBLE_DEVICES`` (empty for CPU).
        fraction: Share of each device the task holds (0.25 for a quarter; 0 for CPU).
        worker: Address of the Dask worker running the task.
        emulated: Whether the devices are emulated (no real GPU: pandas, XGBoost on CPU).
        device_names: Names of the devices, in the order of ``devices``.
    """

    model_config = ConfigDict(frozen=True)

    profile: str | None = None
    devices: tuple[str, ...] = ()
    fraction: float = 0.0
    worker: str | None = None
    emulated: bool = False
    device_names: tuple[str, ...] = ()

    @property
    def in_profile(self) -> bool:
        """Whether this is a task run by :class:`~gpu_tasks.ProfileTaskRunner`."""
        return self.profile is not None

    @property
    def has_gpu(self) -> bool:
        """Whether the task holds real (not emulated) devices."""
        return bool(self.devices) and not self.emulated

    def label(self) -> str:
        """Short text for logs and tags, e.g. ``gpu:0,1 (emulated)`` or ``cpu``."""
        if not self.devices:
            return "cpu"
        text = "gpu:" + ",".join(self.devices)
        return f"{text} (emulated)" if self.emulated else text

    def placement_tags(self) -> set[str]:
        """Task-run tags naming the devices: ``gpu:<id>`` each, plus ``gpu-tasks:emulated``."""
        tags = {f"gpu:{d}" for d in self.devices}
        if tags and self.emulated:
            tags.add(EMULATED_TAG)
        return tags


_CURRENT: contextvars.ContextVar[Allocation | None] = contextvars.ContextVar(
    "gpu_tasks_allocation", default=None
)


def current_allocation() -> Allocation:
    """The allocation of the task running in this thread.

    Outside a task run by :class:`~gpu_tasks.ProfileTaskRunner` this returns an
    allocation with ``profile=None`` and no devices (never an exception).
    """
    alloc = _CURRENT.get()
    if alloc is not None:
        return alloc
    return Allocation()


@contextmanager
def allocated(alloc: Allocation) -> Iterator[Allocation]:
    """Make ``alloc`` the current allocation for the duration of the block."""
    token = _CURRENT.set(alloc)
    try:
        yield alloc
    finally:
        _CURRENT.reset(token)


def worker_allocation(profile: str, fraction: float, worker: str | None) -> Allocation:
    """Build the allocation of a task on a GPU worker process from its environment."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    names = os.environ.get(WORKER_ENV_DEVICES, "")
    return Allocation(
        profile=profile,
        devices=tuple(d for d in visible.split(",") if d),
        fraction=fraction,
        worker=worker,
        emulated=os.environ.get(WORKER_ENV_EMULATED) == "1",
        device_names=tuple(n for n in names.split("|") if n),
    )
