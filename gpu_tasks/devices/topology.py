"""How this host's devices are wired (as ``nvidia-smi topo -m`` shows it) and each device's CPUs, from
NVML or an emulated shape. See docs/profiles.md, "Topology"."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

from gpu_tasks import _gpu
from gpu_tasks._gpu import reported, text
from gpu_tasks.errors import DeviceDiscoveryError

logger = logging.getLogger(__name__)

UNKNOWN = "?"
SELF = "X"
# nvmlDeviceGetTopologyCommonAncestor's levels (NVML_TOPOLOGY_*) as nvidia-smi names them
ANCESTOR_LEVELS = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
_PCIE_ORDER = ("PIX", "PXB", "PHB", "NODE", "SYS")
# the levels a profile may require (``topology=``), best first; "any" is the last resort
LEVELS = ("nvlink", "pcie-switch", "socket", "any")
LEVEL_MEANS = {
    "nvlink": "every pair joined by NVLink (NV<n>)",
    "pcie-switch": "every pair under one PCIe switch tree, no host bridge between (PIX, PXB)",
    "socket": "every pair on one CPU socket / NUMA node (PHB, NODE, or the same NUMA node)",
    "any": "anything (SYS or unknown wiring between some pair)",
}
NVSWITCH_LINKS = 18  # NVLinks per GPU on an NVSwitch box (DGX H100); what the emulated shape shows
NVPAIR_LINKS = 4  # NVLinks of a bridged pair in the emulated /<S>s<G>-nvpairs shape
SHAPES_HINT = (
    "a shape after '/' is 'nvswitch' (every pair NV18) or '<S>s<G>' with S sockets of G devices each "
    "(S x G = the device count; pairs of devices share a PCIe switch), optionally '-nvpairs' (each pair "
    "joined by NVLink), then optionally '-c<C>' (C CPU cores per socket: socket k has cores k*C to "
    "k*C+C-1): '8/nvswitch', '8*H100:80GiB/2s4-nvpairs', '2/2s1-c1'"
)
_SOCKETS_RE = re.compile(r"^([1-9][0-9]?)s([1-9][0-9]?)(-nvpairs)?(?:-c([1-9][0-9]{0,3}))?$")
_NVSWITCH_RE = re.compile(r"^nvswitch(?:-c([1-9][0-9]{0,3}))?$")


class Topology(BaseModel):
    """The wiring of an inventory's devices: ``matrix[i][j]`` is the path between ``addresses[i]`` and
    ``addresses[j]``; ``numa[i]`` and ``cpus[i]`` (``"0-47,96-143"``) device i's, ``None`` when unknown."""

    model_config = ConfigDict(frozen=True)

    addresses: tuple[str, ...] = ()
    matrix: tuple[tuple[str, ...], ...] = ()
    numa: tuple[int | None, ...] = ()
    cpus: tuple[str | None, ...] = ()
    source: str = "unknown"

    @classmethod
    def unknown(cls, addresses: Sequence[str], why: str = "unknown") -> Topology:
        """Every path ``?``, no NUMA node or CPU known."""
        n = len(addresses)
        return cls(
            addresses=tuple(addresses),
            matrix=tuple(tuple(SELF if i == j else UNKNOWN for j in range(n)) for i in range(n)),
            numa=(None,) * n,
            cpus=(None,) * n,
            source=why,
        )

    @property
    def known(self) -> bool:
        """Whether anything is known: a path or a NUMA node."""
        return any(v not in (SELF, UNKNOWN) for row in self.matrix for v in row) or any(
            n is not None for n in self.numa
        )

    def _at(self, address: str) -> int | None:
        try:
            return self.addresses.index(address)
        except ValueError:
            return None

    def link(self, a: str, b: str) -> str:
        """The path between devices ``a`` and ``b`` (``?``: unknown)."""
        i, j = self._at(a), self._at(b)
        if i is None or j is None:
            return UNKNOWN
        return self.matrix[i][j]

    def cpus_of(self, address: str) -> str | None:
        """The CPUs of device ``address`` (``"0-47,96-143"``; ``None``: unknown)."""
        i = self._at(address)
        return None if i is None or i >= len(self.cpus) else self.cpus[i]

    def numa_of(self, address: str) -> int | None:
        """The NUMA node of device ``address`` (``None``: unknown)."""
        i = self._at(address)
        return None if i is None or i >= len(self.numa) else self.numa[i]

    def as_json(self) -> dict[str, Any]:
        """What ``gpu-tasks devices --json`` shows under ``topology``."""
        return {
            "source": self.source,
            "addresses": list(self.addresses),
            "matrix": {
                a: dict(zip(self.addresses, row, strict=True))
                for a, row in zip(self.addresses, self.matrix, strict=True)
            },
            "numa": dict(zip(self.addresses, self.numa, strict=True)),
            "cpus": dict(zip(self.addresses, self.cpus, strict=True)),
            "legend": {
                "X": "the device itself",
                "NV<n>": "n NVLinks",
                "PIX": "one PCIe switch (or the same board)",
                "PXB": "several PCIe switches, no host bridge",
                "PHB": "a PCIe host bridge (the CPU)",
                "NODE": "host bridges within one NUMA node",
                "SYS": "across NUMA nodes (sockets)",
                "?": "unknown",
            },
        }


