"""Pure scheduling decisions (which devices, how many workers, when to close): no I/O, no clock;
gpu_tasks.cluster.local and gpu_tasks.runner act on them."""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gpu_tasks.allocation import (
    WORKER_ENV_DEVICES,
    WORKER_ENV_EMULATED,
    WORKER_ENV_MEMORY_LIMIT,
    WORKER_ENV_MEMORY_PER_TASK,
    WORKER_ENV_PROFILE,
)
from gpu_tasks.devices.discovery import Device, Inventory
from gpu_tasks.devices.topology import LEVEL_MEANS, LEVELS, Topology, level_class, level_rank
from gpu_tasks.profiles import ResourceProfile

GPU_RESOURCE = "GPU"
# a gpu_memory_per_task profile's tasks ask for their bytes of it; its worker has slots x that
GPU_MEMORY_RESOURCE = "GPU_MEMORY"
# the profile's on_oom, in its workers' environment: their out-of-memory errors say where the task re-runs
WORKER_ENV_ON_OOM = "_GPU_TASKS_WORKER_ON_OOM"


def matching_devices(profile: ResourceProfile, inventory: Inventory) -> list[Device]:
    """Devices matching ``gpu_model`` with total memory >= ``gpu_memory_total`` and ``gpu_memory_free``
    (a device smaller than the free memory a lease needs never has it)."""
    out = []
    for dev in inventory.devices:
        if profile.gpu_model and profile.gpu_model.lower() not in dev.name.lower():
            continue
        at_least = max(profile.gpu_memory_total or 0, profile.gpu_memory_free or 0)
        if at_least and (dev.memory_total is None or dev.memory_total < at_least):
            continue
        per_task = profile.gpu_memory_per_task
        if per_task and dev.memory_total is not None and dev.memory_total < per_task:
            continue  # not even one task fits (unknown memory is given the benefit)
        out.append(dev)
    return out


def unsatisfiable_reason(profile: ResourceProfile, inventory: Inventory) -> str | None:
    """Why ``profile`` can never run on ``inventory``, or ``None`` when it can."""
    if not profile.is_gpu:
        return None
    wanted = _describe_request(profile)
    if not inventory.devices:
        return f"profile {profile.name!r} asks for {wanted}, but this host has {inventory.describe()}"
    matching = matching_devices(profile, inventory)
    # without the memory request: the devices gpu_model, gpu_memory_total and gpu_memory_free match
    filtered = matching_devices(profile.model_copy(update={"gpu_memory_per_task": None}), inventory)
    if not matching and filtered:
        largest = max(d.memory_total or 0 for d in filtered)
        return (
            f"profile {profile.name!r} asks for {wanted}, more than any matching device's memory; "
            f"inventory: {inventory.describe()}. Lower gpu_memory_per_task to at most "
            f"{largest / 2**30:.1f}GiB or run the profile on a host with larger devices"
        )
    if not matching:
        fixes = {"gpu_model": "change", "gpu_memory_total": "lower", "gpu_memory_free": "lower"}
        fields = [f for f in fixes if getattr(profile, f)]
        off = dict.fromkeys(fields, None) | {"gpu_memory_per_task": None}
        # at fault: each filter that alone matches no device (all of them), else their combination (one)
        alone = [
            f
            for f in fields
            if not matching_devices(profile.model_copy(update={**off, f: getattr(profile, f)}), inventory)
        ]
        fix = (" and " if alone else " or ").join(f"{fixes[f]} {f}" for f in alone or fields)
        return (
            f"profile {profile.name!r} asks for {wanted}, but no device matches; inventory: "
            f"{inventory.describe()}. {fix[0].upper()}{fix[1:]} to match a device"
        )
    if profile.devices_per_worker > len(matching):
        return (
            f"profile {profile.name!r} asks for {wanted} per task, but only {len(matching)} matching "
            f"device(s) exist; inventory: {inventory.describe()}. Lower gpus to at most {len(matching)}"
        )
    return topology_reason(profile, inventory)


