"""Team quotas: at most N devices held at once across flow runs, kept as Prefect global concurrency
limits ``gpu-quota:<name>`` (borrowing ``gpu-borrow:``, lending ``gpu-lend:``) (docs/leases.md, "Quotas")."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from gpu_tasks.errors import ClusterError
from gpu_tasks.prefect_api.api import sync_client
from gpu_tasks.prefect_api.concurrency_leases import MIN_LEASE_S, LeaseHolder

logger = logging.getLogger(__name__)

PREFIX = "gpu-quota:"
BORROW_PREFIX = "gpu-borrow:"  # a team's borrowing limit; its borrowed devices take these slots
LEND_PREFIX = "gpu-lend:"  # a team's lending limit (only read)
CHECK_AGAIN_S = 5.0  # how long a need that fitted its quota is not read from the API again
WAIT_LOG_EVERY = 30.0  # seconds between the lines that say a task still waits for its quota
LIMITS_PAGE = 200  # global concurrency limits read per request


def limit_name(quota: str) -> str:
    """The Prefect global concurrency limit that keeps ``quota``."""
    return f"{PREFIX}{quota}"


def borrow_name(quota: str) -> str:
    """The limit that keeps ``quota``'s borrowing limit."""
    return f"{BORROW_PREFIX}{quota}"


def lend_name(quota: str) -> str:
    """The limit that keeps ``quota``'s lending limit."""
    return f"{LEND_PREFIX}{quota}"


def holders_here(quota: str, holders: dict[str, Any]) -> list[dict[str, Any]]:
    """The lease infos of :func:`gpu_tasks.devices.leases.holders` that count against ``quota``."""
    return [dict(info, address=a) for a, info in holders.items() if info and info.get("quota") == quota]


def how_to_set(quota: str, n: int | str = "N") -> str:
    """How to create or change ``quota``'s limit, for error messages."""
    return (
        f"`gpu-tasks quotas set {quota} {n}` (or a global concurrency limit {limit_name(quota)!r} "
        "in the Prefect UI)"
    )


class QuotaSlots:
    """The quota slots one device book (one flow run) holds, by Prefect lease; ``take`` never waits."""

    def __init__(self, lease_seconds: float, flow_run_id: uuid.UUID | None = None) -> None:
        self.lease_seconds = max(MIN_LEASE_S, float(lease_seconds))
        self._holder = ("flow_run", flow_run_id) if flow_run_id else None
        self.leases = LeaseHolder("gpu-tasks-quota-leases", self.lease_seconds, log=logger)
        self.checked: dict[tuple[str, int], float] = {}  # (quota, need) -> when it last fitted

    def limit(self, quota: str, owner: str | None = None) -> Any:
        """The quota's global concurrency limit; ``ClusterError`` (naming profile ``owner``) when it
        does not exist."""
        from prefect.exceptions import ObjectNotFound

        try:
            with sync_client() as client:
                return client.read_global_concurrency_limit_by_name(limit_name(quota))
        except ObjectNotFound:
            who = f"profile {owner!r}: " if owner else ""
            raise ClusterError(
                f"{who}quota {quota!r} has no limit: create it with {how_to_set(quota)}"
            ) from None

    def check(self, owner: str, quota: str, need: int) -> None:
        """Fail fast when ``owner`` needs more devices at once than ``quota`` allows (a need that
        fitted is not read again for ``CHECK_AGAIN_S``: a growing profile asks often)."""
        if time.monotonic() - self.checked.get((quota, need), -CHECK_AGAIN_S) < CHECK_AGAIN_S:
            return
        limit = self.limit(quota, owner)
        if need > int(limit.limit):
            raise ClusterError(
                f"profile {owner!r} needs {need} device(s) at once but quota {quota!r} allows "
                f"{limit.limit}: it can never start. Raise the quota with {how_to_set(quota, need)}, "
                "or ask for fewer devices"
            )
        self.checked[(quota, need)] = time.monotonic()

    def take(self, quota: str, slots: int) -> uuid.UUID | None:
        """Hold ``slots`` of ``quota`` now (a lease id), or ``None`` when it has no room."""
        answer = self.leases.take(
            [limit_name(quota)], slots, f"{slots} slot(s) of quota {quota!r}", self._holder
        )
        if not answer.granted:  # 423 Locked: no room now
            return None
        if answer.lease_id is None:
            raise ClusterError(f"quota {quota!r} has no limit: create it with {how_to_set(quota)}")
        return answer.lease_id

    def borrow(self, quota: str, slots: int) -> uuid.UUID | None:
        """Hold ``slots`` of ``quota``'s borrowing limit now, or ``None`` (no room, or no such limit)."""
        what = f"{slots} borrowed slot(s) of quota {quota!r}"
        answer = self.leases.take([borrow_name(quota)], slots, what, self._holder)
        return answer.lease_id if answer.granted else None

    def release(self, lease_id: uuid.UUID | None) -> None:
        """Give the slots of ``lease_id`` back (best effort: else the lease expires)."""
        self.leases.release(lease_id)

    def close(self) -> None:
        """Give every slot back and stop renewing."""
        self.leases.close()


