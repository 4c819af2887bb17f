"""Sharing a host between teams, the pure decisions of gpu_tasks.policy: whose run preemption stops
(protected run time, least work lost) and who is served next (fair share over time)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_tasks.policy import Holding, choose_victims
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
