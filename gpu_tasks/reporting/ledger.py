"""The resource ledger: how long each profile's workers held devices, and how busy they were.
``Usage`` keeps one cluster's clock and makes a ``LedgerRow`` when the cluster or a worker goes away."""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gpu_tasks.reporting.measured import (
    EMULATED_ADVICE,
    Measured,
    Sample,
    Samples,
    advice,
    aggregate,
    combine,
)


@dataclass(frozen=True)
class DeviceSpan:
    """One device held by one worker of a profile: from when to when, and when tasks ran on it."""

    device: str  # as tags name it: ``0``, or ``<host>:0`` on another host's worker
    model: str  # ``H100 80 GiB``, ``EMU 16 GiB, emulated`` (``Device.model()``); "" when unknown
    profile: str
    start: float  # wall clock: the lease (start-up counts as held)
    end: float  # wall clock: the release
    busy: tuple[tuple[float, float], ...] = ()  # when tasks ran on it: merged, within start..end
    tasks: int = 0
    measured: Measured | None = None  # what NVML measured of it while held, or why not
    cpus: str = ""  # the CPUs its worker's process was pinned to (``0-3``), or why not

    @property
    def held_seconds(self) -> float:
        return max(0.0, self.end - self.start)

    @property
    def busy_seconds(self) -> float:
        return sum(e - s for s, e in self.busy)

    @property
    def label(self) -> str:
        """``0 (H100 80 GiB)``, or the bare id when the model is unknown."""
        return f"{self.device} ({self.model})" if self.model else self.device

    def as_dict(self) -> dict[str, Any]:
        """Plain dict for JSON (the busy intervals left out)."""
        return {
            "device": self.device,
            "model": self.model,
            "profile": self.profile,
            "start": self.start,
            "end": self.end,
            "held_s": round(self.held_seconds, 3),
            "busy_s": round(self.busy_seconds, 3),
            "tasks": self.tasks,
            "measured": self.measured.as_dict() if self.measured is not None else None,
            "cpus": self.cpus,
        }


@dataclass
class LedgerRow:
    """One cluster lifetime (or one retired worker's), for the resource ledger."""

    profile: str
    workers: int
    devices: tuple[str, ...]
    emulated: bool
    provisioned_at: float
    closed_at: float
    held_seconds: float
    busy_seconds: float
    tasks: int
    reason: str
    # waits apart from held time (held starts at the lease); slots: Prefect tag concurrency, no device held
    wait_devices_seconds: float = 0.0
    wait_slots_seconds: float = 0.0
    spans: tuple[DeviceSpan, ...] = ()  # none for CPU rows
    skipped: tuple[str, ...] = ()  # why devices were skipped: programs outside gpu-tasks used them
    measured: Measured | None = None  # None: CPU row
    cpu_affinity: tuple[str, ...] = ()  # ``devices 0,1: 0-3``, or why not pinned
    # a gang's devices, the worst link between two, a better-wired matching set that existed ("" if none)
    gang: tuple[str, ...] = ()
    worst_link: str = ""
    better_set: str = ""
    # of ``tasks``, those that did not finish: still running when the cluster closed, or when their
    # worker died (busy up to then)
    interrupted: int = 0

    @property
    def utilization(self) -> float:
        """Busy over held (1.0 is the physical limit)."""
        return self.busy_seconds / self.held_seconds if self.held_seconds > 0 else 0.0

    def count_interrupted(self, worker: str, start: float, end: float) -> bool:
        """Count, on this row written already, a task that began at ``start`` on its worker ``worker``
        (:func:`worker_key`) and was cut short at ``end`` (the worker died): busy from ``start`` up to
        then (within the row's holding), one more of ``tasks`` and of ``interrupted``. ``False``, and
        nothing changed, when the row did not hold ``worker`` at ``start``. A CPU row has no spans to
        merge the task's time with: its seconds are added, within the held time."""
        if worker == "cpu":
            if self.devices or not self.provisioned_at <= start < self.closed_at:
                return False
            added = max(0.0, min(end, self.closed_at) - start)
        else:
            devices = set(worker.split(","))
            mine = [i for i, s in enumerate(self.spans) if s.device in devices and s.start <= start < s.end]
            if not mine or {self.spans[i].device for i in mine} != devices:
                return False
            spans = list(self.spans)
            added = 0.0
            for i in mine:
                s = spans[i]
                busy = tuple(merge_intervals([*s.busy, (start, max(start, min(end, s.end)))]))
                spans[i] = dataclasses.replace(s, busy=busy, tasks=s.tasks + 1)
                added += spans[i].busy_seconds - s.busy_seconds
            self.spans = tuple(spans)
        self.busy_seconds = min(self.held_seconds, self.busy_seconds + added)
        self.tasks += 1
        self.interrupted += 1
        return True

    def as_dict(self) -> dict[str, Any]:
        """Plain dict for artifacts and JSON."""
        return {
            "profile": self.profile,
            "workers": self.workers,
            "devices": ",".join(self.devices) or "-",
            "emulated": self.emulated,
            "provisioned_at": self.provisioned_at,
            "closed_at": self.closed_at,
            "held_s": round(self.held_seconds, 3),
            "busy_s": round(self.busy_seconds, 3),
            "utilization": round(self.utilization, 3),
            "tasks": self.tasks,
            "interrupted": self.interrupted,
            "wait_devices_s": round(self.wait_devices_seconds, 3),
            "wait_slots_s": round(self.wait_slots_seconds, 3),
            "reason": self.reason,
            "spans": [span.as_dict() for span in self.spans],
            "skipped": list(self.skipped),
            "measured": self.measured.as_dict() if self.measured is not None else None,
            "cpu_affinity": list(self.cpu_affinity),
            "gang": ",".join(self.gang),
            "worst_link": self.worst_link,
            "better_set": self.better_set,
        }


