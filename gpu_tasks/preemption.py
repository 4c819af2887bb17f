"""Which devices preemptible work gives back, and to whom: every holder process runs :func:`plan` on
the waiters it sees and stops its own workers there; the waiter runs it too, to say whom it waits on."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpu_tasks.policy import Holding, VictimChoice, choose_victims

HolderOf = Callable[[str], "dict[str, Any] | None"]


def groups_of(waiter: dict[str, Any]) -> list[list[str]]:
    """A waiter's device groups: its ``groups``, else (registered without them) each address alone."""
    return waiter.get("groups") or [[a] for a in waiter.get("addresses") or ()]


def due(waiter: dict[str, Any], default_grace: float, now: float | None = None) -> bool:
    """Whether ``waiter`` has waited its grace period (its own, else ``default_grace``)."""
    grace = default_grace if waiter.get("preemption_grace") is None else float(waiter["preemption_grace"])
    now = time.time() if now is None else now
    return now - float(waiter.get("arrived") or now) >= grace


def may_preempt(waiter: dict[str, Any], holder: dict[str, Any]) -> bool:
    """Whether ``waiter`` outranks ``holder`` for preemption: preemptible and of lower priority."""
    priority = int(waiter.get("priority") or 0)
    return bool(holder.get("preemptible")) and int(holder.get("priority") or 0) < priority


def holding(holder: dict[str, Any]) -> Holding:
    """A holder's lease info as :func:`gpu_tasks.policy.choose_victims` judges it."""
    since = holder.get("since")
    return Holding(
        preemptible=bool(holder.get("preemptible")),
        priority=int(holder.get("priority") or 0),
        since=float(since) if since is not None else None,
        min_run_time=float(holder.get("min_run_time") or 0.0),
    )


def choose(waiter: dict[str, Any], holder_of: HolderOf, now: float | None = None) -> VictimChoice:
    """What ``waiter`` may take back at ``now`` from the holders of its device groups (``holder_of``:
    a device's holder info, ``None`` when free)."""
    groups = groups_of(waiter)
    held = {a: holder_of(a) for group in groups for a in group}  # one read of each device
    if any(_taken_by(waiter, h) for h in held.values()):
        return VictimChoice()  # it got devices and is leaving the queue: nothing to take back for it
    judged = {a: None if h is None else holding(h) for a, h in held.items()}
    return choose_victims(
        [[(a, judged[a]) for a in group] for group in groups],
        max(1, int(waiter.get("need") or 1)),
        int(waiter.get("priority") or 0),
        time.time() if now is None else now,
    )


def _taken_by(waiter: dict[str, Any], holder: dict[str, Any] | None) -> bool:
    """Whether ``holder`` is ``waiter`` itself on a device taken since it began to wait: it leaves the
    queue only after that, and must not then have another group's holder stopped."""
    if not holder or holder.get("since") is None:
        return False
    if not waiter.get("profile") or holder.get("profile") != waiter.get("profile"):
        return False
    if waiter.get("local") or holder.get("local"):
        same = bool(waiter.get("local") and holder.get("local"))
    else:  # another process's: its pid and host name say who it is (a holder without them: unknown)
        same = waiter.get("pid") is not None and all(
            holder.get(k) == waiter.get(k) for k in ("pid", "hostname")
        )
    return same and float(holder["since"]) >= float(waiter.get("arrived") or 0.0)


def plan(waiter: dict[str, Any], holder_of: HolderOf, now: float | None = None) -> list[str]:
    """The devices whose holders must give them back so ``waiter`` can start at ``now`` (:func:`choose`)."""
    return list(choose(waiter, holder_of, now).devices)


def describe_waiter(waiter: dict[str, Any]) -> str:
    """``profile 'urgent' of flow run 'x' (pid 12, priority 10)`` for logs and events."""
    run = waiter.get("flow_run_name")
    where = f" of flow run {run!r}" if run else (" of this flow run" if waiter.get("local") else "")
    pid = f"pid {waiter['pid']}, " if waiter.get("pid") and not waiter.get("local") else ""
    return f"profile {waiter.get('profile')!r}{where} ({pid}priority {int(waiter.get('priority') or 0)})"


def preemption_reason(waiter: dict[str, Any], waited: str) -> str:
    """Why a task run stopped for ``waiter`` (``waited``: how long it waited, ``waiting 1.2s``)."""
    if waiter.get("reclaimed_by"):  # its borrowed devices taken back (gpu_tasks.devices.lending)
        return (
            f"reclaimed by {waiter['reclaimed_by']}: its borrowed device(s) go back to "
            f"{describe_waiter(waiter)}, owed them within quota {waiter['reclaimed_by']!r}, {waited}"
        )
    return f"preempted by {describe_waiter(waiter)}, {waited}"


@dataclass(frozen=True)
class PreemptedRun:
    """What a shared cluster's worker returns for a task interrupted for a higher-priority waiter."""

    started: float
    ended: float
    worker: str
