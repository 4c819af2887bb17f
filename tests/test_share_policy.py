"""Sharing a host between teams, the pure decisions of gpu_tasks.policy: whose run preemption stops
(protected run time, least work lost) and who is served next (fair share over time)."""

from __future__ import annotations

import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_tasks.devices import fair_share, leases
from gpu_tasks.policy import Holding, aged_priority, choose_victims, decayed_usage, waiter_rank
from gpu_tasks.preemption import choose, plan

NOW = 10_000.0


def _holding(
    preemptible: bool = True, priority: int = 0, ran: float = 100.0, protect: float = 0.0
) -> Holding:
    return Holding(preemptible=preemptible, priority=priority, since=NOW - ran, min_run_time=protect)


def _single(*holders: Holding | None) -> list[list[tuple[str, Holding | None]]]:
    return [[(str(i), h)] for i, h in enumerate(holders)]


# ------------------------------------------------------------------ protected run time
def test_a_run_inside_its_protection_is_not_taken_and_the_waiter_learns_until_when():
    protected = _holding(ran=10, protect=60)
    choice = choose_victims(_single(protected), need=1, priority=5, now=NOW)
    assert choice.devices == () and choice.protected == ("0",)
    assert choice.protected_until == NOW + 50
    # once it has run its time, it is taken
    assert choose_victims(_single(protected), 1, 5, NOW + 50).devices == ("0",)


def test_the_run_past_its_protection_goes_first_then_the_one_that_lost_least():
    young = _holding(ran=10, protect=60)  # protected
    old = _holding(ran=3600, protect=60)
    middle = _holding(ran=120, protect=60)
    assert choose_victims(_single(young, old, middle), 1, 5, NOW).devices == ("2",)
    assert choose_victims(_single(young, old), 1, 5, NOW).devices == ("1",)
    # two needed, one past its protection: wait for the other rather than take half
    choice = choose_victims(_single(young, old), 2, 5, NOW)
    assert choice.devices == () and choice.protected_until == NOW + 50


def test_free_devices_cost_nothing_and_protection_never_touches_other_rules():
    assert choose_victims(_single(_holding(ran=1), None), 1, 5, NOW).devices == ()  # free device 1
    steady = _holding(preemptible=False, ran=1)
    assert choose_victims(_single(steady), 1, 5, NOW) == choose_victims(_single(), 1, 5, NOW)
    assert choose_victims(_single(_holding(priority=5)), 1, 5, NOW).devices == ()


def test_the_waiter_file_and_lease_info_carry_it():
    """gpu_tasks.preemption reads a holder's lease info: since, min_run_time."""
    waiter = {"priority": 5, "groups": [["0"], ["1"]], "need": 1, "arrived": 0.0}
    holders = {
        "0": {"preemptible": True, "priority": 0, "since": NOW - 5, "min_run_time": 30},
        "1": {"preemptible": True, "priority": 0, "since": NOW - 40, "min_run_time": 30},
    }
    assert plan(waiter, holders.get, NOW) == ["1"]
    holders["1"]["since"] = NOW - 20
    choice = choose(waiter, holders.get, NOW)
    assert choice.devices == () and choice.protected_until == NOW + 10  # device 1's ends first
    # old holders (no since, no min_run_time): the fewest devices, as before
    assert plan(waiter, {"0": {"preemptible": True}, "1": None}.get, NOW) == []


_holdings = st.one_of(
    st.none(),
    st.builds(
        Holding,
        preemptible=st.booleans(),
        priority=st.integers(0, 6),
        since=st.floats(NOW - 500, NOW + 10),
        min_run_time=st.sampled_from([0.0, 30.0, 120.0]),
    ),
)


@settings(max_examples=400, deadline=None)
@given(
    groups=st.lists(st.lists(_holdings, min_size=1, max_size=3), min_size=1, max_size=5),
    need=st.integers(1, 3),
    priority=st.integers(0, 6),
)
def test_never_a_victim_inside_its_protection_and_never_more_work_lost_than_needed(groups, need, priority):
    named = [[(f"{g}.{i}", h) for i, h in enumerate(group)] for g, group in enumerate(groups)]
    by_address = {a: h for group in named for a, h in group}
    choice = choose_victims(named, need, priority, NOW)
    for address in choice.devices:
        h = by_address[address]
        assert h is not None and h.preemptible and h.priority < priority
        until = h.protected_until()
        assert until is None or until <= NOW, "a victim inside its protected run time"

    def cost(group):
        held = [h for _, h in group if h is not None]
        if any(not h.preemptible or h.priority >= priority for h in held):
            return None
        if any((u := h.protected_until()) is not None and u > NOW for h in held):
            return None
        return sum(h.lost_work(NOW) for h in held)

    eligible = sorted(c for c in map(cost, named) if c is not None)
    if len(eligible) < need:
        assert choice.devices == ()
        return
    lost = sum(by_address[a].lost_work(NOW) for a in choice.devices)  # type: ignore[union-attr]
    assert lost <= sum(eligible[:need]) + 1e-6, "another choice loses less work"
    assert choice.protected_until is None


