"""Borrowing and reclaim, end to end on 2 emulated devices against the session's real Prefect server:
teams a and b have quotas of 1 device each; a may borrow 1. Team a's preemptible profile runs two
long tasks while b is idle (one within its quota, one on a borrowed device); b's task arrives; after
the preemption grace the borrowed device is reclaimed: a's task on it is stopped, its Prefect state and
log say "reclaimed by <team b>", it runs again later, and b's task starts within the grace plus a few
seconds."""

from __future__ import annotations

import json
import random
import time

import pytest
from prefect import flow, task
from prefect_api import api, run_logs
from test_preemption import _state_names

from gpu_tasks import ProfileTaskRunner, ResourceProfile, profile
from gpu_tasks.devices import leases
from gpu_tasks.prefect_api import quotas

GRACE = 1.0
LONG_S = 60.0  # a's first runs hold their devices until b is done, never this long
STARTS_WITHIN = GRACE + 8.0  # b's task starts this soon after it is submitted (a worker starts, too)


@pytest.fixture
def teams(prefect_server):
    tag = random.randrange(10**6)
    a, b = f"team-a-{tag}", f"team-b-{tag}"
    quotas.set_limit(a, 1)
    quotas.set_sharing(a, borrowing_limit=1)
    quotas.set_limit(b, 1)
    yield a, b
    quotas.delete_limit(a)
    quotas.delete_limit(b)


