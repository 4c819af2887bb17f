"""Device discovery, first that applies: ``GPU_TASKS_EMULATED_GPUS``, ``GPU_TASKS_DISCOVERY_COMMAND``
(Spark-style), NVML; else no devices. The inventory says which source it came from."""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import subprocess
from typing import Any, Literal

from dask.utils import format_bytes
from pydantic import BaseModel, ConfigDict

from gpu_tasks import _gpu
from gpu_tasks.devices import topology as wiring
from gpu_tasks.devices.topology import Topology
from gpu_tasks.errors import DeviceDiscoveryError
from gpu_tasks.settings import GpuTasksSettings, get_settings, size_bytes

Source = Literal["emulated", "command", "nvml", "none"]
DEFAULT_EMULATED_MODEL = "EMU"
DEFAULT_EMULATED_MEMORY = 16 * 2**30
EMULATED_SUFFIX = " (emulated)"  # ends the name of every emulated device
EMULATION_MEANS = (
    "no real GPU; workers get CUDA_VISIBLE_DEVICES and Dask GPU resources as on real devices, and "
    "tasks compute on the CPU"
)
"""What emulated devices mean for any flow, in the words of the runner's warning and the CLI."""


class Device(BaseModel):
    """One GPU (or MIG instance) that a worker can own; ``address`` goes into ``CUDA_VISIBLE_DEVICES``."""

    model_config = ConfigDict(frozen=True)

    address: str
    index: int
    name: str
    uuid: str | None = None
    memory_total: int | None = None
    memory_free: int | None = None
    compute_capability: str | None = None
    mig: bool = False
    emulated: bool = False
    # (pid, bytes) of programs outside gpu-tasks declared on this emulated device ("H100:80GiB@4242:60GiB")
    emulated_use: tuple[tuple[int, int], ...] = ()

    def describe(self) -> str:
        """``0: H100 80.00 GiB`` style line."""
        mem = format_bytes(self.memory_total) if self.memory_total else "memory unknown"
        return f"{self.address}: {self.name} ({mem})"

    def model(self) -> str:
        """Short model text for tables (:func:`model_text`)."""
        return model_text(self.name, self.memory_total, self.emulated)


def model_text(name: str, memory: int | None, emulated: bool) -> str:
    """``H100 80 GiB``; ``EMU 16 GiB, emulated`` for an emulated device (named ``EMU (emulated)``)."""
    if emulated and name.endswith(EMULATED_SUFFIX):
        name = name[: -len(EMULATED_SUFFIX)]
    parts = [name] if name else []
    if memory:
        parts.append(f"{memory / 2**30:.3g} GiB" if memory >= 2**30 else format_bytes(memory))
    text = " ".join(parts)
    return f"{text}, emulated" if emulated else text


class Inventory(BaseModel):
    """The devices of this host and where that knowledge came from."""

    model_config = ConfigDict(frozen=True)

    devices: tuple[Device, ...] = ()
    source: Source = "none"
    detail: str = ""
    topology: Topology | None = None

    @property
    def wiring(self) -> Topology:
        """:attr:`topology` (``None``: not read), or an unknown one for these devices."""
        return self.topology or Topology.unknown([d.address for d in self.devices])

    @property
    def emulated(self) -> bool:
        """Whether these devices are emulated (:data:`EMULATION_MEANS`)."""
        return self.source == "emulated"

    def describe(self) -> str:
        """One line for error messages: ``2 emulated devices: 0: H100 (80 GiB), 1: ...``."""
        if not self.devices:
            return f"no GPUs ({self.detail or self.source})"
        kind = "emulated " if self.emulated else ""
        items = ", ".join(d.describe() for d in self.devices)
        return f"{len(self.devices)} {kind}device(s) from {self.source}: {items}"


