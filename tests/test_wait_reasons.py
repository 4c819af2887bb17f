"""Why a task waits (gpu_tasks.devices.wait_reasons): one reason by precedence, said at a bounded rate.

Pure: no process, no server, no clock read (``now`` is an argument).
"""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_tasks.devices import leases
from gpu_tasks.devices.wait_reasons import (
    BOARD_BUSY,
    BOARD_QUEUED,
    Ahead,
    Holder,
    Throttle,
    WaitReason,
    WaitView,
    board_reason,
    why_waiting,
)

NOW = 1_000_000.0
# why_waiting's kinds, by precedence (first wins), as docs/leases.md lists them
KINDS = (
    "borrowing-limit",
    "quota-full",
    "fair-share",
    "queued",
    "protected",
    "device-held",
    "other-programs",
    "starting",
)

_holders = st.lists(
    st.builds(
        Holder,
        address=st.sampled_from(["0", "1", "2"]),
        profile=st.sampled_from(["train", "etl", "mine"]),
        flow_run_name=st.sampled_from([None, "run-a", "run-b"]),
        pid=st.integers(1, 99999),
        local=st.booleans(),
        priority=st.integers(-3, 3),
        preemptible=st.booleans(),
        since=st.one_of(st.none(), st.floats(NOW - 100, NOW)),
        min_run_time=st.sampled_from([0.0, 10.0, 200.0]),
        team=st.sampled_from([None, "team-a", "team-b"]),
        borrowed=st.booleans(),
    ),
    max_size=3,
)
_ahead = st.lists(
    st.builds(
        Ahead,
        profile=st.sampled_from(["a", "b"]),
        flow_run_name=st.sampled_from([None, "run-x"]),
        local=st.booleans(),
        priority=st.integers(-3, 3),
        team=st.sampled_from([None, "team-a", "team-b"]),
        usage=st.floats(0, 1000),
    ),
    max_size=3,
)
_views = st.builds(
    WaitView,
    profile=st.just("mine"),
    priority=st.integers(-3, 3),
    team=st.sampled_from([None, "team-a", "team-b"]),
    usage=st.floats(0, 1000),
    holders=_holders.map(tuple),
    quota_full=st.sampled_from([None, "team-a"]),
    quota_used=st.sampled_from([None, 2]),
    quota_limit=st.sampled_from([None, 2]),
    borrowing=st.sampled_from([None, ("team-a", 2.0, 2.0)]),
    ahead=_ahead.map(tuple),
    programs=st.sampled_from([(), (("1", "4.0 GiB used by pid 7"),)]),
)


def _applies(view: WaitView) -> list[str]:
    """Every kind whose condition holds for ``view`` (the precedence picks the first)."""
    others = [h for h in view.holders if h.profile != view.profile or not h.local]
    kinds = []
    if view.borrowing:
        kinds.append("borrowing-limit")
    if view.quota_full:
        kinds.append("quota-full")
    if view.ahead:
        a = view.ahead[0]
        fair = a.priority == view.priority and a.team not in (None, view.team) and a.usage < view.usage
        kinds.append("fair-share" if fair else "queued")
    if any(
        h.preemptible
        and (h.priority < view.priority or (h.borrowed and view.team is not None and view.team != h.team))
        and (h.protected_until or 0) > NOW
        for h in others
    ):
        kinds.append("protected")
    if others:
        kinds.append("device-held")
    if view.programs:
        kinds.append("other-programs")
    kinds.append("starting")
    return kinds


@settings(max_examples=400, deadline=None)
@given(view=_views)
def test_the_reason_is_the_first_that_applies_by_precedence(view):
    reason = why_waiting(view, NOW)
    assert reason.kind in KINDS
    assert reason.kind == min(_applies(view), key=KINDS.index)
    assert reason.text and json.loads(json.dumps(reason.as_dict()))["kind"] == reason.kind


@settings(max_examples=200, deadline=None)
@given(view=_views)
def test_a_reason_names_what_holds_it(view):
    reason = why_waiting(view, NOW)
    if reason.kind in ("device-held", "protected"):
        assert reason.holder is not None
        assert f"device {reason.holder['address']}" in reason.text
        assert repr(reason.holder["profile"]) in reason.text
    if reason.kind == "protected":
        assert reason.until is not None and reason.until > NOW and "protected run time" in reason.text
    if reason.kind == "quota-full":
        assert repr(view.quota_full) in reason.text
        if view.quota_used is not None and view.quota_limit is not None:
            assert f"{view.quota_used} of {view.quota_limit}" in reason.text
    if reason.kind in ("queued", "fair-share"):
        assert repr(view.ahead[0].profile) in reason.text


def test_device_held_by_another_flow_run_names_run_profile_and_pid():
    holder = Holder("0", profile="train", flow_run_name="busy-otter", pid=4242, priority=0)
    reason = why_waiting(WaitView(profile="mine", holders=(holder,)), NOW)
    assert reason.kind == "device-held"
    assert reason.text == "device 0 is held by profile 'train' of flow run 'busy-otter' (pid 4242)"
    assert reason.holder == {
        "address": "0",
        "profile": "train",
        "flow_run_name": "busy-otter",
        "flow_run_id": None,
        "pid": 4242,
        "user": None,
        "local": False,
        "priority": 0,
    }


def test_a_lock_with_no_details_is_named_as_such():
    reason = why_waiting(WaitView(profile="mine", holders=(Holder("0"),)), NOW)
    assert reason.text == (
        "device 0 is held by a process that left no holder record (fuser -v on the device's lock file "
        "names it)"
    ), reason.text
    # and as gpu-tasks devices and a lease timeout name a holder (they said "pid ?")
    assert leases.describe({}).startswith("a process that left no holder record")