def nvlinks(level: str) -> int:
    """The NVLink count of ``NV<n>`` (0 for any other path)."""
    return int(level[2:]) if level.startswith("NV") and level[2:].isdigit() else 0


def level_rank(level: str) -> int:
    """How good a path is, lower better: NVLink (more links better), then PIX ... SYS, then unknown."""
    if (links := nvlinks(level)) > 0:
        return -links
    return _PCIE_ORDER.index(level) + 1 if level in _PCIE_ORDER else len(_PCIE_ORDER) + 1


def level_class(level: str, same_numa: bool = False) -> int:
    """Index in :data:`LEVELS` of the best level a ``level`` path meets (``same_numa``: at least socket)."""
    if nvlinks(level) > 0:
        return 0
    if level in ("PIX", "PXB"):
        return 1
    if level in ("PHB", "NODE") or same_numa:
        return 2
    return 3


def split_shape(spec: str) -> tuple[str, str | None]:
    """``"8*H100:80GiB/nvswitch"`` -> ``("8*H100:80GiB", "nvswitch")``; no ``/``: ``(spec, None)``."""
    devices, sep, shape = spec.rpartition("/")
    if not sep:
        return spec, None
    return devices, shape.strip().lower()


def check_shape(shape: str, count: int, hint: str) -> None:
    """Raise :class:`DeviceDiscoveryError` (``hint`` first) unless ``shape`` fits ``count`` devices."""
    if _NVSWITCH_RE.match(shape):
        return
    match = _SOCKETS_RE.match(shape)
    if not match:
        raise DeviceDiscoveryError(f"{hint}; {SHAPES_HINT}; got shape {shape!r}")
    sockets, per = int(match.group(1)), int(match.group(2))
    if sockets * per != count:
        raise DeviceDiscoveryError(
            f"{hint}; {SHAPES_HINT}; shape {shape!r} is {sockets} x {per} = {sockets * per} devices, "
            f"but the spec gives {count}"
        )