_ITEM_RE = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9 _.\-]*?)\s*(?::\s*([0-9.]+\s*[A-Za-z]*))?\s*$")
_USE_RE = re.compile(r"^\s*([0-9]+)\s*:\s*([0-9.]+\s*[A-Za-z]*)\s*$")
_REPEAT_RE = re.compile(r"^\s*([0-9]+)\s*\*(.*)$")
EMULATED_HINT = (
    'GPU_TASKS_EMULATED_GPUS must be a count such as "4" or a list of NAME:MEMORY items such as '
    '"H100:80GiB,L4:24GiB"; an item may end in @PID:MEMORY for a program outside gpu-tasks that uses '
    'that much of the device while the process PID runs ("H100:80GiB@4242:60GiB"), and start with N* '
    'for N such devices ("8*H100:80GiB"); the whole may end in /SHAPE for how the devices are wired '
    '("8/nvswitch", "8*H100:80GiB/2s4-nvpairs")'
)


def _size(text: str, what: str) -> int:
    """``text`` (``80GiB``, ``0``) in bytes; ``what`` names it in the error."""
    try:
        return size_bytes(text)
    except ValueError as exc:
        raise DeviceDiscoveryError(f"{EMULATED_HINT}; {what} has a bad memory size {text!r}") from exc


def _declared_use(number: int, item: str, uses: list[str], memory: int) -> tuple[tuple[int, int], ...]:
    """The ``@PID:MEMORY`` parts of item ``number`` as ``(pid, bytes)``."""
    out = []
    for use in uses:
        match = _USE_RE.match(use)
        if not match or int(match.group(1)) <= 0:
            raise DeviceDiscoveryError(
                f"{EMULATED_HINT}; item {number} ({item.strip()!r}): {'@' + use.strip()!r} is not "
                "@PID:MEMORY (a process id above 0 and the device memory it uses, such as @4242:60GiB)"
            )
        out.append((int(match.group(1)), _size(match.group(2), f"item {number}'s @{match.group(1)}")))
    if sum(n for _, n in out) > memory:
        raise DeviceDiscoveryError(
            f"{EMULATED_HINT}; item {number} ({item.strip()!r}) declares programs using "
            f"{format_bytes(sum(n for _, n in out))}, more than the device's {format_bytes(memory)}"
        )
    return tuple(out)


def parse_emulated(spec: str) -> tuple[Device, ...]:
    """Parse ``"4"`` or ``"2*H100:80GiB@4242:60GiB,L4:24GiB/SHAPE"`` (:data:`EMULATED_HINT`) into emulated
    devices; ``DeviceDiscoveryError`` names the bad item and the expected format."""
    text, shape = wiring.split_shape(spec)
    devices = _parse_devices(text)
    if shape is not None:
        wiring.check_shape(shape, len(devices), EMULATED_HINT)
    return devices


def emulated_inventory(spec: str) -> Inventory:
    """The inventory ``GPU_TASKS_EMULATED_GPUS=spec`` gives: its devices and their declared wiring."""
    devices = parse_emulated(spec)
    shape = wiring.split_shape(spec)[1]
    return Inventory(
        devices=devices,
        source="emulated",
        detail=f"GPU_TASKS_EMULATED_GPUS={spec!r}",
        topology=wiring.emulated_topology(shape, [d.address for d in devices]),
    )


def _repeat(items: list[str]) -> list[str]:
    """``["2*H100:80GiB", "L4"]`` -> ``["H100:80GiB", "H100:80GiB", "L4"]``."""
    out: list[str] = []
    for i, item in enumerate(items):
        match = _REPEAT_RE.match(item)
        if match is None:
            out.append(item)
            continue
        times = int(match.group(1))
        if not 1 <= times <= 64 or not match.group(2).strip():
            raise DeviceDiscoveryError(
                f"{EMULATED_HINT}; item {i + 1} ({item.strip()!r}): N*ITEM needs N from 1 to 64 and an "
                "item after '*'"
            )
        out.extend([match.group(2)] * times)
    return out


