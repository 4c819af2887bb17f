"""The resource ledger: how long each profile's workers held devices, and how busy they were.

``Usage`` keeps one cluster's clock (when each worker was asked for, when each task ran);
``Usage.row`` turns it into a ``LedgerRow`` when the cluster (or one worker) goes away;
``publish_ledger`` attaches a flow run's rows to it as a table artifact.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

LEDGER_ARTIFACT_KEY = "resource-ledger"


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
    # waits, apart from held time (held starts at the lease): the cluster's start waiting for devices,
    # and its tasks waiting for Prefect tag concurrency slots, holding no device
    wait_devices_seconds: float = 0.0
    wait_slots_seconds: float = 0.0

    @property
    def utilization(self) -> float:
        """Busy over held (1.0 is the physical limit)."""
        return self.busy_seconds / self.held_seconds if self.held_seconds > 0 else 0.0

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
            "wait_devices_s": round(self.wait_devices_seconds, 3),
            "wait_slots_s": round(self.wait_slots_seconds, 3),
            "reason": self.reason,
        }


def worker_key(devices: Iterable[str]) -> str:
    """Key that ties a task's timing to its worker: its devices, or ``"cpu"``."""
    return ",".join(devices) or "cpu"


def union_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Seconds covered by at least one of ``(start, end)`` ``intervals`` (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


@dataclass(frozen=True)
class Held:
    """One worker as the ledger sees it: its name and the devices it holds (none: a CPU worker)."""

    name: str
    devices: tuple[str, ...]


class Usage:
    """One cluster's clock: since when each worker is held, and when tasks ran on which worker."""

    def __init__(self) -> None:
        self.provisioned_at: float | None = None
        self._started: dict[str, float] = {}
        self._busy: dict[str, list[tuple[float, float]]] = {}
        self._tasks = 0
        self._waits = {"devices": 0.0, "slots": 0.0}
        self._lock = threading.Lock()

    def waited(self, devices: float = 0.0, slots: float = 0.0) -> None:
        """The cluster's start waited ``devices`` s for devices; a task of it waited ``slots`` s for
        Prefect tag slots before it reached the cluster."""
        with self._lock:
            self._waits["devices"] += devices
            self._waits["slots"] += slots

    def waits(self) -> dict[str, float]:
        """``{"wait_devices_seconds": ..., "wait_slots_seconds": ...}`` so far, for a ledger row."""
        with self._lock:
            return {f"wait_{k}_seconds": v for k, v in self._waits.items()}

    def held(self, workers: Iterable[Held], since: float) -> None:
        """``workers`` are held from ``since`` (when their devices were acquired)."""
        if self.provisioned_at is None:
            self.provisioned_at = since
        for w in workers:
            self._started[w.name] = since

    def record(self, worker: str, start: float, end: float) -> None:
        """A task ran on ``worker`` (see :func:`worker_key`) from ``start`` to ``end``."""
        with self._lock:
            self._busy.setdefault(worker, []).append((start, end))
            self._tasks += 1

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
        waits = self.waits() if whole else {}
        with self._lock:
            if whole:
                tasks = self._tasks
            else:
                tasks = sum(len(self._busy.get(worker_key(w.devices), [])) for w in workers)
            for i, w in enumerate(workers):
                weight = max(1, len(w.devices))
                held += (closed - self._started.get(w.name, closed)) * weight
                if not w.devices and i > 0:
                    continue  # CPU workers share one "cpu" timeline
                busy += union_seconds(self._busy.get(worker_key(w.devices), [])) * weight
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
            reason=reason,
            **waits,
        )

    def forget(self, worker: Held) -> None:
        """Drop ``worker``'s clock (it was retired and its row written)."""
        with self._lock:
            self._started.pop(worker.name, None)
            self._busy.pop(worker_key(worker.devices), None)

    def reset(self) -> None:
        """Forget everything (the cluster closed and its row was written)."""
        with self._lock:
            self.provisioned_at = None
            self._started.clear()
            self._busy.clear()
            self._tasks = 0
            self._waits = {"devices": 0.0, "slots": 0.0}


def publish_ledger(rows: list[LedgerRow], flow_run_id: uuid.UUID | None) -> None:
    """Attach the run's resource ledger to the flow run as a table artifact (best effort)."""
    if not rows or flow_run_id is None:
        return
    table = []
    for row in rows:
        item = row.as_dict()
        for key in ("provisioned_at", "closed_at"):
            item[key] = datetime.datetime.fromtimestamp(item[key], tz=datetime.UTC).isoformat(
                timespec="seconds"
            )
        table.append(item)
    held = sum(r.held_seconds for r in rows if r.devices)
    busy = sum(r.busy_seconds for r in rows if r.devices)
    emulated = any(r.emulated for r in rows)
    description = (
        f"gpu-tasks resource ledger: one row per profile cluster lifetime. Devices held {held:.1f} "
        f"device-s, busy {busy:.1f} device-s" + (" (EMULATED devices)" if emulated else "")
    )
    try:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import ArtifactCreate

        with get_client(sync_client=True) as client:
            client.create_artifact(
                ArtifactCreate(
                    key=LEDGER_ARTIFACT_KEY,
                    type="table",
                    data=json.dumps(table, default=str),
                    description=description,
                    flow_run_id=flow_run_id,
                )
            )
    except Exception:  # the ledger must never fail a flow run that succeeded
        logger.warning("could not publish the resource ledger artifact", exc_info=True)
