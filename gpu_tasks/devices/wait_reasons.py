"""Why a task waits: one reason, in words, from what the device queue knows at the time (pure).
See docs/leases.md, "Why a task waits"."""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpu_tasks.policy import Holding

# the shared scheduler's kinds (why_waiting's, by precedence: docs/leases.md, "Why a task waits")
BOARD_QUEUED = "board-queued"
BOARD_BUSY = "board-busy"
_HOLDER_FIELDS = ("address", "profile", "flow_run_name", "flow_run_id", "pid", "user", "local", "priority")


@dataclass(frozen=True)
class Holder:
    """Who holds a wanted device: a profile of this flow run (``local``) or another process's lease."""

    address: str
    profile: str | None = None
    flow_run_name: str | None = None
    flow_run_id: str | None = None
    pid: int | None = None
    user: str | None = None  # another Unix user's holder
    local: bool = False
    priority: int = 0
    preemptible: bool = False
    since: float | None = None  # when it took the device (time.time())
    min_run_time: float = 0.0
    team: str | None = None  # its quota
    borrowed: bool = False  # beyond its quota: a team owed devices takes it back (devices/lending)

    @property
    def protected_until(self) -> float | None:
        """When its protected run time ends (``None``: not protected)."""
        return Holding(self.preemptible, self.priority, self.since, self.min_run_time).protected_until()

    def who(self) -> str:
        """``profile 'p' of this flow run`` or ``profile 'p' of flow run 'x' (pid 12)``."""
        pid = self.pid if self.pid is not None else "?"
        if not self.profile and not self.flow_run_name and not self.local:  # a lock with no details
            if self.pid is None:  # it read "(pid ?)": a new-user pass
                return "a process that left no holder record (fuser -v on the device's lock file names it)"
            return f"a process that left no details (pid {pid})"
        name = f"profile {self.profile!r}" if self.profile else "a holder"
        if self.local:
            return f"{name} of this flow run"
        run = f"flow run {self.flow_run_name!r}" if self.flow_run_name else "a process"
        user = f", user {self.user}" if self.user else ""
        return f"{name} of {run} (pid {pid}{user})"

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _HOLDER_FIELDS}

    @classmethod
    def of(cls, address: str, info: Mapping[str, Any]) -> Holder:
        """From a lease holder's info or a book's."""
        pid = info.get("pid")
        return cls(
            address=address,
            profile=info.get("profile"),
            flow_run_name=info.get("flow_run_name"),
            flow_run_id=None if info.get("flow_run_id") is None else str(info.get("flow_run_id")),
            pid=int(pid) if isinstance(pid, int) else None,
            user=info.get("user") if info.get("elsewhere") or info.get("other_user") else None,
            local=bool(info.get("local")),
            priority=int(info.get("priority") or 0),
            preemptible=bool(info.get("preemptible")),
            since=None if info.get("since") is None else float(info["since"]),
            min_run_time=float(info.get("min_run_time") or 0.0),
            team=info.get("quota"),
            borrowed=bool(info.get("borrowed")),
        )


@dataclass(frozen=True)
class Ahead:
    """A waiter that ranks before the one asking (and wants one of its devices)."""

    profile: str | None
    flow_run_name: str | None = None
    local: bool = False
    priority: int = 0  # its effective (aged) priority
    team: str | None = None
    usage: float = 0.0  # its team's decayed usage

    def who(self) -> str:
        name = f"profile {self.profile!r}"
        if self.local:
            return f"{name} of this flow run"
        return f"{name} of flow run {self.flow_run_name!r}" if self.flow_run_name else name


@dataclass(frozen=True)
class WaitView:
    """What the device queue knows about one waiter now."""

    profile: str
    priority: int = 0  # effective
    team: str | None = None  # its quota
    usage: float = 0.0  # its team's decayed usage
    holders: tuple[Holder, ...] = ()  # of the devices it wants
    quota_full: str | None = None  # its quota, when that has no room
    quota_used: int | None = None
    quota_limit: int | None = None
    borrowing: tuple[str, float, float] | None = None  # (team, borrowed, limit) at its borrowing limit
    ahead: tuple[Ahead, ...] = ()  # waiters ranking before it, first first
    programs: tuple[tuple[str, str], ...] = ()  # address -> why programs outside gpu-tasks keep it off