def percent(part: float, whole: float) -> int:
    """``part`` of ``whole`` in whole percent, 0 when ``whole`` is 0."""
    return round(100 * part / whole) if whole > 0 else 0


def device_order(device: str) -> tuple[bool, int, str]:
    """Sort key for device ids: numbers in numeric order, then the others (UUIDs, names)."""
    return (not device.isdigit(), int(device) if device.isdigit() else 0, device)


def worker_key(devices: Iterable[str]) -> str:
    """Key that ties a task's timing to its worker: its devices, or ``"cpu"``."""
    return ",".join(devices) or "cpu"


def merge_intervals(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """``(start, end)`` ``intervals`` merged where they overlap or touch, in time order."""
    merged: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        elif e > s:
            merged.append((s, e))
    return merged


def union_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Seconds covered by at least one of ``(start, end)`` ``intervals`` (overlaps counted once)."""
    return sum(e - s for s, e in merge_intervals(intervals))


def device_spans(
    profile: str,
    devices: Sequence[tuple[str, str]],
    start: float,
    end: float,
    intervals: Sequence[tuple[float, float]],
    cpus: str = "",
) -> tuple[DeviceSpan, ...]:
    """The spans of one worker's ``(device, model)`` ``devices``; each device ran all its tasks."""
    busy = tuple((max(s, start), min(e, end)) for s, e in merge_intervals(intervals) if s < end and e > start)
    return tuple(
        DeviceSpan(device, model, profile, start, end, busy, len(intervals), cpus=cpus)
        for device, model in devices
    )


def measured_span(span: DeviceSpan, samples: Samples) -> DeviceSpan:
    """``span`` with what was sampled of its device while held (or why nothing was)."""
    if samples.note:
        return dataclasses.replace(span, measured=Measured(note=samples.note))
    got = aggregate(samples.by_device.get(span.device, ()), samples.period, span.start, span.end, span.busy)
    return dataclasses.replace(span, measured=got)


@dataclass(frozen=True)
class Held:
    """One worker as the ledger sees it: its devices (none: a CPU worker), with models where known."""

    name: str
    devices: tuple[str, ...]
    models: tuple[str, ...] = ()
    cpus: str = ""  # its process's CPUs (``0-3``), or why not pinned

    def named_devices(self) -> list[tuple[str, str]]:
        """``(device, model)`` of each device ("" where the model is unknown)."""
        models = self.models + ("",) * (len(self.devices) - len(self.models))
        return list(zip(self.devices, models, strict=False))


class Usage:
    """One cluster's clock: since when each worker is held, and when tasks ran on which worker."""

    def __init__(self) -> None:
        self._started: dict[str, float] = {}
        self._keys: dict[str, str] = {}  # each held worker's ledger key (:func:`worker_key`), by name
        self._busy: dict[str, list[tuple[float, float]]] = {}
        self.samples = Samples()  # filled by the sampler thread (gpu_tasks.devices.measure)
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Forget everything (the cluster closed and its row was written)."""
        with self._lock:
            self.provisioned_at: float | None = None
            self._started.clear()
            self._keys.clear()
            self._busy.clear()
            self._tasks = 0
            self._interrupted = 0
            self._waits = {"devices": 0.0, "slots": 0.0}
            self._skipped: list[str] = []
            self.samples.by_device.clear()
            self.gang_wiring: tuple[tuple[str, ...], str, str] = ((), "", "")

    def gang(self, devices: tuple[str, ...], worst: str, better: str) -> None:
        """The cluster is a gang on ``devices`` (:func:`gpu_tasks.policy.gang_wiring`)."""
        self.gang_wiring = (devices, worst, better)

    def waited(self, devices: float = 0.0, slots: float = 0.0) -> None:
        """The cluster's start waited for devices, or a task of it for Prefect tag slots."""
        with self._lock:
            self._waits["devices"] += devices
            self._waits["slots"] += slots

    def skipped(self, reasons: Iterable[str]) -> None:
        """Devices were skipped for the cluster, for these ``reasons``."""
        with self._lock:
            self._skipped.extend(r for r in reasons if r not in self._skipped)

    def waits(self) -> dict[str, float]:
        """The waits so far, as a ledger row's fields."""
        with self._lock:
            return {f"wait_{k}_seconds": v for k, v in self._waits.items()}

    def not_measured(self, reason: str) -> None:
        """Its devices are not sampled, for ``reason``."""
        self.samples.note = reason

    def sampled(self, sample: Sample, period: float) -> None:
        """The sampler read one of its devices."""
        with self._lock:
            self.samples.period = period
            self.samples.by_device.setdefault(sample.device, []).append(sample)

    def held(self, workers: Iterable[Held], since: float) -> None:
        """``workers`` are held from ``since`` (when their devices were acquired)."""
        if self.provisioned_at is None:
            self.provisioned_at = since
        with self._lock:
            for w in workers:
                self._started[w.name] = since
                self._keys[w.name] = worker_key(w.devices)

    def holds(self, worker: str, since: float) -> bool:
        """Whether a worker with ledger key ``worker`` (:func:`worker_key`) is held, and was already at
        ``since``: a task that began then on such a worker ran in this cluster's present life."""
        with self._lock:
            return any(self._keys.get(name) == worker and t <= since for name, t in self._started.items())

    def record(self, worker: str, start: float, end: float, interrupted: bool = False) -> None:
        """A task ran on ``worker`` (see :func:`worker_key`) from ``start`` to ``end`` (``interrupted``:
        it did not finish: its cluster closed or its worker died at ``end``)."""
        with self._lock:
            self._busy.setdefault(worker, []).append((start, end))
            self._tasks += 1
            self._interrupted += interrupted

    def busy(self) -> tuple[dict[str, list[tuple[float, float]]], int]:
        """When tasks ran on each worker so far, and how many ran (a shared cluster's row)."""
        with self._lock:
            return {k: list(v) for k, v in self._busy.items()}, self._tasks

    def row(
        self,
        profile: str,
        workers: Sequence[Held],
        emulated: bool,
        closed: float,
        reason: str,
        whole: bool = True,
    ) -> LedgerRow:
        """The ledger row for ``workers`` at ``closed`` (``whole``: all of the cluster's workers)."""
        held = busy = 0.0
        spans: list[DeviceSpan] = []
        waits = self.waits() if whole else {}
        gang, worst, better = self.gang_wiring if whole else ((), "", "")
        with self._lock:
            skipped = tuple(self._skipped) if whole else ()
            interrupted = self._interrupted if whole else 0
            if whole:
                tasks = self._tasks
            else:
                tasks = sum(len(self._busy.get(worker_key(w.devices), [])) for w in workers)
            for i, w in enumerate(workers):
                weight = max(1, len(w.devices))
                started = self._started.get(w.name, closed)
                held += (closed - started) * weight
                if not w.devices and i > 0:
                    continue  # CPU workers share one "cpu" timeline
                intervals = self._busy.get(worker_key(w.devices), [])
                busy += union_seconds(intervals) * weight
                spans.extend(
                    measured_span(span, self.samples)
                    for span in device_spans(profile, w.named_devices(), started, closed, intervals, w.cpus)
                )
        measured = [span.measured for span in spans if span.measured is not None]
        return LedgerRow(
            profile=profile,
            workers=len(workers),
            devices=tuple(d for w in workers for d in w.devices),
            emulated=emulated,
            provisioned_at=self.provisioned_at or closed,
            closed_at=closed,
            held_seconds=held,
            busy_seconds=min(busy, held),
            tasks=tasks,
            interrupted=interrupted,
            reason=reason,
            spans=tuple(spans),
            skipped=skipped,
            measured=combine(measured) if measured else None,
            gang=gang,
            worst_link=worst,
            better_set=better,
            cpu_affinity=tuple(
                f"devices {','.join(w.devices)}: {w.cpus}" for w in workers if w.devices and w.cpus
            ),
            wait_devices_seconds=waits.get("wait_devices_seconds", 0.0),
            wait_slots_seconds=waits.get("wait_slots_seconds", 0.0),
        )

    def forget(self, worker: Held) -> None:
        """Drop ``worker``'s clock (it was retired and its row written)."""
        with self._lock:
            self._started.pop(worker.name, None)
            self._keys.pop(worker.name, None)
            self._busy.pop(worker_key(worker.devices), None)
            for device in worker.devices:
                self.samples.by_device.pop(device, None)


def wiring_advice(rows: Sequence[LedgerRow]) -> list[tuple[str, str]]:
    """``(profile, line)`` for each gang that ran across sockets while a better-wired set existed."""
    out: list[tuple[str, str]] = []
    for r in rows:
        if r.worst_link == "SYS" and r.better_set:
            line = (
                f"profile {r.profile!r}: its gang ran across sockets (devices {','.join(r.gang)}: SYS) "
                f"while {r.better_set} existed; topology='socket' waits for such a set"
            )
            if (r.profile, line) not in out:
                out.append((r.profile, line))
    return out


def right_size(rows: Sequence[LedgerRow]) -> list[tuple[str, str, Measured | None]]:
    """``(profile, line, measured)`` for each GPU profile that used much less than it held (one
    ``EMULATED_ADVICE`` line if emulated), then the :func:`wiring_advice` lines."""
    wired: list[tuple[str, str, Measured | None]] = [(p, line, None) for p, line in wiring_advice(rows)]
    gpu = [r for r in rows if r.devices and r.measured is not None]
    if any(r.emulated for r in gpu):
        return [("", EMULATED_ADVICE, None), *wired]
    out: list[tuple[str, str, Measured | None]] = []
    for profile in dict.fromkeys(r.profile for r in gpu):
        mine = [r for r in gpu if r.profile == profile]
        measured = combine([r.measured for r in mine if r.measured is not None])
        devices = max(len(r.devices) for r in mine)
        line = advice(profile, devices, measured)
        if line is not None:
            out.append((profile, line, measured))
    return out + wired


_ENDED: dict[uuid.UUID, list[LedgerRow]] = {}  # final ledgers of the last flow runs that ended here
_ENDED_KEPT = 16
_ended_lock = threading.Lock()


def remember_ended(flow_run_id: uuid.UUID | None, rows: list[LedgerRow]) -> None:
    """Keep a flow run's final ledger (its clusters closed) for :func:`ended_ledger`."""
    if flow_run_id is None:
        return
    with _ended_lock:
        _ENDED[flow_run_id] = list(rows)
        while len(_ENDED) > _ENDED_KEPT:
            del _ENDED[next(iter(_ENDED))]


def ended_ledger(flow_run_id: uuid.UUID) -> list[LedgerRow] | None:
    """The final ledger of a flow run whose runner ended in this process lately, or ``None``."""
    with _ended_lock:
        rows = _ENDED.get(flow_run_id)
        return list(rows) if rows is not None else None
