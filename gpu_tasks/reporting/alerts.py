"""Which alerts a flow run raises, from its resource ledger (pure). Prefect automations match labels
with globs, never numbers: thresholds are compared here and the outcome is label ``gpu-tasks.alert``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gpu_tasks.reporting.ledger import LedgerRow, device_order
from gpu_tasks.settings import GpuTasksSettings

NO_ALERT = "none"


@dataclass(frozen=True)
class RunTotals:
    """A flow run's device use, summed over its ledger rows that held devices."""

    held_seconds: float  # device-seconds held (start-up and idle tails count)
    busy_seconds: float  # device-seconds a task ran
    longest_device_wait: float  # seconds, the longest one cluster start waited for its devices
    devices: tuple[str, ...]
    profiles: tuple[str, ...]
    emulated: bool
    tasks: int

    @classmethod
    def of(cls, rows: Sequence[LedgerRow]) -> RunTotals:
        """The totals of ``rows`` (CPU rows count only for their waits, which are always 0)."""
        gpu = [r for r in rows if r.devices]
        devices = sorted({d for r in gpu for d in r.devices}, key=device_order)
        return cls(
            held_seconds=sum(r.held_seconds for r in gpu),
            busy_seconds=sum(r.busy_seconds for r in gpu),
            longest_device_wait=max((r.wait_devices_seconds for r in rows), default=0.0),
            devices=tuple(devices),
            profiles=tuple(sorted({r.profile for r in gpu})),
            emulated=any(r.emulated for r in gpu),
            tasks=sum(r.tasks for r in gpu),
        )

    @property
    def held_per_busy(self) -> float:
        """Held over busy: 1.0 is the physical limit, ``inf`` when devices were held and never busy."""
        if self.held_seconds <= 0:
            return 0.0
        return self.held_seconds / self.busy_seconds if self.busy_seconds > 0 else math.inf

    @property
    def utilization(self) -> float:
        """Busy over held (0 when nothing was held)."""
        return self.busy_seconds / self.held_seconds if self.held_seconds > 0 else 0.0


@dataclass(frozen=True)
class AlertThresholds:
    """When a run raises an alert; a threshold of 0 never raises its alert."""

    held_busy: float = 2.0
    device_wait_seconds: float = 60.0
    min_held_seconds: float = 60.0

    @classmethod
    def from_settings(cls, settings: GpuTasksSettings) -> AlertThresholds:
        """The thresholds of the ``GPU_TASKS_TUNE_ALERT_*`` settings."""
        return cls(
            held_busy=settings.alert_held_busy,
            device_wait_seconds=settings.alert_device_wait_seconds,
            min_held_seconds=settings.alert_min_held_seconds,
        )


def run_alerts(totals: RunTotals, thresholds: AlertThresholds) -> tuple[str, ...]:
    """The alerts ``totals`` raise: held/busy (past the minimum held) or a device wait above threshold."""
    alerts: list[str] = []
    if (
        thresholds.held_busy > 0
        and totals.held_seconds > 0
        and totals.held_seconds >= thresholds.min_held_seconds
        and totals.held_per_busy > thresholds.held_busy
    ):
        alerts.append(f"held-busy-over-{thresholds.held_busy:g}")
    if thresholds.device_wait_seconds > 0 and totals.longest_device_wait > thresholds.device_wait_seconds:
        alerts.append(f"device-wait-over-{thresholds.device_wait_seconds:g}")
    return tuple(alerts)


def alert_label(alerts: Sequence[str]) -> str:
    """The value of the ``gpu-tasks.alert`` label."""
    return ",".join(alerts) or NO_ALERT
