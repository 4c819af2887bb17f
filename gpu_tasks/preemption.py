"""Which devices preemptible work gives back, and to whom.

A waiter (a profile waiting for devices, in this flow run or in another process on
the host, :mod:`gpu_tasks.devices.leases`) may have devices taken back for it from
**preemptible** holders of **lower priority** once it has waited its grace period
(``GPU_TASKS_TUNE_PREEMPTION_GRACE``, recorded in its waiter info so that every process
judges it alike). Only what lets the waiter start is taken back: enough of its device
groups to satisfy it, each group either free or held only by such holders, the groups
that preempt the fewest devices first. Work that is not preemptible, or of equal or
higher priority, is never touched; aging (a waiter's effective priority) does not
preempt: the waiter's own ``priority`` is compared with the holder's.

Every holder process runs :func:`plan` on the waiters it can see and stops its own
workers on the planned devices (gpu_tasks.runner.recovery); the waiter runs it too, to say
whom it is waiting on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

HolderOf = Callable[[str], "dict[str, Any] | None"]


def due(waiter: dict[str, Any], default_grace: float, now: float | None = None) -> bool:
    """Whether ``waiter`` has waited its grace period (its own, else ``default_grace``)."""
    grace = waiter.get("preemption_grace")
    grace = default_grace if grace is None else float(grace)
    now = time.time() if now is None else now
    return now - float(waiter.get("arrived") or now) >= grace


def may_preempt(waiter: dict[str, Any], holder: dict[str, Any]) -> bool:
    """Whether ``waiter`` outranks ``holder`` for preemption: preemptible and of lower priority."""
    return bool(holder.get("preemptible")) and int(holder.get("priority") or 0) < int(
        waiter.get("priority") or 0
    )


def plan(waiter: dict[str, Any], holder_of: HolderOf) -> list[str]:
    """The devices whose holders must give them back so ``waiter`` can start; ``[]``: none.

    ``waiter["groups"]`` lists its device groups (address lists) and ``waiter["need"]``
    how many of them it needs at once (a gang: all); a waiter that registered without
    them wants any one of its ``addresses``. ``holder_of(address)`` is the holder's
    info (``priority``, ``preemptible``), ``None`` when the device is free. Empty when
    preempting cannot satisfy the waiter, or when it needs no preemption.
    """
    groups = waiter.get("groups") or [[a] for a in waiter.get("addresses") or ()]
    need = max(1, int(waiter.get("need") or 1))
    options: list[tuple[int, int, list[str]]] = []
    for index, group in enumerate(groups):
        victims: list[str] = []
        for address in group:
            holder = holder_of(address)
            if holder is None:
                continue
            if not may_preempt(waiter, holder):
                break
            victims.append(address)
        else:
            options.append((len(victims), index, victims))
    if len(options) < need:
        return []
    chosen = sorted(options)[:need]
    return sorted({a for _, _, victims in chosen for a in victims})


def describe_waiter(waiter: dict[str, Any]) -> str:
    """``profile 'urgent' of flow run 'x' (pid 12, priority 10)`` for logs and events."""
    run = waiter.get("flow_run_name")
    where = f" of flow run {run!r}" if run else (" of this flow run" if waiter.get("local") else "")
    pid = f"pid {waiter['pid']}, " if waiter.get("pid") and not waiter.get("local") else ""
    return f"profile {waiter.get('profile')!r}{where} ({pid}priority {int(waiter.get('priority') or 0)})"


@dataclass(frozen=True)
class PreemptedRun:
    """What a shared cluster's worker returns for a task interrupted for a higher-priority waiter."""

    started: float
    ended: float
    worker: str