def _describe_request(profile: ResourceProfile) -> str:
    if profile.gpu_memory_per_task:
        parts = [f"gpu_memory_per_task={profile.gpu_memory_per_task / 2**30:.1f}GiB"]
    else:
        parts = [f"gpus={profile.gpus:g}"]
    if profile.gpu_model:
        parts.append(f"gpu_model={profile.gpu_model!r}")
    if profile.gpu_memory_total:
        parts.append(f"gpu_memory_total>={profile.gpu_memory_total / 2**30:.1f}GiB")
    if profile.gpu_memory_free:
        parts.append(f"gpu_memory_free>={profile.gpu_memory_free / 2**30:.1f}GiB")
    return "(" + ", ".join(parts) + ")"


def device_groups(profile: ResourceProfile, devices: list[Device]) -> list[tuple[Device, ...]]:
    """Per-worker groups of n devices, all eligible: ``max_workers`` caps how many are held at once."""
    per = profile.devices_per_worker
    if per == 0:
        return []
    return [tuple(devices[i : i + per]) for i in range(0, len(devices) - per + 1, per)]


# ------------------------------------------------------------------ wiring: which devices a group takes
_SEARCH_SETS = 400  # candidate sets per level: an 8-GPU host has at most 70 of any size
_SEARCH_STEPS = 20_000


def level_index(level: str | None) -> int:
    """The index in LEVELS of ``level`` (``None``: "any")."""
    return LEVELS.index(level) if level is not None else len(LEVELS) - 1


def pair_class(topology: Topology, a: str, b: str) -> int:
    """The best level (index in LEVELS) ``a`` and ``b`` meet: their path, or their NUMA node."""
    na, nb = topology.numa_of(a), topology.numa_of(b)
    return level_class(topology.link(a, b), same_numa=na is not None and na == nb)


def set_level(topology: Topology, addresses: Sequence[str]) -> int:
    """The level (index in LEVELS) every pair of ``addresses`` meets; 0 for a single device."""
    return max((pair_class(topology, a, b) for a, b in itertools.combinations(addresses, 2)), default=0)


def gang_wiring(topology: Topology, chosen: Sequence[str], candidates: Sequence[Device]) -> tuple[str, str]:
    """``(worst link, better set)`` of a gang on ``chosen``: its worst path, and the best-connected set
    among ``candidates`` (busy or free) if it meets a better level, else ``""``."""
    if len(chosen) < 2 or not topology.known:
        return "", ""
    worst = max((topology.link(a, b) for a, b in itertools.combinations(chosen, 2)), key=level_rank)
    best = best_connected(topology, candidates, len(chosen))
    if best is None:
        return worst, ""
    addresses = [d.address for d in best]
    level = set_level(topology, addresses)
    better = level < set_level(topology, chosen)
    return worst, f"{','.join(addresses)} ({LEVELS[level]})" if better else ""


def best_connected(
    topology: Topology, free: Sequence[Device], n: int, at_most: int | None = None
) -> tuple[Device, ...] | None:
    """The best-connected ``n`` of ``free`` whose every pair meets level ``at_most``, or ``None``.

    Best: level, then worst path, then fewest good links cut from those left (NVLink pairs stay whole).
    """
    if n <= 0 or n > len(free):
        return None
    limit = len(LEVELS) - 1 if at_most is None else at_most
    if not topology.known:
        return tuple(free[:n]) if limit == len(LEVELS) - 1 or n == 1 else None
    addrs = [d.address for d in free]
    m = len(addrs)
    pairs = [[(i, j) for j in range(m)] for i in range(m)]
    cls = [[0 if i == j else pair_class(topology, addrs[i], addrs[j]) for i, j in row] for row in pairs]
    rank = [[0 if i == j else level_rank(topology.link(addrs[i], addrs[j])) for i, j in row] for row in pairs]
    for level in range(limit + 1):
        sets = _cliques(m, n, lambda i, j, level=level: cls[i][j] <= level)
        if not sets:
            continue

        def key(chosen: tuple[int, ...]) -> tuple[Any, ...]:
            worst = max((rank[i][j] for i, j in itertools.combinations(chosen, 2)), default=0)
            inside = set(chosen)
            cut = [0] * (len(LEVELS) - 1)
            for i in chosen:
                for j in range(m):
                    if j not in inside and cls[i][j] < len(LEVELS) - 1:
                        cut[cls[i][j]] += 1
            return (worst, tuple(cut), chosen)

        best = min(sets, key=key)
        return tuple(free[i] for i in best)
    return None


