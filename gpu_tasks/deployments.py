"""A deployment's description and tags from its flow's profiles, since the Prefect UI's Deployments
page shows those and not the task runner. Never ``profile:<name>`` tags: a flow run carries its
deployment's tags, and ``profile:`` tags route tasks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_tasks.errors import ProfileError
from gpu_tasks.profiles import ResourceProfile
from gpu_tasks.reporting.events import plural


@dataclass(frozen=True)
class DeploymentInfo:
    """A deployment's description and tags, from its flow's profiles."""

    description: str
    tags: list[str]
    # most devices held at once; None: as many as the host has (a profile without max_workers)
    gpus: int | None

    def kwargs(self) -> dict[str, Any]:
        """``description=`` and ``tags=`` for ``flow.serve`` / ``to_deployment`` / ``deploy``."""
        return {"description": self.description, "tags": list(self.tags)}


def _gib(n: int) -> str:
    return f"{n / 2**30:g} GiB"


def describe_profile(prof: ResourceProfile) -> str:
    """``gpu-train: 2 GPUs per task as a gang, H100, >= 40 GiB, up to 1 worker`` style."""
    if not prof.is_gpu:
        return f"{prof.name}: CPU ({prof.cpus:g} cores per task)"
    if prof.gpu_memory_per_task:
        parts = [f"{_gib(prof.gpu_memory_per_task)} of device memory per task"]
    elif prof.gpus < 1:
        parts = [f"1/{round(1 / prof.gpus)} GPU per task"]
    else:
        parts = [plural(prof.devices_per_worker, "GPU") + " per task" + (" as a gang" if prof.gang else "")]
    if prof.gpu_model:
        parts.append(prof.gpu_model)
    if prof.gpu_memory_total:
        parts.append(f">= {_gib(prof.gpu_memory_total)}")
    if prof.gpu_memory_free:
        parts.append(f"{_gib(prof.gpu_memory_free)} free")
    if prof.kind != "address":  # an existing cluster's workers are its owner's
        parts.append(
            "up to " + plural(prof.max_workers, "worker") if prof.max_workers else "a worker per free device"
        )
    if prof.kind != "local":
        parts.append("on " + ("a remote Dask cluster" if prof.kind == "address" else "a cluster manager"))
    if prof.fallback == "cpu":
        parts.append("CPU fallback")
    return f"{prof.name}: " + ", ".join(parts)


def most_gpus(profiles: dict[str, ResourceProfile]) -> int | None:
    """Devices the flow may hold at once at most, or ``None`` when a GPU profile has no ``max_workers``."""
    total = 0
    for prof in profiles.values():
        if not prof.is_gpu:
            continue
        if prof.max_workers is None:
            return None
        total += prof.max_workers * prof.devices_per_worker
    return total


def deployment_info(
    flow: Any, profiles_file: Path | str | None = None, summary: str | None = None
) -> DeploymentInfo:
    """Description and tags for a deployment of ``flow`` (a Prefect flow on a ProfileTaskRunner).

    Args:
        profiles_file: The ``GPU_TASKS_PROFILES_FILE`` the deployment's runs will use; default: this
            process's setting.
        summary: The description's first sentence; default: the first line of the flow's description.

    Raises:
        ProfileError: the task runner is not a ProfileTaskRunner, or its profiles do not resolve.
    """
    from gpu_tasks.runner import ProfileTaskRunner

    runner = getattr(flow, "task_runner", None)
    if not isinstance(runner, ProfileTaskRunner):
        raise ProfileError(
            f"flow {getattr(flow, 'name', flow)!r} does not use ProfileTaskRunner "
            f"(task_runner={type(runner).__name__}): set @flow(task_runner=ProfileTaskRunner(profiles=[...]))"
        )
    profiles, default = runner.resolve_profiles(Path(profiles_file) if profiles_file is not None else None)
    gpu = [p for p in profiles.values() if p.is_gpu]
    cpu = [p for p in profiles.values() if not p.is_gpu]
    gpus = most_gpus(profiles)
    if summary is None:
        lines = (getattr(flow, "description", None) or "").strip().splitlines()
        summary = lines[0] if lines else f"Flow {flow.name}"
    held = (
        f"Holds at most {plural(gpus, 'GPU')} at once"
        if gpus is not None
        else "Holds up to every free GPU of its host"
    )
    text = [summary.rstrip(".") + "."]
    if gpu:
        text.append("GPU profiles: " + "; ".join(describe_profile(p) for p in gpu) + ".")
        text.append(f"{held}, each only while its profile has work (gpu-tasks).")
    else:
        text.append("No GPU profiles: runs on CPU only (gpu-tasks).")
    text.append(
        "CPU profiles: " + ", ".join(p.name + (" (default)" if p.name == default else "") for p in cpu) + "."
    )
    tags = ["gpu-tasks", *(f"gpu-profile:{p.name}" for p in gpu)]
    tags += sorted({f"gpu-model:{p.gpu_model}" for p in gpu if p.gpu_model})
    if gpu:
        tags.append(f"gpus:{gpus}" if gpus is not None else "gpus:any")
    return DeploymentInfo(description=" ".join(text), tags=tags, gpus=gpus)