# ------------------------------------------------------------------ fair share over time
def test_usage_halves_every_half_life_and_is_nothing_when_off():
    assert decayed_usage(100.0, at=NOW, now=NOW + 3600, half_life=3600) == 50.0
    assert decayed_usage(100.0, at=NOW, now=NOW + 7200, half_life=3600) == 25.0
    assert decayed_usage(100.0, at=NOW, now=NOW - 5, half_life=3600) == 100.0  # a clock step back
    assert decayed_usage(100.0, at=NOW, now=NOW, half_life=0) == 0.0


_waiters = st.lists(
    st.tuples(st.integers(0, 3), st.floats(0, 5000), st.floats(NOW - 600, NOW)), min_size=2, max_size=8
)


@settings(max_examples=300, deadline=None)
@given(waiters=_waiters)
def test_equal_priority_waiters_are_served_least_usage_first_then_by_arrival(waiters):
    order = sorted(waiters, key=lambda w: waiter_rank(w[0], 0.0, w[2], NOW, usage=w[1]))
    for (p1, u1, a1), (p2, u2, a2) in zip(order, order[1:], strict=False):
        assert p1 >= p2
        if p1 == p2:
            assert u1 <= u2 and (u1 < u2 or a1 <= a2)


@settings(max_examples=300, deadline=None)
@given(
    priority=st.integers(0, 5),
    usage=st.floats(0, 1e7),
    newcomer=st.integers(0, 10),
    aging=st.sampled_from([1.0, 30.0, 60.0]),
    later=st.floats(0, 3600),
)
def test_aging_still_prevents_starvation_whatever_the_usage(priority, usage, newcomer, aging, later):
    """A waiter of the heaviest team is never passed by a newcomer of no usage that arrives
    ``(p_new - p + 1) * aging`` seconds or more after it: by then it has earned one step more."""
    arrived = NOW - 10_000.0
    new_arrived = arrived + max(0, newcomer - priority + 1) * aging + later
    now = new_arrived + later
    old = waiter_rank(priority, aging, arrived, now, usage=usage, name="a")
    new = waiter_rank(newcomer, aging, new_arrived, now, usage=0.0, name="b")
    assert aged_priority(priority, aging, now - arrived) > aged_priority(newcomer, aging, now - new_arrived)
    assert old < new


def test_leases_rank_uses_the_team_of_each_waiter(tmp_path):
    early = {"priority": 1, "arrived": NOW - 60, "quota": "heavy", "file": "a"}
    late = {"priority": 1, "arrived": NOW, "quota": "light", "file": "b"}
    none = {"priority": 1, "arrived": NOW - 1, "file": "c"}  # no team: no usage
    usage = {"heavy": 500.0, "light": 2.0}
    assert sorted([early, late, none], key=lambda w: leases.rank(w, NOW, usage)) == [none, late, early]
    assert sorted([early, late, none], key=lambda w: leases.rank(w, NOW)) == [early, none, late]
    assert leases.rank(dict(early, priority=2), NOW, usage) < leases.rank(late, NOW, usage)


def test_the_usage_file_adds_up_under_its_lock_and_survives_a_reread(tmp_path):
    lease_dir = tmp_path / "leases"
    fair_share.add(lease_dir, {"a": 10.0, "b": 0.0, "": 5.0}, now=NOW, half_life=100)
    assert fair_share.read(lease_dir, now=NOW + 100, half_life=100) == {"a": 5.0}
    fair_share.add(lease_dir, {"a": 5.0}, now=NOW + 100, half_life=100)
    assert fair_share.read(lease_dir, now=NOW + 100, half_life=100) == {"a": 10.0}
    assert fair_share.read(lease_dir, now=NOW, half_life=0) == {}, "off: nothing counts"
    assert fair_share.shares({"a": 3.0, "b": 1.0}) == {"a": 0.75, "b": 0.25}

    def many():
        for _ in range(50):  # each its own open file: flock keeps the threads apart as it does processes
            fair_share.add(lease_dir, {"c": 1.0}, now=NOW, half_life=1e12)

    threads = [threading.Thread(target=many) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert round(fair_share.read(lease_dir, now=NOW, half_life=1e12)["c"], 6) == 200.0