@dataclass(frozen=True)
class WaitReason:
    """Why a waiter waits: ``kind`` (see :func:`why_waiting`, or a board kind), a sentence, what it names."""

    kind: str
    text: str
    until: float | None = None  # a protected run time's end
    holder: dict[str, Any] | None = None
    quota: str | None = None
    used: float | None = None
    limit: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON for a waiter's side file, ``gpu-tasks waiters --json`` and the event's payload."""
        out: dict[str, Any] = {"kind": self.kind, "text": self.text}
        for k in ("until", "holder", "quota", "used", "limit"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        return out


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def why_waiting(view: WaitView, now: float) -> WaitReason:
    """The one reason ``view``'s waiter waits at ``now``: the first kind that applies (docs/leases.md)."""
    if view.borrowing is not None:
        team, borrowed, limit = view.borrowing
        return WaitReason(
            "borrowing-limit",
            f"team {team!r} has borrowed {borrowed:g} device(s), its borrowing limit is {limit:g}: "
            "it waits for room in its own quota",
            quota=team,
            used=borrowed,
            limit=limit,
        )
    if view.quota_full is not None:
        use = (
            f"{view.quota_used} of {view.quota_limit} device(s) in use"
            if view.quota_used is not None and view.quota_limit is not None
            else "no room"
        )
        return WaitReason(
            "quota-full",
            f"quota {view.quota_full!r} is full ({use})",
            quota=view.quota_full,
            used=view.quota_used,
            limit=view.quota_limit,
        )
    if view.ahead:
        first = view.ahead[0]
        fair = (
            first.priority == view.priority
            and first.team is not None
            and first.team != view.team
            and first.usage < view.usage
        )
        holder = {"profile": first.profile, "flow_run_name": first.flow_run_name, "local": first.local}
        if fair:
            return WaitReason(
                "fair-share",
                f"fair share gives the next device to team {first.team!r} ({first.who()}; its decayed usage "
                f"{first.usage:.0f} device-s, team {view.team or '-'!r}'s {view.usage:.0f})",
                holder=dict(holder, team=first.team),
            )
        more = f" and {len(view.ahead) - 1} more" if len(view.ahead) > 1 else ""
        return WaitReason(
            "queued",
            f"queued behind {first.who()} (effective priority {first.priority}){more}, which rank(s) first",
            holder=holder,
        )
    others = [h for h in view.holders if h.profile != view.profile or not h.local]
    protected = [
        h
        for h in others
        if h.preemptible
        # a waiter of higher priority preempts it; a team owed devices takes back borrowed ones
        and (h.priority < view.priority or (h.borrowed and view.team not in (None, h.team)))
        and (h.protected_until or 0.0) > now
    ]
    if protected:
        h = min(protected, key=lambda x: x.protected_until or 0.0)
        until = h.protected_until
        assert until is not None
        lent = f" (borrowed beyond quota {h.team!r})" if h.borrowed else ""
        return WaitReason(
            "protected",
            f"device {h.address} is held by {h.who()}{lent}, inside its protected run time (min_run_time "
            f"{h.min_run_time:g}s) until {_clock(until)} (in {max(0.0, until - now):.0f}s)",
            until=until,
            holder=h.as_dict(),
        )
    if others:
        h = others[0]
        rest = f" (and {len(others) - 1} more device(s))" if len(others) > 1 else ""
        return WaitReason(
            "device-held",
            f"device {h.address} is held by {h.who()}{rest}",
            holder=h.as_dict(),
        )
    if view.programs:
        address, why = sorted(view.programs)[0]
        return WaitReason("other-programs", f"programs outside gpu-tasks use device {address}: {why}")
    return WaitReason("starting", "starting: its devices are free, its workers are being started")


def board_reason(entry: Mapping[str, Any], entries: Sequence[Mapping[str, Any]]) -> WaitReason:
    """Why the shared scheduler's waiter ``entry`` waits: queued behind entries of higher
    ``effective_priority`` on its workers, else the workers that fit are busy."""
    mine = set(entry.get("workers") or ())
    me = int(entry.get("effective_priority") or 0)
    before = [
        e
        for e in entries
        if e is not entry
        and e.get("token") != entry.get("token")
        and int(e.get("effective_priority") or 0) > me
        and (not mine or not e.get("workers") or mine & set(e.get("workers") or ()))
    ]
    if before:
        first = max(before, key=lambda e: int(e.get("effective_priority") or 0))
        more = f" and {len(before) - 1} more" if len(before) > 1 else ""
        who = f"profile {first.get('profile')!r} of flow run {first.get('flow_run_name')!r}"
        return WaitReason(
            BOARD_QUEUED,
            f"queued on the shared scheduler behind {who} (effective priority "
            f"{int(first.get('effective_priority') or 0)}){more}",
            holder={k: first.get(k) for k in ("profile", "flow_run_name", "hostname", "pid")},
        )
    where = ", ".join(sorted(mine)) or "every worker that fits"
    return WaitReason(BOARD_BUSY, f"the workers it is queued on are busy with other work ({where})")


# a waiting acquire calls the listener its caller set with each reason it works out
Listener = Callable[[WaitReason], None]
LISTENER: contextvars.ContextVar[Listener | None] = contextvars.ContextVar(
    "gpu_tasks_wait_listener", default=None
)


def tell(reason: WaitReason) -> None:
    """Pass ``reason`` to the listener of the current context, if any."""
    listener = LISTENER.get()
    if listener is not None:
        with contextlib.suppress(Exception):  # a listener's failure must not end the wait
            listener(reason)


class Throttle:
    """When a waiter's reason is said: the first at once, the same one at most every ``every`` seconds,
    a changed one as soon as ``gap`` seconds have passed since the last."""

    def __init__(self, every: float = 30.0, gap: float = 2.0) -> None:
        self.every, self.gap = every, gap
        self.last_at: float | None = None
        self.last_kind_text: tuple[str, str] | None = None

    def due(self, reason: WaitReason, now: float) -> bool:
        """Whether to say ``reason`` at ``now`` (monotonic); records it when so."""
        wait = self.gap if self.last_kind_text != _key(reason) else self.every
        ok = self.last_at is None or now - self.last_at >= wait
        if ok:
            self.last_at, self.last_kind_text = now, _key(reason)
        return ok


def _key(reason: WaitReason) -> tuple[str, str]:
    """What makes two reasons the same: the kind and who or what holds it (not the seconds left)."""
    who = reason.holder or {}
    parts = (who.get("address"), who.get("profile"), who.get("flow_run_name"), reason.quota, reason.until)
    return reason.kind, "|".join(str(p or "") for p in parts)
