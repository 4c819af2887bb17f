"""Borrowing and reclaim between teams' quotas: one pure policy (no clock, no I/O) for the host's
leases (gpu_tasks.devices.lending) and a shared scheduler (gpu_tasks.cluster.board)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpu_tasks.policy import Holding, VictimChoice, choose_victims


@dataclass(frozen=True)
class Team:
    """One team's quota at one moment: devices ``used`` within it, ``borrowed`` beyond it."""

    quota: int
    used: int = 0
    borrowed: int = 0
    borrowing_limit: int = 0
    lending_limit: int | None = None

    @property
    def room(self) -> int:
        """Devices it may still take within its quota."""
        return max(0, self.quota - self.used)

    @property
    def lendable(self) -> int:
        """Devices of its unused quota other teams may borrow now (``lending_limit`` ``None``: all)."""
        return self.room if self.lending_limit is None else min(self.room, max(0, self.lending_limit))


@dataclass(frozen=True)
class Ask:
    """A request for devices, or a waiter (``team`` ``None``: no quota). ``held``: it holds its quota
    slots already (queued on a shared scheduler), so it is entitled whatever room its team has left."""

    team: str | None
    devices: int = 1
    preemptible: bool = False
    held: bool = False


@dataclass(frozen=True)
class Claim:
    """A device's holder as reclaim judges it: its team, whether the device is borrowed, and its run."""

    team: str | None
    borrowed: bool
    holding: Holding = Holding(preemptible=True, priority=0)


Groups = Sequence[Sequence[tuple[str, "Claim | None"]]]


def entitled(ask: Ask, teams: Mapping[str, Team]) -> bool:
    """Whether ``ask``'s team has room in its quota for all of it, or holds it already."""
    team = teams.get(ask.team) if ask.team is not None else None
    return team is not None and (ask.held or team.room >= ask.devices)


def lending_pool(teams: Mapping[str, Team], borrower: str | None) -> int:
    """Devices the teams other than ``borrower`` lend now, each up to its lending limit."""
    return sum(t.lendable for name, t in teams.items() if name != borrower)


def why_not_borrow(ask: Ask, teams: Mapping[str, Team], waiters: Iterable[Ask] = ()) -> str | None:
    """Why ``ask`` (its quota full) may not borrow now, or ``None``; an entitled waiter of another team
    keeps the devices."""
    if ask.team is None or ask.team not in teams:
        return "it has no quota to borrow beyond"
    team = teams[ask.team]
    if not ask.preemptible:
        return f"quota {ask.team!r} is full and only preemptible profiles borrow beyond it"
    if team.borrowed + ask.devices > team.borrowing_limit:
        return (
            f"quota {ask.team!r} is full and its borrowing limit is {team.borrowing_limit} device(s) "
            f"({team.borrowed} borrowed now)"
        )
    lent = sum(t.borrowed for t in teams.values())
    pool = lending_pool(teams, ask.team)
    if lent + ask.devices > pool:
        return (
            f"quota {ask.team!r} is full and the other teams lend {pool} device(s) now "
            f"({lent} borrowed; their lending limits keep the rest)"
        )
    for w in waiters:
        if w.team != ask.team and entitled(w, teams):
            return f"team {w.team!r} waits for devices within its quota"
    return None


def yields_to(first: Ask, me: Ask, teams: Mapping[str, Team]) -> bool:
    """Whether ``first``, ranked before ``me``, lets ``me`` have the devices: ``first`` is beyond its
    quota and ``me`` entitled, of another team (else each waits for the other)."""
    return (
        first.team is not None
        and first.team != me.team
        and not entitled(first, teams)
        and entitled(me, teams)
    )


def reclaim_victims(team: str | None, groups: Groups, need: int, now: float) -> VictimChoice:
    """The borrowed devices of other teams an entitled waiter of ``team`` takes back to start ``need``
    of its ``groups``, as :func:`gpu_tasks.policy.choose_victims` judges them."""

    def judged(claim: Claim | None) -> Holding | None:
        if claim is None:
            return None
        h = claim.holding
        takeable = claim.borrowed and (team is None or claim.team != team)
        return Holding(preemptible=takeable, priority=0, since=h.since, min_run_time=h.min_run_time)

    return choose_victims([[(a, judged(c)) for a, c in g] for g in groups], need, 1, now)
