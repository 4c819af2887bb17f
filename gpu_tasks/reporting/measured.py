"""Measured use (pure): what :mod:`gpu_tasks.devices.measure` samples of the real devices a profile
holds, as a :class:`Measured` per ledger row or device span, and right-size advice from it."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpu_tasks.profiles.model import MAX_SHARE  # gpus=1/k for k in 2..64

GiB = 2**30
NOT_EMULATED = "not measured (emulated)"
NOT_ELSEWHERE = "not measured (devices on another host)"  # address / cluster_class profiles
EMULATED_ADVICE = "GPU use not measured (emulated devices)"
ADVICE_MEMORY_FRACTION = 0.5  # right-size advice when the peak memory was under half of that held
ADVICE_SM_PERCENT = 50.0  # and the mean SM utilization under 50% (both over the run)
MEMORY_HEADROOM = 1.25  # the memory a task is said to need: the peak plus 25%, rounded up to a GiB


@dataclass(frozen=True)
class Sample:
    """One reading of one device; ``None`` where NVML did not report the figure."""

    t: float  # wall clock
    device: str
    sm: float | None
    used: int | None
    total: int | None
    processes: tuple[tuple[int, int], ...] = ()  # gpu-tasks' processes on it: (pid, bytes)


@dataclass(frozen=True)
class Measured:
    """What was measured of one or more devices over a holding. With ``note`` (not measured), every
    number is ``None``: never an invented figure."""

    samples: int = 0
    period: float | None = None
    sm_mean: float | None = None  # percent, mean over the samples (and devices)
    peak_used: int | None = None  # bytes, the largest device memory used seen on one device
    total: int | None = None  # bytes, that device's memory
    process_peak: int | None = None  # bytes, the largest one worker process used on one device
    task_peak: int | None = None  # bytes, process_peak while a task ran (a shared worker: all its tasks)
    note: str = ""

    @property
    def measured(self) -> bool:
        return self.samples > 0 and not self.note

    def text(self) -> str:
        """One line of the figures, or why nothing was measured."""
        if not self.measured:
            return self.note or "not measured"
        parts = []
        if self.sm_mean is not None:
            parts.append(f"SM {self.sm_mean:.0f}% mean")
        if self.peak_used is not None:
            parts.append(f"peak {gib(self.peak_used)} GiB" + (f" of {gib(self.total)}" if self.total else ""))
        if self.process_peak is not None:
            parts.append(f"worker process peak {gib(self.process_peak)} GiB")
        if self.task_peak is not None and self.task_peak != self.process_peak:
            parts.append(f"{gib(self.task_peak)} GiB while a task ran")
        every = f" every {self.period:g} s" if self.period else ""
        return ", ".join(parts) + f" ({self.samples} samples{every})"

    def as_dict(self) -> dict[str, Any]:
        """Plain dict for JSON: ``None`` for what was not measured."""
        return {
            "samples": self.samples,
            "period_s": self.period,
            "sm_mean_pct": None if self.sm_mean is None else round(self.sm_mean, 1),
            "peak_used_gib": None if self.peak_used is None else round(self.peak_used / GiB, 3),
            "total_gib": None if self.total is None else round(self.total / GiB, 3),
            "process_peak_gib": None if self.process_peak is None else round(self.process_peak / GiB, 3),
            "task_peak_gib": None if self.task_peak is None else round(self.task_peak / GiB, 3),
            "note": self.note or None,
        }


@dataclass
class Samples:
    """Samples kept for one cluster, by device (appended by the sampler thread)."""

    period: float | None = None
    by_device: dict[str, list[Sample]] = field(default_factory=dict)
    note: str = ""  # why nothing is sampled (emulated, no NVML)


def gib(nbytes: int | None) -> str:
    """``9.1``; ``80`` for a whole number of GiB."""
    if nbytes is None:
        return "?"
    return f"{nbytes / GiB:.1f}".removesuffix(".0")


def aggregate(
    samples: Iterable[Sample],
    period: float | None,
    start: float = -math.inf,
    end: float = math.inf,
    busy: Sequence[tuple[float, float]] = (),
) -> Measured:
    """Mean SM and peaks of the samples within ``start``..``end``; ``task_peak``: while a task ran."""
    within = [s for s in samples if start <= s.t <= end]
    if not within:
        return Measured(period=period, note="not measured (no sample while held)")
    sms = [s.sm for s in within if s.sm is not None]
    peak = max((s for s in within if s.used is not None), key=lambda s: s.used or 0, default=None)
    procs = [n for s in within for _, n in s.processes]
    in_tasks = [n for s in within if any(a <= s.t <= b for a, b in busy) for _, n in s.processes]
    return Measured(
        samples=len(within),
        period=period,
        sm_mean=sum(sms) / len(sms) if sms else None,
        peak_used=peak.used if peak is not None else None,
        total=peak.total if peak is not None else None,
        process_peak=max(procs) if procs else None,
        task_peak=max(in_tasks) if in_tasks else None,
    )


def combine(parts: Sequence[Measured]) -> Measured:
    """Several devices' (or holdings') measurements as one: SM mean weighted by samples, peaks."""
    done = [m for m in parts if m.measured]
    if not done:
        return parts[0] if parts else Measured(note="not measured")
    n = sum(m.samples for m in done)
    sm_parts = [(m.sm_mean, m.samples) for m in done if m.sm_mean is not None]
    sm_n = sum(k for _, k in sm_parts)
    top = max((m for m in done if m.peak_used is not None), key=lambda m: m.peak_used or 0, default=None)
    procs = [m.process_peak for m in done if m.process_peak is not None]
    tasks = [m.task_peak for m in done if m.task_peak is not None]
    return Measured(
        samples=n,
        period=done[0].period,
        sm_mean=sum(v * k for v, k in sm_parts) / sm_n if sm_n else None,
        peak_used=top.peak_used if top else None,
        total=top.total if top else None,
        process_peak=max(procs) if procs else None,
        task_peak=max(tasks) if tasks else None,
    )


def used_for_advice(m: Measured) -> int | None:
    """The memory the profile itself needed: its worker process's peak where NVML listed it, else
    the device's peak used (which counts other programs too, so it errs on the large side)."""
    return m.process_peak if m.process_peak is not None else m.peak_used