def emulated_topology(shape: str | None, addresses: Sequence[str]) -> Topology:
    """The wiring an emulated spec's shape (checked by :func:`check_shape`) declares."""
    n = len(addresses)
    if shape is None:
        return Topology.unknown(addresses, "unknown (emulated devices without a shape)")
    if switch := _NVSWITCH_RE.match(shape):
        per, pairs, cores = (n + 1) // 2, False, switch.group(1)  # two NUMA nodes of half the devices
    else:
        match = _SOCKETS_RE.match(shape)
        assert match is not None  # parse_emulated checked it
        per, pairs, cores = int(match.group(2)), bool(match.group(3)), match.group(4)

    def path(i: int, j: int) -> str:
        if i == j:
            return SELF
        if switch:
            return f"NV{NVSWITCH_LINKS}"
        if i // per != j // per:
            return "SYS"
        if (i % per) // 2 != (j % per) // 2:
            return "NODE"
        return f"NV{NVPAIR_LINKS}" if pairs else "PIX"

    numa = tuple(i // per for i in range(n))
    c = int(cores or 0)  # each device's declared CPUs: the cores of its NUMA node
    return Topology(
        addresses=tuple(addresses),
        matrix=tuple(tuple(path(i, j) for j in range(n)) for i in range(n)),
        numa=numa,
        cpus=tuple(format_cpus(range(k * c, k * c + c)) if cores else None for k in numa),
        source=f"emulated {shape}",
    )


def format_cpus(cores: Iterable[int]) -> str:
    """CPU numbers as a Linux CPU list: ``{0, 1, 2, 3, 8}`` -> ``"0-3,8"``."""
    runs: list[list[int]] = []
    for c in sorted(set(cores)):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def parse_cpus(text: str) -> frozenset[int]:
    """A Linux CPU list as CPU numbers: ``"0-3,8"`` -> ``{0, 1, 2, 3, 8}``; ``ValueError`` if it is none."""
    cores: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        low, _, high = part.partition("-")
        a, b = int(low), int(high or low)
        if a < 0 or b < a:
            raise ValueError(f"not a CPU list: {text!r}")
        cores.update(range(a, b + 1))
    return frozenset(cores)


def worker_cores(cpus: Sequence[str | None], allowed: Iterable[int]) -> tuple[frozenset[int] | None, str]:
    """The CPUs to pin a worker to (its devices' that are ``allowed``) and what to record, or (None, why)."""
    if not cpus:
        return None, "not applied: no device"
    if any(c is None for c in cpus):
        return None, "not applied: the device's CPUs are unknown"
    wanted = frozenset().union(*(parse_cpus(c) for c in cpus if c is not None))
    usable = wanted & frozenset(allowed)
    if not usable:
        return None, f"not applied: cores {format_cpus(wanted)} not available here"
    return usable, format_cpus(usable)


def cpu_list(masks: Sequence[int], bits: int = 64) -> str | None:
    """``nvmlDeviceGetCpuAffinity``'s masks (``bits`` CPUs each, lowest first) as ``"0-47,96-143"``."""
    cpus = [w * bits + b for w, mask in enumerate(masks) for b in range(bits) if int(mask) >> b & 1]
    return format_cpus(cpus) or None


def pcie_matrix(n: int, ancestor: Any) -> list[list[str]]:
    """The PCIe paths of ``n`` devices from ``ancestor(i, j)`` (an NVML_TOPOLOGY_* value; else ``?``)."""
    out = [[SELF if i == j else UNKNOWN for j in range(n)] for i in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            try:
                level = ANCESTOR_LEVELS.get(int(ancestor(i, j)), UNKNOWN)
            except Exception:
                level = UNKNOWN
            out[i][j] = out[j][i] = level
    return out


def add_nvlinks(
    matrix: list[list[str]], remotes: Sequence[Sequence[str | None]], bus_ids: Sequence[str]
) -> None:
    """Put ``NV<n>`` into ``matrix`` from the PCI bus id at the other end of each active link of each
    device (``remotes[i]``). A link to no device of ours goes to an NVSwitch, joining all such devices."""
    norm = [_bus(b) for b in bus_ids]
    direct: dict[tuple[int, int], int] = {}
    switched = [0] * len(remotes)
    for i, links in enumerate(remotes):
        for bus in (_bus(remote) for remote in links if remote is not None):
            if bus not in norm:
                switched[i] += 1
            elif (j := norm.index(bus)) != i:
                direct[(min(i, j), max(i, j))] = direct.get((min(i, j), max(i, j)), 0) + 1
    n = len(matrix)
    for i in range(n):
        for j in range(i + 1, n):
            # each end counts a direct link once: halve the sum of both ends' counts
            count = (direct.get((i, j), 0) + 1) // 2 + min(switched[i], switched[j])
            if count:
                matrix[i][j] = matrix[j][i] = f"NV{count}"


def _bus(bus_id: str) -> str:
    """A PCI bus id without its domain and case: ``00000000:17:00.0`` -> ``17:00.0``."""
    parts = bus_id.strip().lower().split(":")
    return ":".join(parts[-2:])


def nvml_topology(addresses: Sequence[str]) -> Topology:
    """The wiring of NVML devices ``addresses`` (their indexes); what NVML cannot say stays unknown."""
    n = len(addresses)
    if n == 0 or not all(a.isdigit() for a in addresses):  # MIG instances: wiring is the parent's
        return Topology.unknown(addresses, "unknown (MIG instances)" if n else "unknown")
    try:
        nvml = _gpu.nvml_init()
    except Exception as exc:
        return Topology.unknown(addresses, f"unknown (NVML: {type(exc).__name__})")
    try:
        return _read(nvml, [int(a) for a in addresses], addresses)
    except Exception as exc:  # any surprise from a driver: the wiring is unknown, discovery goes on
        logger.warning("could not read how the devices are wired from NVML", exc_info=True)
        return Topology.unknown(addresses, f"unknown (NVML: {type(exc).__name__})")
    finally:
        _gpu.nvml_shutdown(nvml)


def _read(nvml: Any, indexes: list[int], addresses: Sequence[str]) -> Topology:
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in indexes]
    n = len(handles)
    # an NVML without the call: every pair "?" (pcie_matrix)
    matrix = pcie_matrix(n, lambda i, j: nvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j]))
    bus_ids = [reported(lambda h=h: text(nvml.nvmlDeviceGetPciInfo(h).busId)) or "" for h in handles]
    remotes = [_links(nvml, h) for h in handles]
    add_nvlinks(matrix, remotes, bus_ids)
    numa = tuple(_numa(nvml, h, b) for h, b in zip(handles, bus_ids, strict=True))
    cpus = tuple(_cpus(getattr(nvml, "nvmlDeviceGetCpuAffinity", None), h) for h in handles)
    return Topology(
        addresses=tuple(addresses),
        matrix=tuple(tuple(r) for r in matrix),
        numa=numa,
        cpus=cpus,
        source="nvml",
    )


