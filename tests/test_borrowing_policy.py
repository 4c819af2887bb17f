"""Borrowing and reclaim between teams' quotas, the pure policy of gpu_tasks.borrowing: its rules one by
one, then a simulated host driven only by the policy (random teams, limits, arrivals and run lengths):
no device is ever granted twice, limits hold, reclaim always makes room for an entitled waiter, and no
waiter starves under aging plus fair share."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from hypothesis import example, given, settings
from hypothesis import strategies as st

from gpu_tasks.borrowing import (
    Ask,
    Claim,
    Groups,
    Team,
    entitled,
    lending_pool,
    reclaim_victims,
    why_not_borrow,
    yields_to,
)
from gpu_tasks.policy import Holding, waiter_rank

NOW = 1000.0


# The decision one ask gets, composed from the policy's rules as the host's leases
# (gpu_tasks.devices.lending) and a shared scheduler (gpu_tasks.cluster.board) compose them.
@dataclass(frozen=True)
class Grant:
    """Take ``groups`` (indexes of the request's device groups); ``borrowed``: beyond its quota."""

    groups: tuple[int, ...]
    borrowed: bool = False


@dataclass(frozen=True)
class Reclaim:
    """Take back ``victims`` (borrowed devices of other teams) first; then the request fits."""

    victims: tuple[str, ...]


@dataclass(frozen=True)
class Wait:
    """Nothing now, and why (``until``: when protected borrowed work may be reclaimed)."""

    reason: str
    until: float | None = None


Decision = Grant | Reclaim | Wait


def admit(
    ask: Ask,
    groups: Groups,
    need: int,
    teams: Mapping[str, Team],
    waiters: Iterable[Ask] = (),
    now: float = 0.0,
) -> Decision:
    """What ``ask`` gets now on ``groups``, ``need`` of them at once: free groups within its quota or
    borrowed, or, entitled, the borrowed devices of other teams to take back first, or a wait."""
    borrowed = ask.team is not None and not entitled(ask, teams)
    why = why_not_borrow(ask, teams, waiters) if borrowed else None
    if why is not None:
        return Wait(why)
    need = max(1, need)
    free = [i for i, g in enumerate(groups) if all(c is None for _, c in g)]
    if len(free) >= need:
        return Grant(tuple(free[:need]), borrowed=borrowed)
    if not borrowed and ask.team is not None:
        choice = reclaim_victims(ask.team, groups, need, now)
        if choice.devices:
            return Reclaim(choice.devices)
        if choice.protected_until is not None:
            return Wait(
                f"borrowed devices {','.join(choice.protected)} are inside their protected run time",
                choice.protected_until,
            )
    return Wait("its devices are held")


def _claim(team: str, borrowed: bool = True, ran: float = 10.0, protect: float = 0.0) -> Claim:
    return Claim(team, borrowed, Holding(preemptible=True, priority=0, since=NOW - ran, min_run_time=protect))


def _single(*claims: Claim | None) -> list[list[tuple[str, Claim | None]]]:
    return [[(str(i), c)] for i, c in enumerate(claims)]


TWO = {"a": Team(quota=1, used=1, borrowing_limit=1), "b": Team(quota=1)}


# ------------------------------------------------------------------ the rules
def test_a_full_team_borrows_an_idle_teams_device_only_in_a_preemptible_profile():
    a = Ask("a", 1, preemptible=True)
    assert admit(a, _single(_claim("a", False), None), 1, TWO, now=NOW) == Grant((1,), borrowed=True)
    steady = admit(Ask("a", 1), _single(_claim("a", False), None), 1, TWO, now=NOW)
    assert isinstance(steady, Wait) and "only preemptible profiles borrow" in steady.reason
    within = admit(Ask("b", 1), _single(_claim("a", False), None), 1, TWO, now=NOW)
    assert within == Grant((1,), borrowed=False)


def test_the_borrowing_limit_and_the_lenders_lending_limit():
    a = Ask("a", 1, preemptible=True)
    limited = dict(TWO, a=Team(quota=1, used=1, borrowed=1, borrowing_limit=1))
    assert "borrowing limit is 1" in (why_not_borrow(a, limited) or "")
    assert "borrowing limit is 0" in (why_not_borrow(a, dict(TWO, a=Team(quota=1, used=1))) or "")
    kept = dict(TWO, b=Team(quota=2, lending_limit=1))  # b keeps one of its two devices
    assert why_not_borrow(Ask("a", 1, True), kept) is None
    assert "lend 1 device(s)" in (
        why_not_borrow(Ask("a", 2, True), dict(kept, a=Team(quota=1, used=1, borrowing_limit=2))) or ""
    )
    assert "lend 0" in (why_not_borrow(a, dict(TWO, b=Team(quota=1, lending_limit=0))) or "")
    # b's own use shrinks what it lends: used 1 of 2, lending limit 2 -> 1 left to lend
    assert lending_pool({"a": TWO["a"], "b": Team(quota=2, used=1, lending_limit=2)}, "a") == 1


def test_no_borrowing_while_a_team_entitled_to_the_devices_waits():
    a = Ask("a", 1, preemptible=True)
    why = why_not_borrow(a, TWO, [Ask("b", 1)])
    assert why == "team 'b' waits for devices within its quota"
    full_b = dict(TWO, b=Team(quota=1, used=1))
    assert why_not_borrow(a, dict(full_b, c=Team(quota=1)), [Ask("b", 1)]) is None  # b is not owed more


def test_a_waiter_that_holds_its_quota_slots_already_is_entitled():
    """A shared scheduler's queued task took its quota slots before it was handed off: its team has no
    room left, yet it is owed the devices (it keeps borrowers off them, and others yield to it)."""
    full_b = dict(TWO, b=Team(quota=1, used=1), c=Team(quota=1))
    queued = Ask("b", 1, held=True)
    assert not entitled(Ask("b", 1), full_b) and entitled(queued, full_b)
    why = why_not_borrow(Ask("a", 1, True), full_b, [queued])
    assert why == "team 'b' waits for devices within its quota"
    assert yields_to(Ask("a", 1, True), queued, full_b)
    assert not entitled(Ask("nobody", 1, held=True), full_b)  # no quota of that name: nothing owed


def test_an_entitled_team_reclaims_borrowed_devices_first_whatever_the_priorities():
    b = Ask("b", 1)
    groups = _single(_claim("a", borrowed=False, ran=5), _claim("a", borrowed=True, ran=500))
    assert admit(b, groups, 1, TWO, now=NOW) == Reclaim(("1",))
    # a team never reclaims from itself, and nothing in quota is reclaimed
    assert isinstance(admit(b, _single(_claim("b"), _claim("a", False)), 1, TWO, now=NOW), Wait)
    # the borrower that lost least goes first
    assert reclaim_victims("b", _single(_claim("a", ran=500), _claim("c", ran=5)), 1, NOW).devices == ("1",)


def test_a_borrowed_run_inside_its_protected_run_time_is_reclaimed_only_after_it():
    b = Ask("b", 1)
    young = _single(_claim("a", ran=5, protect=60))
    wait = admit(b, young, 1, TWO, now=NOW)
    assert isinstance(wait, Wait) and wait.until == NOW + 55
    assert admit(b, young, 1, TWO, now=NOW + 55) == Reclaim(("0",))


def test_a_waiter_beyond_its_quota_yields_to_an_entitled_one():
    assert yields_to(Ask("a", 1, True), Ask("b", 1), TWO)
    assert not yields_to(Ask("b", 1), Ask("a", 1, True), TWO)
    assert not yields_to(Ask("a", 1, True), Ask("a", 1), TWO)  # one team: rank order
    assert not yields_to(Ask(None, 1), Ask("b", 1), TWO)  # no quota: rank order


# ------------------------------------------------------------------ reclaim always makes room
_claims = st.one_of(
    st.none(),
    st.builds(
        _claim,
        team=st.sampled_from(["a", "b", "c"]),
        borrowed=st.booleans(),
        ran=st.floats(0, 500),
        protect=st.sampled_from([0.0, 0.0, 100.0]),
    ),
)


@settings(max_examples=400, deadline=None)
@given(
    groups=st.lists(st.lists(_claims, min_size=1, max_size=2), min_size=1, max_size=5), need=st.integers(1, 3)
)
def test_reclaim_always_makes_room_for_an_entitled_waiter(groups, need):
    named = [[(f"{g}.{i}", c) for i, c in enumerate(group)] for g, group in enumerate(groups)]
    teams = {"a": Team(quota=4), "b": Team(quota=1, used=1), "c": Team(quota=1)}
    ask = Ask("a", need)
    assert entitled(ask, teams) == (need <= 4)
    decision = admit(ask, named, need, teams, now=NOW)

    def open_(group, gone=()):
        return all(c is None or a in gone for a, c in group)

    def takeable(group):
        return all(
            c is None or (c.borrowed and c.team != "a" and (c.holding.protected_until() or 0) <= NOW)
            for _, c in group
        )

    if isinstance(decision, Reclaim):
        by = {a: c for g in named for a, c in g}
        assert all(by[v] is not None and by[v].borrowed and by[v].team != "a" for v in decision.victims)
        freed = [[(a, None if a in decision.victims else c) for a, c in g] for g in named]
        again = admit(ask, freed, need, teams, now=NOW)
        assert isinstance(again, Grant) and len(again.groups) == need and not again.borrowed
        assert all(open_(named[i], decision.victims) for i in again.groups)
    elif isinstance(decision, Grant):
        assert all(open_(named[i]) for i in decision.groups)
    else:
        assert sum(map(takeable, named)) < need, "enough to reclaim, yet it waits"


# ------------------------------------------------------------------ a host driven by the policy
@dataclass
class _Run:
    id: int
    team: str | None
    need: int
    preemptible: bool
    priority: int
    length: int
    arrived: float = 0.0


@dataclass
class _Host:
    """Single-device groups; each step: arrivals, ends, then one pass over the waiters in rank order,
    a waiter ranked before another keeping the devices from it unless it yields (beyond its quota)."""

    devices: int
    limits: dict[str, Team]
    aging: float
    held: dict[str, tuple[_Run, bool]] = field(default_factory=dict)  # address -> (run, borrowed)
    ends: dict[int, int] = field(default_factory=dict)
    waiting: list[_Run] = field(default_factory=list)
    usage: dict[str, float] = field(default_factory=dict)
    served: dict[int, float] = field(default_factory=dict)  # run id -> how long it waited (first start)
    reclaims: int = 0

    def teams(self) -> dict[str, Team]:
        out = {}
        for name, t in self.limits.items():
            mine = [b for r, b in self.held.values() if r.team == name]
            out[name] = Team(t.quota, mine.count(False), mine.count(True), t.borrowing_limit, t.lending_limit)
        return out

    def groups(self) -> list[list[tuple[str, Claim | None]]]:
        out: list[list[tuple[str, Claim | None]]] = []
        for d in range(self.devices):
            held = self.held.get(str(d))
            claim = None if held is None else Claim(held[0].team, held[1], Holding(True, 0, since=0.0))
            out.append([(str(d), claim)])
        return out

    def check(self) -> None:
        for name, t in self.teams().items():
            assert t.used <= t.quota, (name, t)
            assert t.borrowed <= t.borrowing_limit, (name, t)
        for run, borrowed in self.held.values():
            assert not borrowed or run.preemptible

    def take(self, run: _Run, decision: Grant, now: int) -> None:
        groups = self.groups()
        before = self.teams()
        for i in decision.groups:
            [(address, claim)] = groups[i]
            assert claim is None and address not in self.held, "a device granted twice"
            self.held[address] = (run, decision.borrowed)
        if decision.borrowed:
            lent = sum(t.borrowed for t in self.teams().values())
            assert lent <= lending_pool(before, run.team), "lent beyond the lenders' lending limits"
        self.ends[run.id] = now + run.length
        self.served.setdefault(run.id, now - run.arrived)
        self.waiting.remove(run)

    def step(self, now: int, arriving: list[_Run]) -> None:
        for run in arriving:
            run.arrived = now
            self.waiting.append(run)
        for address, (run, _) in list(self.held.items()):
            if self.ends[run.id] <= now:
                del self.held[address]
                if run.team:
                    self.usage[run.team] = self.usage.get(run.team, 0.0) + 1.0
        ranked = sorted(
            self.waiting,
            key=lambda r: waiter_rank(
                r.priority, self.aging, r.arrived, now, self.usage.get(r.team or "", 0.0), f"{r.id}"
            ),
        )
        ahead: list[Ask] = []
        for run in ranked:
            ask = Ask(run.team, run.need, run.preemptible)
            teams = self.teams()
            if any(not yields_to(first, ask, teams) for first in ahead):
                ahead.append(ask)
                continue
            others = [Ask(r.team, r.need, r.preemptible) for r in self.waiting if r is not run]
            decision = admit(ask, self.groups(), run.need, teams, others, now)
            if isinstance(decision, Reclaim):
                self.reclaims += 1
                for victim in decision.victims:
                    if victim not in self.held:  # freed with another device of the same run
                        continue
                    loser, borrowed = self.held[victim]
                    assert borrowed and loser.team != run.team
                    for a in [a for a, (r, _) in self.held.items() if r is loser]:
                        del self.held[a]  # its whole run stops and is queued again
                    loser.arrived = now
                    self.waiting.append(loser)
                decision = admit(ask, self.groups(), run.need, self.teams(), others, now)
                assert isinstance(decision, Grant), f"reclaim made no room: {decision}"
            if isinstance(decision, Grant):
                self.take(run, decision, now)
            else:
                ahead.append(ask)
            self.check()


_limits = st.fixed_dictionaries(
    {
        "a": st.builds(
            Team,
            quota=st.integers(1, 2),
            borrowing_limit=st.integers(0, 2),
            lending_limit=st.sampled_from([None, 0, 1]),
        ),
        "b": st.builds(
            Team,
            quota=st.integers(1, 2),
            borrowing_limit=st.integers(0, 2),
            lending_limit=st.sampled_from([None, 0, 1]),
        ),
        "c": st.builds(
            Team,
            quota=st.integers(1, 2),
            borrowing_limit=st.integers(0, 1),
            lending_limit=st.sampled_from([None, 0, 1]),
        ),
    }
)
_runs = st.lists(
    st.tuples(
        st.integers(0, 40),  # arrival step
        st.sampled_from(["a", "a", "b", "c", None]),
        st.integers(1, 2),  # devices at once (capped at the team's quota)
        st.booleans(),  # preemptible
        st.integers(0, 3),  # priority
        st.integers(1, 8),  # steps it runs
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=200, deadline=None)
@given(limits=_limits, runs=_runs, devices=st.integers(2, 4), aging=st.sampled_from([2.0, 5.0]))
@example(  # found in CI (2026-12-06): one reclaim names both devices of a borrowing run
    limits={"a": Team(quota=2), "b": Team(quota=2, borrowing_limit=2), "c": Team(quota=1)},
    runs=[(0, "a", 1, False, 0, 1)] * 22
    + [(8, "b", 1, False, 0, 5), (8, "b", 2, True, 0, 2), (12, "a", 2, False, 0, 1)],
    devices=3,
    aging=2.0,
)
def test_a_host_run_by_the_policy_never_grants_twice_keeps_its_limits_and_serves_everyone(
    limits, runs, devices, aging
):
    host = _Host(devices, limits, aging)
    made = []
    for i, (at, team, need, preemptible, priority, length) in enumerate(runs):
        need = min(need, limits[team].quota if team else 1, devices)
        made.append((at, _Run(i, team, need, preemptible, priority, length)))
    total = sum(r.length for _, r in made)
    horizon = 41 + 2 * total + 10 * len(made) + 20
    for now in range(horizon):
        host.step(now, [r for at, r in made if at == now])
        if now > 40 and not host.waiting and not host.held:
            break
    assert not host.waiting, f"starved: {[(r.team, r.priority, r.need) for r in host.waiting]}"
    assert set(host.served) == {r.id for _, r in made}


def test_aging_and_fair_share_serve_a_low_priority_waiter_under_a_stream_of_high_priority_work():
    """Team a sends a priority-3 task every step, each holding a device for 2 steps, on 2 devices (the
    host always busy, never overloaded); one priority-0 task of team b waits: with aging it starts
    within (3 + 1) x aging steps plus a run; without aging it never does."""
    limits = {"a": Team(quota=2), "b": Team(quota=1)}

    def wait_of_b(aging: float) -> float | None:
        host = _Host(2, limits, aging)
        b = _Run(0, "b", 1, False, 0, 1)
        for now in range(200):
            host.step(now, [_Run(now + 1, "a", 1, False, 3, 2)] + ([b] if now == 3 else []))
        return host.served.get(0)

    assert wait_of_b(0.0) is None, "no aging: the stream starves it"
    waited = wait_of_b(5.0)
    assert waited is not None and waited <= (3 + 1) * 5.0 + 2, waited


def test_a_borrowers_device_goes_back_to_the_team_that_is_owed_it():
    """Team a (quota 1, may borrow 1) fills both devices while b is idle; b arrives; b's task takes
    the borrowed device at once (the simulation has no grace); a's reclaimed task is queued again and
    borrows again once b is done."""
    limits = {"a": Team(quota=1, borrowing_limit=1), "b": Team(quota=1)}
    host = _Host(2, limits, 5.0)
    a1, a2 = _Run(0, "a", 1, True, 0, 20), _Run(1, "a", 1, True, 0, 20)
    host.step(0, [a1, a2])
    assert sorted(b for _, b in host.held.values()) == [False, True]
    b = _Run(2, "b", 1, False, 0, 3)
    host.step(1, [b])
    assert host.reclaims == 1 and host.served[2] == 0
    borrowed = [r for r, bor in host.held.values() if bor]
    assert borrowed == [] and len(host.waiting) == 1 and host.waiting[0].team == "a"
    for now in range(2, 6):
        host.step(now, [])
    assert {r.team: bor for r, bor in host.held.values()} == {"a": True} or len(host.held) == 2
    assert not host.waiting
