"""Programs outside gpu-tasks on this host's devices, sampled right before a lease is decided, and
whether they keep gpu-tasks off a device. See docs/shared-hosts.md, "Programs outside gpu-tasks"."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
from dask.utils import format_bytes

from gpu_tasks import _gpu
from gpu_tasks.devices import leases
from gpu_tasks.devices.discovery import Device

# one device as sampled: (source, pid -> device memory it uses, free, total, note)
_Sampled = tuple[str, dict[int, int | None], int | None, int | None, str]


@dataclass(frozen=True)
class Program:
    """One process outside gpu-tasks using a device (``None``: not readable here; ``hidden`` says why)."""

    pid: int
    memory: int | None
    user: str | None = None
    command: str | None = None
    hidden: str = ""

    def describe(self) -> str:
        """``pid 4242 (user alice, 'sleep 60') using 60.00 GiB``."""
        about = [f"user {self.user}"] if self.user else []
        if self.command:  # one line, however the program was started
            about.append(repr(" ".join(self.command.split())[:120]))
        if self.hidden:
            about.append(self.hidden)
        uses = format_bytes(self.memory) if self.memory is not None else "memory not reported"
        return f"pid {self.pid} ({', '.join(about) or 'nothing more known'}) using {uses}"


@dataclass(frozen=True)
class DeviceUse:
    """What programs outside gpu-tasks do on one device at one instant."""

    address: str
    source: str  # "nvml", "emulated"; "" when not sampled (``note`` says why)
    programs: tuple[Program, ...] = ()
    free: int | None = None
    total: int | None = None
    note: str = ""

    @property
    def used(self) -> int:
        """Device memory the programs use, as far as it is reported."""
        return sum(p.memory or 0 for p in self.programs)

    def describe(self) -> str:
        """``pid 4242 (...) using 60.00 GiB; pid ...``, ``none``, or why it was not sampled."""
        if not self.source:
            return self.note
        return "; ".join(p.describe() for p in self.programs) or "none"

    def as_dict(self) -> dict[str, Any]:
        """Plain dict for ``gpu-tasks devices --json``."""
        return {
            "sampled": self.source or None,
            "note": self.note,
            "free": self.free,
            "total": self.total,
            "used_by_others": self.used,
            "programs": [asdict(p) for p in self.programs],
        }


def limit_fix(reasons: Iterable[str], limit: int) -> str:
    """``, or lease beside them: raise GPU_TASKS_OTHER_PROGRAMS_MEMORY ...,`` when :func:`blocked`'s
    ``reasons`` include that limit (not too little free memory, which it does not change); else ``""``."""
    if not any("(GPU_TASKS_OTHER_PROGRAMS_MEMORY" in why for why in reasons):
        return ""
    return (
        f", or lease beside them: raise GPU_TASKS_OTHER_PROGRAMS_MEMORY (now {format_bytes(limit)}) above "
        "what they use,"
    )


def blocked(use: DeviceUse, limit: int, need: int | None = None) -> str | None:
    """Why ``use``'s device is not leased now, or ``None``: other programs use more than ``limit`` bytes
    (``GPU_TASKS_OTHER_PROGRAMS_MEMORY``; 0: any), or less than ``need`` bytes are free."""
    reasons = []
    if use.programs and (limit == 0 or use.used > limit):
        allowed = (
            "no other program may use it (GPU_TASKS_OTHER_PROGRAMS_MEMORY=0)"
            if limit == 0
            else f"more than the {format_bytes(limit)} other programs may use "
            "(GPU_TASKS_OTHER_PROGRAMS_MEMORY)"
        )
        reasons.append(f"used by {use.describe()}: {allowed}")
    if need and use.free is not None and use.free < need:
        by = f" (other programs: {use.describe()})" if use.programs and not reasons else ""
        reasons.append(
            f"{format_bytes(use.free)} free, less than the {format_bytes(need)} the profile needs "
            f"free (gpu_memory_free / gpu_memory_per_task){by}"
        )
    return "; ".join(reasons) or None


def sample(devices: Sequence[Device], lease_dir: Path | None = None) -> dict[str, DeviceUse]:
    """What programs outside gpu-tasks use on each of ``devices`` now, by address (emulated: as declared);
    the holders in ``lease_dir`` and their descendants are gpu-tasks' own."""
    raw: dict[str, _Sampled] = {}
    for d in devices:
        if d.emulated:
            live = {pid: n for pid, n in d.emulated_use if _alive(pid)}
            free = None if d.memory_total is None else max(0, d.memory_total - sum(live.values()))
            raw[d.address] = ("emulated", dict(live), free, d.memory_total, "")
    real = [d for d in devices if not d.emulated]
    if real:
        raw.update(_nvml(real))
    own: set[int] | None = None
    out = {}
    for address, (source, pids, free, total, note) in raw.items():
        programs = []
        for pid, memory in sorted(pids.items()):
            own = _own_pids(lease_dir) if own is None else own
            program = _program(pid, memory, own)
            if program is not None:
                programs.append(program)
        out[address] = DeviceUse(address, source, tuple(programs), free, total, note)
    return out


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has ended: it only waits for its parent)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _own_pids(lease_dir: Path | None) -> set[int]:
    """This process and every lease holder on this host."""
    pids = {os.getpid()}
    with contextlib.suppress(OSError):
        for info in leases.holders(lease_dir).values():
            if info and info.get("hostname") in (None, socket.gethostname()) and info.get("pid"):
                pids.add(int(info["pid"]))
    return pids


