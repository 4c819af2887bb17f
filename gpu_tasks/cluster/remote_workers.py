"""The workers of a scheduler the runner did not start, as it sees them: what each says of
itself (:func:`worker_facts`, run on the worker) and whether it can run a profile's tasks."""

from __future__ import annotations

import contextlib
import logging
import socket
from dataclasses import dataclass
from typing import Any

from gpu_tasks.devices.discovery import model_text
from gpu_tasks.policy import GPU_RESOURCE
from gpu_tasks.profiles import ResourceProfile
from gpu_tasks.worker.engine import owned_devices

logger = logging.getLogger("gpu_tasks.runner")


def worker_facts(dask_worker: Any = None) -> dict[str, Any]:
    """Run on a worker (``Client.run``): its host and the devices it owns (the first GPU-resource-many
    of its ``CUDA_VISIBLE_DEVICES``: ``dask cuda worker`` shows each worker every device, its own first)."""
    from gpu_tasks.devices.discovery import visible_devices

    own = owned_devices(dask_worker)
    devices = visible_devices().devices[:own]
    return {
        "host": socket.gethostname(),
        "devices": [d.address for d in devices],
        "names": [d.name for d in devices],
        "memory": [d.memory_total for d in devices],
        "emulated": visible_devices().emulated,
    }


def executing_keys(dask_worker: Any) -> list[str]:
    """Run on a worker (``Client.run``): the keys of the tasks it is executing now."""
    # distributed's documented worker state machine: WorkerState.tasks and each TaskState.state
    return [str(k) for k, ts in dask_worker.state.tasks.items() if ts.state in ("executing", "long-running")]


def started_keys(dask_worker: Any) -> list[str]:
    """Run on a worker (``Client.run``): the keys it is executing, and those ended there whose result
    or error it still holds (not queued, though their client may not have heard yet)."""
    started = ("executing", "long-running", "memory", "error")
    return [str(k) for k, ts in dask_worker.state.tasks.items() if ts.state in started]


@dataclass(frozen=True)
class RemoteWorker:
    """One worker of a remote scheduler, as the runner sees it."""

    address: str
    name: str
    host: str
    gpus: float  # its Dask GPU resource
    devices: tuple[str, ...] = ()  # CUDA_VISIBLE_DEVICES ids, when the worker told us
    names: tuple[str, ...] = ()
    memory: tuple[int | None, ...] = ()
    emulated: bool = False
    error: str = ""  # why it cannot run gpu-tasks tasks (it failed to describe itself), if so

    @property
    def device_keys(self) -> tuple[str, ...]:
        """``<host>:<id>`` of each device, as tags and the ledger name them."""
        return tuple(f"{self.host}:{d}" for d in self.devices)

    def models(self) -> dict[str, str]:
        """The model text of each device (``H100 80 GiB``) by its ``<host>:<id>`` key, where told."""
        memory = self.memory + (None,) * (len(self.names) - len(self.memory))
        return {
            key: model_text(name, mem, self.emulated)
            for key, name, mem in zip(self.device_keys, self.names, memory, strict=False)
        }

    def describe(self) -> str:
        """``gpu-host-1 (tcp://...): GPU=1, H100 (emulated)``."""
        what = f"GPU={self.gpus:g}" if self.gpus else "no GPU resource"
        if self.names:
            what += ", " + "/".join(self.names)
        return f"{self.name} on {self.host}: {what}"

    def why_not(self, profile: ResourceProfile) -> str | None:
        """Why this worker can never run a task of ``profile`` (``None``: it can)."""
        if self.error:
            return f"cannot run gpu-tasks tasks ({self.error}); install gpu-tasks, same version, on it"
        if not profile.is_gpu:
            return None
        need = float(profile.gpus) if profile.gpus >= 1 else float(profile.share)
        if self.gpus + 1e-9 < need:
            return f"GPU={self.gpus:g} < {need:g}"
        held = max(1.0, need)  # the devices one task holds (a share holds one, with others)
        if self.gpus > held + 1e-9:
            # its tasks run side by side there, each seeing every device the worker owns
            return (
                f"GPU={self.gpus:g} is more devices than a task of this profile holds ({held:g}): its "
                f"tasks would share all {self.gpus:g} there, each told it holds them alone; start one "
                f"worker per {held:g} device(s) with --resources GPU={held:g}"
            )
        if profile.gpu_model:
            if not self.names:
                return "publishes no device names (gpu_model)"
            if not all(profile.gpu_model.lower() in n.lower() for n in self.names):
                return f"devices {'/'.join(self.names)} do not match gpu_model={profile.gpu_model!r}"
        if profile.gpu_memory_total:
            if not self.memory or any(m is None for m in self.memory):
                return "publishes no device memory (gpu_memory_total)"
            if any(m is not None and m < profile.gpu_memory_total for m in self.memory):
                return f"device memory below gpu_memory_total={profile.gpu_memory_total / 2**30:.1f}GiB"
        return None


def is_leaving(answer: object) -> bool:
    """Whether a worker's answer to ``Client.run`` says it is closing or gone, not that it lacks gpu-tasks."""
    return isinstance(answer, OSError)


def read_workers(client: Any) -> dict[str, RemoteWorker]:
    """The scheduler's workers: their ``GPU`` resources and, where they can tell, their devices."""
    info = client.scheduler_info(n_workers=-1)["workers"]
    facts: dict[str, Any] = {}
    if info:
        with contextlib.suppress(Exception):  # workers without gpu-tasks cannot describe their devices
            facts = client.run(worker_facts, on_error="return")
    out = {}
    for address, w in info.items():
        f = facts.get(address)
        if is_leaving(f):
            continue  # closing or gone (a scale-down the scheduler has not finished): not a worker to use
        # a worker that cannot import gpu-tasks answers with the exception: a task would break it
        error = f"{type(f).__name__}: {f}" if isinstance(f, BaseException) else ""
        f = f if isinstance(f, dict) else {}
        out[address] = RemoteWorker(
            address=address,
            name=str(w.get("name") or address),
            host=str(f.get("host") or w.get("host") or address),
            gpus=float((w.get("resources") or {}).get(GPU_RESOURCE, 0.0)),
            devices=tuple(f.get("devices") or ()),
            names=tuple(f.get("names") or ()),
            memory=tuple(f.get("memory") or ()),
            emulated=bool(f.get("emulated")),
            error=error,
        )
    return out