def _parse_devices(spec: str) -> tuple[Device, ...]:
    hint = EMULATED_HINT
    text = spec.strip()
    if not text:
        raise DeviceDiscoveryError(f"{hint}; got an empty value")
    found: list[tuple[str, int, tuple[tuple[int, int], ...]]] = []  # (name, memory, emulated_use)
    if text.isascii() and text.isdigit():  # str.isdigit() is also true for "²", which int() rejects
        count = int(text)
        if not 0 <= count <= 64:
            raise DeviceDiscoveryError(f"{hint}; a count must be between 0 and 64, got {count}")
        found = [(DEFAULT_EMULATED_MODEL, DEFAULT_EMULATED_MEMORY, ())] * count
    else:
        for i, item in enumerate(_repeat(text.split(","))):
            device, *uses = item.split("@")
            match = _ITEM_RE.match(device)
            if not match:
                raise DeviceDiscoveryError(
                    f"{hint}; item {i + 1} ({item.strip()!r}) is not NAME or NAME:MEMORY"
                )
            name, mem = match.group(1), match.group(2)
            if not mem and not (any(c.isalpha() for c in name) and any(c.isdigit() for c in name)):
                # "banana", "two" or "2.5" alone is no device model: a typo, not one device of that name
                raise DeviceDiscoveryError(
                    f"{hint}; item {i + 1} ({item.strip()!r}) is neither a whole count nor a model name "
                    f"such as H100 or L4 (give its memory to use another name: '{name}:16GiB')"
                )
            memory = _size(mem, f"item {i + 1}") if mem else DEFAULT_EMULATED_MEMORY
            if memory <= 0:
                raise DeviceDiscoveryError(f"{hint}; item {i + 1} has a memory size of zero")
            if mem and mem.strip().isdigit() and memory < 2**20:  # "H100:80": 80 bytes (a new-user pass)
                raise DeviceDiscoveryError(
                    f"{hint}; item {i + 1} ({item.strip()!r}) gives {memory} bytes of memory: write its unit "
                    f"('{name}:{mem.strip()}GiB')"
                )
            found.append((name, memory, _declared_use(i + 1, item, uses, memory)))
        if len(found) > 64:
            raise DeviceDiscoveryError(f"{hint}; at most 64 devices, got {len(found)}")
    return tuple(
        Device(
            address=str(i),
            index=i,
            name=f"{name}{EMULATED_SUFFIX}",
            uuid=f"EMU-{i}",
            memory_total=memory,
            memory_free=memory,
            emulated=True,
            emulated_use=use,
        )
        for i, (name, memory, use) in enumerate(found)
    )


def run_discovery_command(command: str, timeout: float = 30.0) -> tuple[Device, ...]:
    """Run a Spark-style discovery command that prints ``{"name": "gpu", "addresses": ["0", "1"]}``;
    ``DeviceDiscoveryError`` when it fails, times out, or prints something else."""
    where = f"discovery command {command!r} (GPU_TASKS_DISCOVERY_COMMAND)"
    try:
        argv = shlex.split(command)
        if not argv:  # subprocess.run([]) raises IndexError
            raise ValueError("the command is empty")
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, ValueError) as exc:
        raise DeviceDiscoveryError(f"{where} could not start: {exc}") from exc
    except subprocess.TimeoutExpired as exc:
        raise DeviceDiscoveryError(f"{where} did not finish within {timeout:g}s") from exc
    if proc.returncode != 0:
        raise DeviceDiscoveryError(
            f"{where} exited with {proc.returncode}: {proc.stderr.strip()[:500] or 'no output on stderr'}"
        )
    try:
        data = json.loads(proc.stdout)
    except json.JSONDecodeError as exc:
        raise DeviceDiscoveryError(
            f'{where} must print JSON like {{"name": "gpu", "addresses": ["0"]}}; got '
            f"{proc.stdout.strip()[:200]!r}"
        ) from exc
    addresses = data.get("addresses") if isinstance(data, dict) else None
    if not isinstance(addresses, list) or not all(isinstance(a, (str, int)) for a in addresses):
        raise DeviceDiscoveryError(f'{where} must print {{"name": "gpu", "addresses": [...]}}; got {data!r}')
    if isinstance(data, dict) and data.get("name", "gpu") != "gpu":
        raise DeviceDiscoveryError(f"{where} reported resource {data.get('name')!r}; only 'gpu' is supported")
    if len(set(map(str, addresses))) != len(addresses):
        raise DeviceDiscoveryError(f"{where} reported duplicate addresses {addresses}")
    return tuple(
        Device(address=str(a), index=i, name="GPU (from discovery command)") for i, a in enumerate(addresses)
    )