def _cliques(m: int, n: int, joined: Any) -> list[tuple[int, ...]]:
    """Up to ``_SEARCH_SETS`` sets of ``n`` of ``range(m)`` whose every pair is ``joined``."""
    found: list[tuple[int, ...]] = []
    steps = 0

    def grow(chosen: list[int], candidates: list[int]) -> bool:
        nonlocal steps
        if len(chosen) == n:
            found.append(tuple(chosen))
            return len(found) >= _SEARCH_SETS
        for k, i in enumerate(candidates):
            steps += 1
            if steps > _SEARCH_STEPS or len(chosen) + len(candidates) - k < n:
                return steps > _SEARCH_STEPS
            if grow([*chosen, i], [j for j in candidates[k + 1 :] if joined(i, j)]):
                return True
        return False

    grow([], list(range(m)))
    return found


def wired_groups(
    topology: Topology, devices: Sequence[Device], per: int, at_most: int | None = None
) -> list[tuple[Device, ...]]:
    """``devices`` cut into disjoint groups of ``per``, each the best-connected of what is left."""
    left = list(devices)
    out: list[tuple[Device, ...]] = []
    while per > 0 and len(left) >= per:
        group = best_connected(topology, left, per, at_most)
        if group is None:
            break
        out.append(group)
        left = [d for d in left if d not in group]
    return out


def worker_groups(profile: ResourceProfile, inventory: Inventory) -> list[tuple[Device, ...]]:
    """Every device group ``profile``'s workers may own; with ``topology``, those cut by wiring."""
    devices = matching_devices(profile, inventory)
    if profile.topology is None:
        return device_groups(profile, devices)
    if not inventory.wiring.known:
        return []
    return wired_groups(inventory.wiring, devices, profile.devices_per_worker, level_index(profile.topology))


def placement_groups(
    profile: ResourceProfile, topology: Topology, devices: Sequence[Device], free: set[str], n_groups: int
) -> list[tuple[Device, ...]]:
    """Disjoint device groups in the order to try for ``n_groups`` new workers (``free``: addresses free
    now): best-connected free sets first (a gang: one set), then the rest, for the device queue."""
    per = profile.devices_per_worker
    required = None if profile.topology is None else level_index(profile.topology)
    if not topology.known or per == 0:
        return device_groups(profile, list(devices)) if required is None else []
    idle = [d for d in devices if d.address in free]
    out: list[tuple[Device, ...]] = []
    if profile.gang:
        whole = best_connected(topology, idle, n_groups * per, required)
        if whole is None and required is not None:  # wait for the qualifying set with the most free now
            ordered = sorted(devices, key=lambda d: d.address not in free)
            whole = best_connected(topology, ordered, n_groups * per, required)
        if whole is not None:
            out = wired_groups(topology, whole, per)
        if required is not None:
            return out  # another set may not meet the level with these groups: wait for this one
    else:
        out = wired_groups(topology, idle, per, required)
    taken = {d.address for g in out for d in g}
    return out + wired_groups(topology, [d for d in devices if d.address not in taken], per, required)