def _program(pid: int, memory: int | None, own: set[int]) -> Program | None:
    """``pid`` as a :class:`Program`, or ``None`` when it is gpu-tasks' own."""
    if memory is not None and memory >= _gpu.NVML_NOT_REPORTED:
        memory = None
    try:
        proc = psutil.Process(pid)
        if pid in own or any(parent.pid in own for parent in proc.parents()):
            return None
    except psutil.NoSuchProcess:
        return Program(
            pid, memory, hidden="not visible from here: another PID namespace, or it has just ended"
        )
    except psutil.Error:  # its ancestry cannot be read: not known to be ours
        pass
    user: str | None = None
    command: str | None = None
    hidden = []
    try:
        user = proc.username()
    except psutil.NoSuchProcess:  # seen above, ended since (a zombie included): it uses nothing now
        return None
    except (psutil.Error, KeyError):
        hidden.append("user not visible")
    try:
        command = " ".join(proc.cmdline()) or f"[{proc.name()}]"
    except psutil.NoSuchProcess:  # as above: ended while it was read
        return None
    except psutil.AccessDenied:
        hidden.append("command hidden: another user's process")
    except psutil.Error:
        hidden.append("command not visible")
    return Program(pid, memory, user, command, ", ".join(hidden))


def _nvml(devices: Sequence[Device]) -> dict[str, _Sampled]:
    """NVML's running processes (compute and graphics) and free memory of each of ``devices``."""
    try:
        nvml = _gpu.nvml_init()
    except Exception as exc:  # no pynvml, NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return {d.address: ("", {}, None, None, f"not sampled: {_gpu.nvml_problem(exc)}") for d in devices}
    out: dict[str, _Sampled] = {}
    try:
        for d in devices:
            try:
                handle = _gpu.nvml_handle(nvml, d.uuid, d.address)
                mem = nvml.nvmlDeviceGetMemoryInfo(handle)
                pids: dict[int, int | None] = {}
                for listing in (
                    nvml.nvmlDeviceGetComputeRunningProcesses,
                    nvml.nvmlDeviceGetGraphicsRunningProcesses,
                ):
                    for p in listing(handle):
                        used = getattr(p, "usedGpuMemory", None)
                        seen = pids.get(int(p.pid))
                        pids[int(p.pid)] = used if seen is None else max(seen, used or 0)
                out[d.address] = ("nvml", pids, int(mem.free), int(mem.total), "")
            except Exception as exc:
                out[d.address] = ("", {}, None, None, f"not sampled: NVML: {type(exc).__name__}: {exc}")
    finally:
        _gpu.nvml_shutdown(nvml)
    return out