def oversized(m: Measured) -> bool:
    """Whether a profile used much less than it held, in memory AND SM (needs both measured)."""
    used = used_for_advice(m)
    if not m.measured or used is None or not m.total or m.sm_mean is None:
        return False
    return used < ADVICE_MEMORY_FRACTION * m.total and m.sm_mean < ADVICE_SM_PERCENT


def suggested_share(used: int, total: int, sm_mean: float) -> float:
    """The smallest ``1/k`` whose memory fits ``used`` with headroom and whose SM covers the mean."""
    need = max(used * MEMORY_HEADROOM / total, sm_mean / 100.0)
    for k in range(MAX_SHARE, 0, -1):
        if 1.0 / k >= need:
            return 1.0 / k
    return 1.0


def suggested_memory(used: int) -> int:
    """``used`` plus the headroom, rounded up to a whole GiB."""
    return max(1, math.ceil(used * MEMORY_HEADROOM / GiB)) * GiB


def _share_text(share: float) -> str:
    k = round(1 / share)
    return "1" if k == 1 else (f"{share:g}" if len(f"{share:g}") <= 6 else f"1/{k}")


def advice(profile: str, devices: int, m: Measured, emulated: bool = False) -> str | None:
    """The right-size line for a GPU profile, or ``None`` when it used what it held or was not measured."""
    if emulated:
        return EMULATED_ADVICE
    if not oversized(m):
        return None
    used = used_for_advice(m)
    assert used is not None and m.total and m.sm_mean is not None  # oversized() checked them
    share = suggested_share(used, m.total, m.sm_mean)
    held = f"{devices} device{'s' if devices != 1 else ''}"
    return (
        f"profile {profile!r} held {held}; peak {gib(used)} GiB of {gib(m.total)}, SM {m.sm_mean:.0f}% "
        f"mean: gpus={_share_text(share)} fits ({suggested_memory(used) // GiB} GiB a task with headroom)"
    )