def test_own_devices_are_not_a_holder():
    """A growing profile already holds some of what it wants: that is no reason to wait."""
    mine = Holder("0", profile="mine", local=True)
    assert why_waiting(WaitView(profile="mine", holders=(mine,)), NOW).kind == "starting"


def test_protected_run_time_says_until_when():
    holder = Holder("0", profile="batch", priority=0, preemptible=True, since=NOW - 5, min_run_time=60)
    reason = why_waiting(WaitView(profile="mine", priority=5, holders=(holder,)), NOW)
    assert reason.kind == "protected" and reason.until == NOW + 55 and "(in 55s)" in reason.text
    # past it, or of a priority the waiter cannot preempt: the device is simply held
    assert (
        why_waiting(WaitView(profile="mine", priority=5, holders=(holder,)), NOW + 56).kind == "device-held"
    )
    assert why_waiting(WaitView(profile="mine", priority=0, holders=(holder,)), NOW).kind == "device-held"


def test_borrowed_devices_a_team_owed_them_waits_for_are_protected_until_their_min_run_time_ends():
    """A team owed devices takes back borrowed ones whatever their priority (docs/leases.md,
    "Borrowing"), once their protected run time ends: the wait says so (it said "held")."""
    borrowed = Holder(
        "0", profile="batch", preemptible=True, since=NOW - 5, min_run_time=60, team="team-b", borrowed=True
    )
    reason = why_waiting(WaitView(profile="mine", team="team-a", holders=(borrowed,)), NOW)
    assert reason.kind == "protected" and reason.until == NOW + 55, reason
    assert "borrowed beyond quota 'team-b'" in reason.text and "(in 55s)" in reason.text, reason.text
    # a waiter of no team, or of the borrower's own, takes nothing back: the device is simply held
    for team in (None, "team-b"):
        assert (
            why_waiting(WaitView(profile="mine", team=team, holders=(borrowed,)), NOW).kind == "device-held"
        )


def test_fair_share_needs_equal_priority_another_team_and_less_usage():
    ahead = (Ahead("b", team="team-b", priority=1, usage=10.0),)
    view = WaitView(profile="mine", priority=1, team="team-a", usage=500.0, ahead=ahead)
    reason = why_waiting(view, NOW)
    assert reason.kind == "fair-share" and "team 'team-b'" in reason.text
    assert why_waiting(
        WaitView(profile="mine", priority=0, team="team-a", usage=500.0, ahead=ahead), NOW
    ).kind == ("queued")


def test_quota_and_borrowing_limit_come_first():
    held = (Holder("0", profile="train"),)
    view = WaitView(profile="mine", holders=held, quota_full="team-a", quota_used=2, quota_limit=2)
    reason = why_waiting(view, NOW)
    assert reason.kind == "quota-full" and reason.text == "quota 'team-a' is full (2 of 2 device(s) in use)"
    assert (reason.used, reason.limit) == (2, 2)
    borrowing = WaitView(profile="mine", holders=held, quota_full="team-a", borrowing=("team-a", 1.0, 1.0))
    assert why_waiting(borrowing, NOW).kind == "borrowing-limit"


def test_board_reason():
    entries = [
        {
            "token": "a",
            "profile": "urgent",
            "flow_run_name": "r1",
            "effective_priority": 5,
            "workers": ["w1"],
        },
        {"token": "b", "profile": "slow", "flow_run_name": "r2", "effective_priority": 1, "workers": ["w1"]},
        {"token": "c", "profile": "apart", "flow_run_name": "r3", "effective_priority": 0, "workers": ["w2"]},
    ]
    first, second, apart = (board_reason(e, entries) for e in entries)
    assert first.kind == BOARD_BUSY
    assert second.kind == BOARD_QUEUED and "profile 'urgent' of flow run 'r1'" in second.text
    assert apart.kind == BOARD_BUSY and "w2" in apart.text, "an entry on other workers is not ahead"


def _r(kind: str, who: str = "x") -> WaitReason:
    return WaitReason(kind, f"{kind} {who}", holder={"profile": who})


def test_throttle_first_at_once_same_every_30s_changed_at_once_but_not_within_2s():
    t = Throttle(every=30.0, gap=2.0)
    assert t.due(_r("device-held"), 0.0), "the first at once"
    assert not t.due(_r("device-held"), 29.0), "the same one not before 30 s"
    assert t.due(_r("device-held"), 30.0)
    assert not t.due(_r("quota-full"), 31.0), "a changed one not within 2 s of the last line"
    assert t.due(_r("quota-full"), 32.0), "then as soon as the gap has passed"
    assert t.due(_r("quota-full", "y"), 34.5), "another holder is a change"
    assert not t.due(_r("quota-full", "y"), 40.0)


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.floats(0.0, 40.0), st.sampled_from(["device-held", "queued", "quota-full"])), max_size=30
    )
)
def test_throttle_never_says_two_lines_within_the_gap_nor_the_same_within_every(steps):
    t, now, said = Throttle(every=30.0, gap=2.0), 0.0, []
    for dt, kind in steps:
        now += dt
        if t.due(_r(kind), now):
            said.append((now, kind))
    for (t0, k0), (t1, k1) in zip(said, said[1:], strict=False):
        assert t1 - t0 >= 2.0
        if k0 == k1:
            assert t1 - t0 >= 30.0
    if steps:
        assert said and said[0][0] == steps[0][0], "the first is said at once"