def all_limits(most: int | None = None) -> list[Any]:
    """Every global concurrency limit of the Prefect API (``most``: stop at that many or more)."""
    limits: list[Any] = []
    with sync_client() as client:
        while most is None or len(limits) < most:
            page = client.read_global_concurrency_limits(limit=LIMITS_PAGE, offset=len(limits))
            limits.extend(page)
            if len(page) < LIMITS_PAGE:
                break
    return limits


def teams() -> dict[str, dict[str, Any]]:
    """Each team's quota, use, borrowing and lending limits now (``lending_limit`` ``None``: it lends
    all of its unused quota), in one read of the API."""
    named = {limit.name: limit for limit in all_limits()}
    out = {}
    for name, limit in sorted(named.items()):
        if not name.startswith(PREFIX):
            continue
        quota = name[len(PREFIX) :]
        borrow, lend = named.get(borrow_name(quota)), named.get(lend_name(quota))
        out[quota] = {
            "limit": int(limit.limit),
            "in_use": int(limit.active_slots),
            "active": bool(limit.active),
            "borrowing_limit": int(borrow.limit) if borrow is not None and borrow.active else 0,
            "borrowed": int(borrow.active_slots) if borrow is not None else 0,
            "lending_limit": int(lend.limit) if lend is not None and lend.active else None,
        }
    return out


def usage(holders: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every team's row of :func:`teams`, with this host's holders (``holders``:
    :func:`gpu_tasks.devices.leases.holders`)."""
    holders = holders or {}
    return [
        dict(quota=quota, **row, holders_here=holders_here(quota, holders)) for quota, row in teams().items()
    ]


def set_sharing(quota: str, borrowing_limit: int | None = None, lending_limit: int | None = None) -> None:
    """Set ``quota``'s borrowing and lending limits (``None``: leave it; a negative lending limit:
    remove it, so that all of its unused quota may be lent)."""
    from prefect.exceptions import ObjectNotFound

    with sync_client() as client:
        if borrowing_limit is not None:
            client.upsert_global_concurrency_limit_by_name(borrow_name(quota), max(0, borrowing_limit))
        if lending_limit is not None and lending_limit >= 0:
            client.upsert_global_concurrency_limit_by_name(lend_name(quota), lending_limit)
        elif lending_limit is not None:
            with contextlib.suppress(ObjectNotFound):
                client.delete_global_concurrency_limit_by_name(lend_name(quota))


def set_limit(quota: str, n: int) -> None:
    """Create ``quota``'s limit with ``n`` devices, or change it."""
    with sync_client() as client:
        client.upsert_global_concurrency_limit_by_name(limit_name(quota), n)


def delete_limit(quota: str) -> bool:
    """Delete ``quota``'s limit; whether it existed."""
    from prefect.exceptions import ObjectNotFound

    with sync_client() as client:
        for name in (borrow_name(quota), lend_name(quota)):  # its borrowing and lending limits go too
            with contextlib.suppress(ObjectNotFound):
                client.delete_global_concurrency_limit_by_name(name)
        try:
            client.delete_global_concurrency_limit_by_name(limit_name(quota))
            return True
        except ObjectNotFound:
            return False


def task_need(gpus: float) -> int:
    """The devices one task of a shared-scheduler profile counts against its quota: ``gpus`` rounded
    up (which share of a device others use is not known here)."""
    return max(1, math.ceil(float(gpus) - 1e-9))


def wait_for_room(
    slots: QuotaSlots,
    owner: str,
    quota: str,
    need: int,
    stop: threading.Event,
    timeout: float | None,
    say: Callable[[str], None],
    borrow: Callable[[], tuple[uuid.UUID | None, str | None]] | None = None,
) -> tuple[uuid.UUID, float, bool]:
    """Take ``need`` slots of ``quota`` for one task of ``owner``, waiting for room (said through
    ``say`` every ``WAIT_LOG_EVERY`` s); while it is full, try ``borrow`` (a preemptible profile's
    :func:`gpu_tasks.devices.lending.borrow_slots`). Returns ``(lease id, seconds waited, borrowed)``."""
    slots.check(owner, quota, need)
    t0 = time.monotonic()
    next_log = t0
    delay = 0.1
    while True:
        lease = slots.take(quota, need)
        if lease is not None:
            return lease, time.monotonic() - t0, False
        why_not = None
        if borrow is not None:
            lease, why_not = borrow()
            if lease is not None:
                return lease, time.monotonic() - t0, True
        now = time.monotonic()
        limit = slots.limit(quota, owner)
        use = f"{int(limit.active_slots)} of {int(limit.limit)} device(s) in use"
        if timeout is not None and now - t0 >= timeout:
            raise ClusterError(
                f"profile {owner!r} waited {now - t0:.0f}s for room for {need} device(s) in quota {quota!r} "
                f"({use}): GPU_TASKS_LEASE_TIMEOUT (now {timeout:g}s). Raise it, or the quota with "
                f"{how_to_set(quota)}"
            )
        if now >= next_log:
            name = str(limit.name) + ("" if getattr(limit, "active", True) else ", inactive")
            say(
                f"profile {owner!r}: a task waits for room for {need} device(s) in quota {quota!r} "
                f"({name}: {use}), holding no device"
                + (f"; it does not borrow: {why_not}" if why_not else "")
            )
            next_log = now + WAIT_LOG_EVERY
        if stop.wait(delay):
            raise RuntimeError("the task runner is shutting down")
        delay = min(1.0, delay * 1.5)