def topology_reason(profile: ResourceProfile, inventory: Inventory) -> str | None:
    """Why ``profile``'s ``topology`` level can never be met on ``inventory``, or ``None``."""
    if profile.topology is None or not profile.is_gpu:
        return None
    devices = matching_devices(profile, inventory)
    per = profile.devices_per_worker
    size = per * (profile.max_workers or 1) if profile.gang else per
    per_what = f"a gang of {profile.max_workers} worker(s)" if profile.gang else f"gpus={profile.gpus:g}"
    what = f"{size} device(s) ({per_what})"
    wiring = inventory.wiring
    if not wiring.known:
        return (
            f"profile {profile.name!r} requires topology={profile.topology!r} for its {what}, but this "
            f"host's wiring is {wiring.source}; remove topology, or on emulated devices declare a shape "
            "(GPU_TASKS_EMULATED_GPUS='8/2s4-nvpairs')"
        )
    if best_connected(wiring, devices, size, level_index(profile.topology)) is None:
        best = best_connected(wiring, devices, size)
        got = (
            f"the best set is {','.join(d.address for d in best)} "
            f"({LEVELS[set_level(wiring, [d.address for d in best])]})"
            if best
            else f"only {len(devices)} matching device(s)"
        )
        return (
            f"profile {profile.name!r} requires topology={profile.topology!r} "
            f"({LEVEL_MEANS[profile.topology]}) for its {what}, but no such set of matching devices exists "
            f"on this host: {got}; lower topology or remove it"
        )
    return None


def cpu_count() -> int:
    """Cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def memory_slots(profile: ResourceProfile, device: Device, free: int | None = None) -> int:
    """Tasks of a ``gpu_memory_per_task`` profile that fit on ``device`` (``free`` memory, else total)."""
    per_task = profile.gpu_memory_per_task or 0
    memory = free if free is not None else device.memory_total
    if not per_task or memory is None:
        return 1
    return max(1, memory // per_task)


def slots_per_worker(
    profile: ResourceProfile, cores: int | None = None, device: Device | None = None, free: int | None = None
) -> int:
    """How many tasks of ``profile`` one worker runs at once: k for ``gpus=1/k``, memory slots for a
    ``gpu_memory_per_task`` profile (1 before its device is known), cores / ``cpus`` on CPU."""
    if profile.by_memory:
        return memory_slots(profile, device, free) if device is not None else 1
    if profile.is_gpu:
        return int(1 / profile.share) if profile.share < 1 else 1
    cores = cores or cpu_count()
    return max(1, math.floor(cores / profile.cpus + 1e-9))


def max_worker_count(profile: ResourceProfile, groups: int) -> int:
    """The most workers ``profile`` may have at once: device groups capped by max_workers (GPU)."""
    if profile.is_gpu:
        return groups if profile.max_workers is None else min(groups, profile.max_workers)
    return profile.max_workers or 1


def bound_at_most(profiles: list[ResourceProfile], inventory: Inventory) -> int:
    """The most workers ``profiles`` can have at once (the warm pool keeps no more processes)."""
    total = 0
    for prof in profiles:
        groups = len(device_groups(prof, matching_devices(prof, inventory))) if prof.is_gpu else 0
        total += max_worker_count(prof, groups)
    return total


def desired_workers(
    profile: ResourceProfile, outstanding: int, current: int, limit: int, slots: int | None = None
) -> int:
    """Workers to have now: enough slots for the outstanding tasks, never fewer than now; a gang: all.
    ``slots``: tasks per worker where running workers tell (``gpu_memory_per_task``)."""
    if limit <= 0:
        return 0
    if profile.gang:
        return limit
    if not profile.is_gpu:
        return max(current, min(limit, 1 if outstanding else current))
    if profile.by_memory and slots is None:  # its first worker's device tells how many fit
        return max(current, min(limit, 1 if outstanding else 0))
    need = math.ceil(outstanding / (slots or slots_per_worker(profile)))
    return max(current, min(limit, need))


@dataclass(frozen=True)
class IdleView:
    """What the idle policy needs to know about one profile's cluster."""

    running: bool
    outstanding: int
    idle_since: float | None
    idle_timeout: float


