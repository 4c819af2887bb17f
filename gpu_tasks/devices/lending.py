"""Borrowing and reclaim on this host's leases: :mod:`gpu_tasks.borrowing` on the quotas' limits and the
device queue. The book is passed in (``Any``): this module is below it and never imports it."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from gpu_tasks import borrowing, preemption
from gpu_tasks.borrowing import Ask, Claim, Team
from gpu_tasks.devices import leases
from gpu_tasks.prefect_api import quotas

logger = logging.getLogger("gpu_tasks.devices.book")

TEAMS_FRESH_S = 1.0  # how long a read of the teams' limits serves the reclaim and queue checks
_cache: tuple[float, dict[str, Team]] | None = None
_lock = threading.Lock()


def teams(fresh: bool = False) -> dict[str, Team]:
    """Every team's quota, use, borrowing and lending (read again after ``TEAMS_FRESH_S`` or if ``fresh``)."""
    global _cache
    with _lock:
        if not fresh and _cache is not None and time.monotonic() - _cache[0] < TEAMS_FRESH_S:
            return _cache[1]
    out = {
        name: Team(
            quota=row["limit"],
            used=row["in_use"],
            borrowed=row["borrowed"],
            borrowing_limit=row["borrowing_limit"],
            lending_limit=row["lending_limit"],
        )
        for name, row in quotas.teams().items()
    }
    with _lock:
        _cache = (time.monotonic(), out)
    return out


def ask_of(waiter: dict[str, Any]) -> Ask:
    """A waiter's (or a request's) :class:`gpu_tasks.borrowing.Ask`."""
    groups = preemption.groups_of(waiter)
    size = len(groups[0]) if groups else 1
    return Ask(
        waiter.get("quota"), size * max(1, int(waiter.get("need") or 1)), bool(waiter.get("preemptible"))
    )


def borrow_slots(
    slots: Any,
    team: str,
    need: int,
    preemptible: bool,
    waiters: Callable[[], list[Ask]] = list,
    what: tuple[str, str] = ("", ""),
) -> tuple[Any, str | None]:
    """A slot of ``team``'s borrowing limit for ``need`` devices beyond its full quota, if allowed:
    ``(lease id, None)`` or ``(None, why not)``. ``what``: for the log."""
    ask = Ask(team, need, preemptible)
    known = teams(fresh=True)
    why = borrowing.why_not_borrow(ask, known)  # the cheap reasons first: no waiter read
    if why is None:
        why = borrowing.why_not_borrow(ask, known, waiters())
    if why is not None:
        return None, why
    lease_id = slots.borrow(team, need)
    if lease_id is None:
        return None, f"quota {team!r} is full and its borrowing limit has no room"
    logger.info(
        "profile %r: quota %r is full; borrowing %s beyond it (borrowing limit %d, %d borrowed before): "
        "preemptible work, reclaimed when a team owed them asks",
        what[0],
        team,
        what[1] or f"{need} device(s)",
        known[team].borrowing_limit,
        known[team].borrowed,
    )
    return lease_id, None


def borrow(book: Any, me: dict[str, Any], new: list[str], lease: leases.Lease) -> Any:
    """A borrowing slot for the devices ``new`` ``me`` just leased beyond its quota; else ``borrow_why``."""
    lease_id, why = borrow_slots(
        book.quota_slots(),
        me["quota"],
        len(new),
        bool(me["preemptible"]),
        lambda: [
            ask_of(w)
            for w in book.rivals({}, besides=me["profile"])
            if set(new) & set(w.get("addresses") or ())
        ],
        (me["profile"], "device(s) " + ",".join(new)),
    )
    if lease_id is None:
        me["borrow_why"] = why
        return None
    leases.annotate(lease, new, borrowed=True)
    return lease_id


def at_borrowing_limit(me: dict[str, Any]) -> tuple[str, float, float] | None:
    """``(team, borrowed, limit)`` when preemptible ``me`` cannot borrow: its team is at its limit."""
    team = me.get("quota")
    if team is None or not me.get("preemptible"):
        return None
    try:
        known = teams().get(team)
    except Exception:
        return None
    if known is None or not known.borrowing_limit or known.borrowed < known.borrowing_limit:
        return None
    return team, float(known.borrowed), float(known.borrowing_limit)


def still_ahead(me: dict[str, Any], before: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The waiters of ``before`` (ranked before ``me``) that ``me`` does not take precedence over."""
    if me.get("quota") is None or not any(w.get("quota") not in (None, me["quota"]) for w in before):
        return before
    try:
        known = teams()
    except Exception:  # the API cannot say: rank order, as without borrowing
        return before
    mine = ask_of(me)
    return [w for w in before if not borrowing.yields_to(ask_of(w), mine, known)]


def reclaim_due(book: Any, preemptible: set[str]) -> tuple[dict[str, Any], list[str]] | None:
    """An entitled waiter of another team past its grace (with ``reclaimed_by``), and the devices this
    book's ``preemptible`` profiles borrowed that it takes back; or ``None``."""
    with book.cond:
        ours = {
            a for a, o in book.holders.items() if o in preemptible and book.leases[a].info.get("borrowed")
        }
        if not ours:
            return None
    rivals = book.rivals({})
    now = time.time()
    due = [
        w
        for w in rivals
        if w.get("quota") is not None
        and set(w.get("addresses") or ()) & ours
        and preemption.due(w, book.preemption_grace, now)
    ]
    if not due:
        return None
    known = teams()
    holder_of = book._holder_of()
    for waiter in sorted(due, key=lambda w: leases.rank(w, now, {})):
        if not borrowing.entitled(ask_of(waiter), known):
            continue
        claims = [[(a, _claim(holder_of(a))) for a in g] for g in preemption.groups_of(waiter)]
        choice = borrowing.reclaim_victims(waiter["quota"], claims, int(waiter.get("need") or 1), now)
        mine = [a for a in choice.devices if a in ours]
        if mine:
            return dict(waiter, reclaimed_by=waiter["quota"]), mine
    return None


def _claim(holder: dict[str, Any] | None) -> Claim | None:
    if holder is None:
        return None
    return Claim(holder.get("quota"), bool(holder.get("borrowed")), preemption.holding(holder))