def nvml_devices() -> tuple[tuple[Device, ...], str]:
    """Devices from NVML (and their MIG instances), with a note on why none were found."""
    try:
        nvml = _gpu.nvml_init()
    except Exception as exc:  # no pynvml, NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return (), _gpu.nvml_problem(exc)
    try:
        devices: list[Device] = []
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
            name = _gpu.text(nvml.nvmlDeviceGetName(handle))
            uuid = _gpu.text(nvml.nvmlDeviceGetUUID(handle))
            migs = _mig_instances(nvml, handle, i, name, f"{major}.{minor}")
            if migs:
                devices.extend(migs)
                continue
            devices.append(
                Device(
                    address=str(i),
                    index=i,
                    name=name,
                    uuid=uuid,
                    memory_total=int(mem.total),
                    memory_free=int(mem.free),
                    compute_capability=f"{major}.{minor}",
                )
            )
        return tuple(devices), f"{len(devices)} device(s) from NVML"
    finally:
        _gpu.nvml_shutdown(nvml)


def _mig_instances(nvml: Any, handle: Any, index: int, name: str, cc: str) -> list[Device]:
    """MIG instances of a device as devices of their own (empty when MIG is off)."""
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except Exception:
        return []
    if current != getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1):
        return []
    out = []
    for j in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, j)
        except Exception:
            continue
        uuid = _gpu.text(nvml.nvmlDeviceGetUUID(mig))
        mem = nvml.nvmlDeviceGetMemoryInfo(mig)
        out.append(
            Device(
                address=uuid,
                index=index,
                name=f"{name} MIG {j}",
                uuid=uuid,
                memory_total=int(mem.total),
                memory_free=int(mem.free),
                compute_capability=cc,
                mig=True,
            )
        )
    return out


def discover(settings: GpuTasksSettings | None = None) -> Inventory:
    """Discover this host's devices (see the module docstring for precedence)."""
    settings = settings or get_settings()
    if settings.emulated_gpus is not None:
        return emulated_inventory(settings.emulated_gpus)
    if settings.discovery_command:
        devices = run_discovery_command(settings.discovery_command)
        return Inventory(devices=devices, source="command", detail=settings.discovery_command)
    devices, note = nvml_devices()
    if not devices:
        return Inventory(source="none", detail=note)
    topology = wiring.nvml_topology([d.address for d in devices])
    return Inventory(devices=devices, source="nvml", detail=note, topology=topology)


@functools.lru_cache(maxsize=1)
def visible_devices() -> Inventory:
    """The devices of ``CUDA_VISIBLE_DEVICES`` (unset: all) as :func:`discover` describes them, their ids as
    ``address``; read once per process, for workers the runner did not start."""
    try:
        inventory = discover()
    except DeviceDiscoveryError as exc:
        inventory = Inventory(detail=str(exc))
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        visible = [d.strip() for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    else:
        visible = [d.address for d in inventory.devices]
    known = {d.address: d for d in inventory.devices} | {d.uuid: d for d in inventory.devices if d.uuid}
    devices = tuple(
        known[v].model_copy(update={"address": v, "index": i})
        if v in known
        else Device(address=v, index=i, name="unknown", emulated=inventory.emulated)
        for i, v in enumerate(visible)
    )
    return Inventory(devices=devices, source=inventory.source, detail=inventory.detail)


def worker_devices(own: int | None = None) -> tuple[tuple[str, ...], tuple[str, ...], bool]:
    """``(ids, names, emulated)`` of the first ``own`` of :func:`visible_devices` (all: ``None``)."""
    inv = visible_devices()
    devices = inv.devices[:own]
    return tuple(d.address for d in devices), tuple(d.name for d in devices), inv.emulated