def close_reason(view: IdleView, now: float) -> str | None:
    """Why the cluster should close now, or ``None`` to keep it."""
    if not view.running or view.outstanding > 0 or view.idle_since is None:
        return None
    idle_for = now - view.idle_since
    if idle_for + 1e-9 >= view.idle_timeout:
        return f"idle for {idle_for:.1f}s (idle_timeout={view.idle_timeout:g}s), nothing running or queued"
    return None


@dataclass(frozen=True)
class WorkerSpec:
    """One worker of a profile's cluster: what it owns and how it is started."""

    name: str
    devices: tuple[Device, ...]
    nthreads: int
    resources: dict[str, float]
    env: dict[str, str] = field(default_factory=dict)
    memory_limit: int | None = None
    # the CPUs its process is pinned to (``0-3``), or why not (gpu_tasks.worker.affinity); "" for none
    cpus: str = ""


def task_resources(profile: ResourceProfile) -> dict[str, float] | None:
    """The Dask resources one task of ``profile`` asks for; CPU: none, its cluster's threads bound it."""
    if profile.by_memory:
        return {GPU_MEMORY_RESOURCE: float(profile.gpu_memory_per_task or 0)}
    if profile.is_gpu:
        return {GPU_RESOURCE: float(profile.gpus)}
    return None


def worker_spec(
    profile: ResourceProfile,
    index: int,
    devices: tuple[Device, ...],
    emulated: bool,
    cores: int | None = None,
    extra_env: dict[str, str] | None = None,
    free: int | None = None,
) -> WorkerSpec:
    """The spec of one worker of ``profile`` on ``devices``; ``free``: its device's free memory at the
    lease (a ``gpu_memory_per_task`` worker's slots and allocator cap come from it)."""
    slots = slots_per_worker(profile, cores, devices[0] if devices else None, free)
    env = dict(extra_env or {})
    env[WORKER_ENV_PROFILE] = profile.name
    if profile.on_oom:
        env[WORKER_ENV_ON_OOM] = profile.on_oom
    if profile.is_gpu:
        resources = {GPU_RESOURCE: float(len(devices))}
        env["CUDA_VISIBLE_DEVICES"] = ",".join(d.address for d in devices)
        env[WORKER_ENV_DEVICES] = "|".join(d.name for d in devices)
        env[WORKER_ENV_EMULATED] = "1" if emulated else "0"
        name = f"{profile.name}-gpu{'-'.join(d.address for d in devices)}"
        if profile.gpu_memory_per_task:
            resources[GPU_MEMORY_RESOURCE] = float(slots * profile.gpu_memory_per_task)
            env[WORKER_ENV_MEMORY_PER_TASK] = str(profile.gpu_memory_per_task)
            env[WORKER_ENV_MEMORY_LIMIT] = str(slots * profile.gpu_memory_per_task)
    else:
        resources = {}
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU worker process must not inherit the flow's GPUs
        name = f"{profile.name}-{index}"
    return WorkerSpec(
        name=name,
        devices=devices,
        nthreads=slots,
        resources=resources,
        env=env,
        memory_limit=profile.memory,
    )


def runs_counted(run_count: int, free_runs: int = 0, crashes: int = 0) -> int:
    """The runs of a task run that count against its ``retries``: its Prefect run count (Prefect's own
    retries included) less ``free_runs``, the runs that used none (preempted, or moved to its
    ``on_oom`` profile), and at least its ``crashes`` (a worker can die before Prefect counts its run)."""
    return max(crashes, run_count - free_runs, 0)


def crash_retry(
    retries: int, retry_delay_seconds: Any, run_count: int, free_runs: int = 0, crashes: int = 1
) -> float | None:
    """After a task run's worker died under it (``crashes``, this one included): the seconds before it
    runs again (``retry_delay_seconds``, the last repeating; its re-run keeps :func:`rerun_retries`),
    or ``None`` when its counted runs (:func:`runs_counted`) used up its ``retries``."""
    counted = runs_counted(run_count, free_runs, crashes)
    if counted > retries:
        return None
    delay = retry_delay_seconds
    if isinstance(delay, (list, tuple)):
        delay = delay[min(counted - 1, len(delay) - 1)] if delay else 0
    return float(delay or 0)