@pytest.mark.usefixtures("no_leaked_processes")
def test_a_borrowed_device_is_reclaimed_for_the_team_owed_it(teams, tmp_path, lease_dir, monkeypatch):
    team_a, team_b = teams
    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "2")
    monkeypatch.setenv("GPU_TASKS_TUNE_PREEMPTION_GRACE", str(GRACE))
    monkeypatch.delenv("GPU_TASKS_PROFILES_FILE", raising=False)
    starts = tmp_path / "starts"
    starts.mkdir()

    @task
    def work(name: str) -> dict:
        again = list(starts.glob(f"{name}-*"))
        at = time.time()
        (starts / f"{name}-{len(again)}").write_text(
            json.dumps({"at": at, "leases": leases.holders(lease_dir)})
        )
        if again or name.startswith("b"):
            time.sleep(0.3)
        while not again and name.startswith("a") and not (starts / "b-done").exists():
            assert time.time() - at < LONG_S, "not reclaimed: a's task held its device to the end"
            time.sleep(0.05)  # a's first runs hold their devices until b is done (or reclaim stops one)
        if name.startswith("b"):
            (starts / "b-done").touch()
        return {"name": name, "start": at, "end": time.time()}

    batch = ResourceProfile(
        name="a-batch", gpus=1, max_workers=2, preemptible=True, quota=team_a, idle_timeout=30
    )
    train = ResourceProfile(name="b-train", gpus=1, quota=team_b, idle_timeout=0)
    cpu = ResourceProfile(name="cpu", cpus=0.5)

    @flow(task_runner=ProfileTaskRunner(profiles=[cpu, batch, train], default="cpu"))
    def shared():
        from prefect.context import FlowRunContext

        a = [work.with_options(tags=[profile("a-batch")]).submit(f"a{i}") for i in range(2)]
        deadline = time.monotonic() + 60
        while len(list(starts.glob("a*-0"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        held = leases.holders(lease_dir)
        submitted = time.time()
        b = work.with_options(tags=[profile("b-train")]).submit("b")
        b.wait()
        return {
            "run": str(FlowRunContext.get().flow_run.id),
            "held": held,
            "submitted": submitted,
            "b": b.result(),
            "a": [f.result() for f in a],
            "a_ids": [str(f.task_run_id) for f in a],
        }

    started = time.monotonic()
    out = shared()
    print(
        f"flow took {time.monotonic() - started:.1f}s; b started {out['b']['start'] - out['submitted']:.2f}s "
        f"after it was submitted (grace {GRACE:g}s)"
    )
    # while b was idle, team a held both devices: one within its quota, one borrowed
    held = out["held"]
    assert sorted(bool(h.get("borrowed")) for h in held.values() if h) == [False, True], held
    [borrowed] = [a for a, h in held.items() if h and h.get("borrowed")]
    assert held[borrowed]["quota"] == team_a and held[borrowed]["profile"] == "a-batch"
    # b started within the grace plus a few seconds, on the borrowed device, within its own quota
    assert out["b"]["start"] - out["submitted"] <= STARTS_WITHIN
    b_saw = json.loads((starts / "b-0").read_text())["leases"]
    assert b_saw[borrowed]["profile"] == "b-train" and not b_saw[borrowed].get("borrowed")
    assert b_saw[borrowed]["quota"] == team_b
    # exactly one of a's tasks was reclaimed (Preempted, then Completed), and its state says by whom
    reclaimed = []
    for task_run_id in out["a_ids"]:
        names = _state_names(task_run_id)  # polls until the server recorded the final state
        status, states = api("GET", "/task_run_states/", params={"task_run_id": task_run_id})
        assert status == 200
        assert names[-1] == "Completed", names
        if "Preempted" in names:
            [state] = [s for s in states if s["name"] == "Preempted"]
            reclaimed.append(state["message"])
    assert len(reclaimed) == 1 and f"reclaimed by {team_b}" in reclaimed[0], reclaimed
    assert sorted(r["name"] for r in out["a"]) == ["a0", "a1"]
    assert len(list(starts.glob("a*-1"))) == 1, "the reclaimed task ran again"
    # its run log says so
    assert run_logs(out["run"], f"reclaimed by {team_b}")
    # and nothing is left borrowed
    assert [q["borrowed"] for q in quotas.usage() if q["quota"] == team_a] == [0]


def test_the_cli_sets_and_shows_borrowing_and_lending_limits(prefect_server):
    from typer.testing import CliRunner

    from gpu_tasks.cli import app

    name = f"lender-{random.randrange(10**6)}"

    def cli(*args: str) -> tuple[int, str]:
        result = CliRunner().invoke(app, list(args))
        return result.exit_code, result.output

    try:
        code, out = cli("quotas", "set", name, "2", "--borrowing-limit", "1", "--lending-limit", "1")
        assert code == 0 and "borrows at most 1 device(s)" in out and "lends at most 1" in out, out
        code, out = cli("quotas", "--json")
        [row] = [q for q in json.loads(out)["quotas"] if q["quota"] == name]
        assert (row["limit"], row["borrowing_limit"], row["borrowed"], row["lending_limit"]) == (2, 1, 0, 1)
        code, out = cli("quotas", "set", name, "2", "--lending-limit", "0")
        assert code == 0, out
        code, out = cli("quotas")
        [line] = [line for line in out.splitlines() if name in line]
        assert " none " in line and "<= 0" not in line, line  # lends nothing (was "<= 0")
        code, out = cli("quotas", "set", name, "2", "--lending-limit", "-1")  # lends all again
        assert code == 0 and "lends all of its unused quota (" in out, out
        [row] = [q for q in quotas.usage() if q["quota"] == name]
        assert row["lending_limit"] is None and row["borrowing_limit"] == 1
        code, out = cli("quotas")
        assert code == 0 and "Borrowed" in out and "0 of 1" in out, out
        assert cli("quotas", "set", name, "2", "--borrowing-limit", "-1")[0] == 2
    finally:
        quotas.delete_limit(name)
    assert not [n for n in (quotas.borrow_name(name), quotas.lend_name(name)) if n in _limit_names()]


def _limit_names() -> set[str]:
    from gpu_tasks.prefect_api.quotas import all_limits

    return {limit.name for limit in all_limits()}


def test_a_waiter_at_its_teams_borrowing_limit_says_so(teams):
    from gpu_tasks.devices import lending, wait_reasons

    a, _ = teams
    me = {"profile": "a-gpu", "quota": a, "preemptible": True}
    assert lending.at_borrowing_limit(me) is None  # nothing borrowed yet: the limit has room
    slots = quotas.QuotaSlots(lease_seconds=30)
    try:
        assert slots.borrow(a, 1) is not None
        assert lending.at_borrowing_limit({**me, "preemptible": False}) is None  # may never borrow anyway
        got = lending.at_borrowing_limit(me)
        assert got is None or got == (a, 1.0, 1.0)  # None only while a 1 s old read of the teams serves
        time.sleep(lending.TEAMS_FRESH_S + 0.1)
        assert lending.at_borrowing_limit(me) == (a, 1.0, 1.0)
        view = wait_reasons.WaitView(
            profile="a-gpu", priority=0, team=a, quota_full=a, borrowing=(a, 1.0, 1.0)
        )
        reason = wait_reasons.why_waiting(view, time.time())
        assert reason.kind == "borrowing-limit" and "borrowing limit is 1" in reason.text, reason
    finally:
        slots.close()