def _links(nvml: Any, handle: Any) -> list[str | None]:
    """The remote bus id of each active NVLink of ``handle``."""
    state = getattr(nvml, "nvmlDeviceGetNvLinkState", None)
    remote = getattr(nvml, "nvmlDeviceGetNvLinkRemotePciInfo_v2", None) or getattr(
        nvml, "nvmlDeviceGetNvLinkRemotePciInfo", None
    )
    if state is None or remote is None:
        return []
    out: list[str | None] = []
    for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
        if reported(lambda link=link: state(handle, link)) != getattr(nvml, "NVML_FEATURE_ENABLED", 1):
            continue
        out.append(reported(lambda link=link: text(remote(handle, link).busId)))
    return out


def _numa(nvml: Any, handle: Any, bus_id: str) -> int | None:
    """The device's NUMA node: NVML where it says, else Linux's sysfs for its PCI bus id."""
    node = reported(lambda: int(nvml.nvmlDeviceGetNumaNodeId(handle)))
    if node is not None and node >= 0:
        return int(node)
    if not bus_id:
        return None
    domain, _, rest = bus_id.lower().partition(":")
    raw = reported(lambda: open(f"/sys/bus/pci/devices/{domain[-4:]}:{rest}/numa_node").read())
    value = reported(lambda: int(raw)) if raw else None
    return value if value is not None and value >= 0 else None


def _cpus(affinity: Any, handle: Any) -> str | None:
    if affinity is None:
        return None
    words = max(1, -(-(os.cpu_count() or 1) // 64))
    masks = reported(lambda: list(affinity(handle, words)))
    return cpu_list(masks) if masks else None