def rerun_retries(retries: int, run_count: int, free_runs: int = 0, crashes: int = 0) -> int:
    """The retries Prefect's engine may still use when a task run runs again (after a crash, a
    preemption or out of memory): its ``retries`` less its counted runs (:func:`runs_counted`)."""
    return max(0, retries - runs_counted(run_count, free_runs, crashes))


def aged_priority(base: int, aging: float, waited: float) -> int:
    """``base + floor(waited / aging)``: the one aging rule, of the device queue and the waiter board."""
    if aging <= 0 or not math.isfinite(waited) or waited <= 0:
        return base
    return base + math.floor(waited / aging)


# ------------------------------------------------------------------ preemption: whose work stops
@dataclass(frozen=True)
class Holding:
    """A device's holder as preemption judges it (``since`` ``None``: unknown, nothing protects it)."""

    preemptible: bool
    priority: int
    since: float | None = None
    min_run_time: float = 0.0

    def protected_until(self) -> float | None:
        """When its ``min_run_time`` protection ends; ``None``: it has none."""
        if self.since is None or self.min_run_time <= 0:
            return None
        return self.since + self.min_run_time

    def lost_work(self, now: float) -> float:
        """Seconds of its run that stopping it at ``now`` throws away."""
        return max(0.0, now - self.since) if self.since is not None else 0.0


@dataclass(frozen=True)
class VictimChoice:
    """Devices a waiter may take back now, or when only ``protected`` ones stand in the way, until when."""

    devices: tuple[str, ...] = ()
    protected_until: float | None = None
    protected: tuple[str, ...] = ()


def choose_victims(
    groups: Sequence[Sequence[tuple[str, Holding | None]]], need: int, priority: int, now: float
) -> VictimChoice:
    """The devices a waiter of ``priority`` takes back to start ``need`` of its ``groups``.

    A group is takeable when every holder is preemptible, of lower priority and past its protected run
    time; the ``need`` losing least work, then stopping fewest devices, then first, are chosen.
    """
    need = max(1, need)
    takeable: list[tuple[float, int, int, list[str]]] = []
    blocked: list[tuple[float, list[str]]] = []  # (protection ends, protected devices) per group
    for index, group in enumerate(groups):
        victims: list[str] = []
        lost, until, protected = 0.0, -math.inf, []
        for address, holder in group:
            if holder is None:
                continue
            if not holder.preemptible or holder.priority >= priority:
                break
            ends = holder.protected_until()
            if ends is not None and ends > now:
                until = max(until, ends)
                protected.append(address)
            victims.append(address)
            lost += holder.lost_work(now)
        else:
            if protected:
                blocked.append((until, protected))
            else:
                takeable.append((lost, len(victims), index, victims))
    if len(takeable) >= need:
        chosen = sorted(takeable)[:need]
        return VictimChoice(devices=tuple(sorted({a for *_, victims in chosen for a in victims})))
    short = need - len(takeable)
    if len(blocked) < short:
        return VictimChoice()
    waits = sorted(blocked)[:short]
    return VictimChoice(
        protected_until=waits[-1][0], protected=tuple(sorted({a for _, devs in waits for a in devs}))
    )


# ------------------------------------------------------------------ fair share: who is served next
def decayed_usage(usage: float, at: float, now: float, half_life: float) -> float:
    """``usage`` as of ``at`` halved every ``half_life`` seconds to ``now``; 0 when fair share is off."""
    if half_life <= 0 or usage <= 0:
        return 0.0
    return float(usage * 0.5 ** (max(0.0, now - at) / half_life))


def waiter_rank(
    priority: int, aging: float, arrived: float, now: float, usage: float = 0.0, name: str = "\uffff"
) -> tuple[int, float, float, str]:
    """Sort key of a device waiter: higher aged priority, then less team usage, then earlier arrival."""
    return (-aged_priority(priority, aging, now - arrived), usage, arrived, name)
