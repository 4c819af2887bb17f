"""Priority per flow run (GPU_TASKS_PRIORITY) and fairness with aging (GPU_TASKS_TUNE_PRIORITY_AGING).

Every test has its own lease directory (the ``lease_dir`` fixture, passed to its
subprocesses), so queues are never shared with another test.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prefect_api import flow_run_events
from test_lease_queue import _until
from test_leases import _env, _stop, _wait_for
from typer.testing import CliRunner

from gpu_tasks import ResourceProfile
from gpu_tasks.cli import app
from gpu_tasks.cluster.local import run_priority
from gpu_tasks.devices import leases
from gpu_tasks.settings import get_settings

# Waiters for emulated device 0 arriving one every EVERY seconds, each through its own
# DeviceBook (its own waiter file and lease), in one process: they queue like separate flow
# runs. Each holds the device HOLD seconds; the rows say when each arrived and got it.
STREAM = textwrap.dedent(
    """
    import json, sys, threading, time
    from pathlib import Path
    from gpu_tasks.devices.book import DeviceBook
    from gpu_tasks.devices.discovery import Device

    lease_dir, out, go, prefix, priority, n, every, hold, delay = sys.argv[1:10]
    DEV0 = [(Device(address="0", index=0, name="EMU"),)]
    rows, lock = [], threading.Lock()

    def wait(name):
        book = DeviceBook(lease_dir=Path(lease_dir), lease_timeout=120)  # aging: the env's setting
        arrived = time.time()
        assert book.acquire(name, DEV0, 1, block=True, priority=int(priority)) == [0]
        got = time.time()
        time.sleep(float(hold))
        released = time.time()
        book.release(name, ["0"])
        with lock:
            rows.append({"name": name, "arrived": arrived, "got": got, "released": released})

    Path(out).with_suffix(".ready").write_text("ready")
    deadline = time.monotonic() + 60
    while not Path(go).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(float(delay))
    threads = []
    for i in range(int(n)):
        threads.append(threading.Thread(target=wait, args=(f"{prefix}{i:02d}",)))
        threads[-1].start()
        time.sleep(float(every))
    for t in threads:
        t.join()
    Path(out).write_text(json.dumps(rows))
    """
)

# A flow run whose GPU profile 'train' (priority 3) holds emulated device 0 until GO exists.
HOLDING_RUN = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from prefect import flow, task
    from prefect.runtime import flow_run
    from gpu_tasks import ProfileTaskRunner, ResourceProfile, profile

    OUT, GO = Path(sys.argv[1]), Path(sys.argv[2])

    @task(tags=[profile("train")])
    def hold():
        OUT.with_suffix(".held").write_text("held")
        deadline = time.monotonic() + 60
        while not GO.exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    TRAIN = ResourceProfile(name="train", gpus=1, priority=3, idle_timeout=0.5)

    @flow(task_runner=ProfileTaskRunner(profiles=[TRAIN]))
    def prioritized():
        hold.submit().result()
        return str(flow_run.get_id())

    if __name__ == "__main__":
        OUT.write_text(json.dumps({"flow_run_id": prioritized()}))
    """
)


def _script(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    return str(path)


# ------------------------------------------------------------------ pure: the rule
def test_effective_priority_grows_by_one_per_full_aging_period():
    w = {"priority": 2, "arrived": 100.0, "aging": 10.0}
    assert [leases.effective_priority(w, now) for now in (99.0, 100.0, 109.9, 110.0, 135.0)] == [
        2,
        2,
        2,
        3,
        5,
    ]
    assert leases.effective_priority(dict(w, aging=0.0), 1000.0) == 2, "aging 0: no aging"
    assert leases.effective_priority({"priority": 2, "arrived": 100.0}, 1000.0) == 2, "no aging field"
    assert leases.effective_priority({"priority": 1}, 1000.0) == 1, "no arrival: nothing waited"


def test_an_aged_waiter_ranks_before_a_newer_higher_priority_one():
    low = {"priority": 0, "arrived": 100.0, "aging": 60.0, "file": "b.json", "addresses": ["0"]}
    high = {"priority": 1, "arrived": 130.0, "aging": 60.0, "file": "a.json", "addresses": ["0"]}
    assert leases.ahead(low, [high], ["0"], now=159.0) == [high], "low is still at 0, high at 1"
    assert leases.ahead(low, [high], ["0"], now=160.0) == [], "low aged to 1 and arrived first"
    assert leases.ahead(high, [low], ["0"], now=160.0) == [low]
    assert leases.ahead(low, [dict(high, aging=0)], ["0"], now=10_000.0) == [], "high does not age"
    assert leases.ahead(dict(low, aging=0), [dict(high, aging=0)], ["0"], now=10_000.0) != [], (
        "without aging a low-priority waiter waits behind every higher-priority one"
    )


arrivals = st.lists(st.floats(0, 1000, allow_nan=False), min_size=2, max_size=8)


@given(arrivals, st.sampled_from([0.0, 0.5, 1.0, 7.0, 60.0]), st.floats(0, 5000), st.integers(-3, 3))
def test_aging_keeps_one_priority_first_come_first_served(arrived, aging, later, priority):
    now = max(arrived) + later
    waiters = [
        {"priority": priority, "arrived": a, "aging": aging, "file": f"{i:02d}.json"}
        for i, a in enumerate(arrived)
    ]
    ranked = sorted(waiters, key=lambda w: leases.rank(w, now))
    assert [w["arrived"] for w in ranked] == sorted(arrived)


@given(
    st.floats(1.7e9, 1.8e9),  # time.time() values: float rounding is ~1e-7 s here
    st.integers(1, 5),
    st.sampled_from([0.5, 1.0, 60.0]),
    st.floats(1e-3, 1000),
    st.floats(0, 5000),
)
def test_no_later_arrival_overtakes_an_aged_waiter(t0, gap, aging, extra, after):
    """A waiter is never overtaken by one that arrives (priority gap x aging) seconds after it, or
    later (by a millisecond: at the exact boundary float rounding may decide)."""
    low = {"priority": 0, "arrived": t0, "aging": aging, "file": "z.json"}
    high = {"priority": gap, "arrived": t0 + gap * aging + extra, "aging": aging, "file": "a.json"}
    now = high["arrived"] + after
    assert leases.rank(low, now) < leases.rank(high, now)


def test_gpu_tasks_priority_replaces_every_profiles_priority(monkeypatch):
    train = ResourceProfile(name="train", gpus=1, priority=3)
    monkeypatch.delenv("GPU_TASKS_PRIORITY", raising=False)
    assert run_priority(train) == 3
    monkeypatch.setenv("GPU_TASKS_PRIORITY", "-2")
    assert run_priority(train) == -2 and run_priority(train, get_settings()) == -2
    monkeypatch.setenv("GPU_TASKS_TUNE_PRIORITY_AGING", "-1")
    with pytest.raises(ValueError, match="GPU_TASKS_TUNE_PRIORITY_AGING='-1'"):
        get_settings()


# ------------------------------------------------------------------ across processes
def _stream(tmp_path, lease_dir, env, name, priority, n, every, hold, delay=0.0):
    out = tmp_path / f"{name}.json"
    args = [str(lease_dir), str(out), str(tmp_path / "go"), name, str(priority), str(n), str(every)]
    proc = subprocess.Popen(
        [sys.executable, _script(tmp_path, "stream", STREAM), *args, str(hold), str(delay)], env=env
    )
    return proc, out


def _race(tmp_path, lease_dir, env, streams, until_queued):
    """Hold device 0 while the ``streams`` (:data:`STREAM` arguments) start and queue, then let it go.

    ``until_queued(procs)`` waits for the queue to fill before the release; returns the streams'
    rows and what ``until_queued`` returned.
    """
    holder = leases.take(["0"], leases.owner_info("holder"), lease_dir)
    assert holder is not None
    started = [_stream(tmp_path, lease_dir, env, *args) for args in streams]
    procs = tuple(proc for proc, _ in started)
    try:
        for proc, out in started:
            _wait_for(out.with_suffix(".ready"), proc)
        (tmp_path / "go").write_text("go")
        seen = until_queued(procs)
        leases.release(holder)
        rows = []
        for proc, out in started:
            assert proc.wait(timeout=120) == 0
            rows.extend(json.loads(out.read_text()))
        return rows, seen
    finally:
        leases.release(holder)
        for proc in procs:
            _stop(proc)


@pytest.mark.parametrize("aging", [1.0, 0.0], ids=["aging-1s", "aging-off"])
def test_a_stream_of_higher_priority_waiters_does_not_starve_a_low_one(tmp_path, lease_dir, aging):
    """One device; 'low' (priority 0) queues first, then a waiter of priority 1 arrives every
    0.25 s for 3 s, faster than the device serves them (0.3 s each, plus up to 0.5 s to notice).

    With aging (1 s per step) 'low' reaches 1 after 1 s: high waiters that arrive later than
    that rank after it, so it gets the device behind the few that arrived before. Without
    aging every high waiter goes first, however late it came.
    """

    def low_queued_then_a_high_one(procs):
        (queued,) = _until(
            lambda: [w for w in leases.waiters(lease_dir) if w["profile"] == "low00"],
            "'low' queued",
            procs=procs,
        )
        _until(lambda: len(leases.waiters(lease_dir)) >= 2, "a high-priority waiter queued", procs=procs)
        return queued

    env = _env(lease_dir, GPU_TASKS_TUNE_PRIORITY_AGING=str(aging))
    streams = [("low", 0, 1, 0, 0.3), ("high", 1, 12, 0.25, 0.3, 0.3)]
    rows, queued = _race(tmp_path, lease_dir, env, streams, low_queued_then_a_high_one)
    assert queued["aging"] == aging, "the waiter file carries its aging"
    t0 = queued["arrived"]
    (me,) = [r for r in rows if r["name"] == "low00"]
    highs = sorted((r for r in rows if r["name"] != "low00"), key=lambda r: r["arrived"])
    before = [r["name"] for r in highs if r["got"] < me["got"]]
    assert before, "high-priority waiters went first"
    for a, b in zip(highs, highs[1:], strict=False):
        assert a["got"] < b["got"] and a["released"] <= b["got"], (
            "highs first-come-first-served, one at a time"
        )
    assert all(r["arrived"] > t0 for r in highs), "'low' was first in the queue"
    late = [r for r in highs if r["arrived"] >= t0 + 1 * aging + 0.1]
    assert late, f"the stream kept arriving after 'low' aged: {highs}"
    if aging:
        # the rule: nobody arriving (gap x aging) or more after 'low' ranks before it
        assert all(r["got"] > me["got"] for r in late), (t0, me, highs)
        assert me["got"] - t0 < 30, "served within a bounded time"
    else:
        assert before == [r["name"] for r in highs], "without aging every higher-priority waiter overtakes"
        assert me["got"] >= max(r["released"] for r in highs)
    assert leases.waiters(lease_dir) == []


def test_equal_priorities_are_served_in_arrival_order_with_aging(tmp_path, lease_dir):
    """Two processes' waiters of one priority, interleaved, with a fast aging (0.3 s): aging never
    reorders them; the device goes by arrival."""
    env = _env(lease_dir, GPU_TASKS_TUNE_PRIORITY_AGING="0.3")
    streams = [("a", 2, 4, 0.3, 0.2), ("b", 2, 4, 0.3, 0.2, 0.15)]
    rows, _ = _race(
        tmp_path,
        lease_dir,
        env,
        streams,
        lambda procs: _until(
            lambda: len(leases.waiters(lease_dir)) >= 3, "three waiters queued", procs=procs
        ),
    )
    by_arrival = [r["name"] for r in sorted(rows, key=lambda r: r["arrived"])]
    by_service = [r["name"] for r in sorted(rows, key=lambda r: r["got"])]
    assert {n[0] for n in by_arrival[:2]} == {"a", "b"}, "the two processes interleave"
    assert by_service == by_arrival
    assert leases.waiters(lease_dir) == []


# ------------------------------------------------------------------ a flow run, Prefect, the CLI
@pytest.mark.usefixtures("prefect_server")
def test_gpu_tasks_priority_is_what_a_flow_run_holds_devices_at(tmp_path, lease_dir, monkeypatch):
    """GPU_TASKS_PRIORITY=10 in a flow run's process replaces profile 'train''s priority 3: in its
    lease (gpu-tasks devices), and in its cluster and summary events; the queue shows too."""
    out, go = tmp_path / "run.json", tmp_path / "go"
    env = _env(lease_dir, GPU_TASKS_PRIORITY="10", GPU_TASKS_IDLE_TIMEOUT="0.5")
    proc = subprocess.Popen(
        [sys.executable, _script(tmp_path, "holding_run", HOLDING_RUN), str(out), str(go)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "1")
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "250")
    waiter = None
    try:
        _until(out.with_suffix(".held").exists, "the flow run holds device 0", seconds=120, procs=(proc,))
        info = dict(leases.owner_info("etl"), flow_run_name="queued-run")
        waiter = leases.enqueue(["0"], info, priority=2, arrived=time.time() - 1.2, aging=0.5)
        data = json.loads(CliRunner().invoke(app, ["devices", "--json"]).stdout)
        (device,) = data["devices"]
        assert device["held_by"]["profile"] == "train" and device["held_by"]["priority"] == 10
        (queued,) = data["waiters"]
        assert queued["profile"] == "etl" and queued["flow_run_name"] == "queued-run"
        assert queued["priority"] == 2 and queued["aging"] == 0.5 and queued["waited_s"] >= 1.2
        assert 4 <= queued["effective_priority"] <= 3 + queued["waited_s"] / 0.5, "2 + one per 0.5 s"
        table = CliRunner().invoke(app, ["devices"]).stdout
        assert "profile 'train' (priority 10), flow run" in table, table
        assert "Waiting for devices" in table and "queued-run" in table and "etl" in table, table
        leases.dequeue(waiter)
        go.write_text("go")
        stdout, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, stdout[-3000:]
    finally:
        leases.dequeue(waiter)
        _stop(proc)
    run_id = json.loads(out.read_text())["flow_run_id"]
    wanted = ("gpu-tasks.cluster.provisioned", "gpu-tasks.cluster.closed", "gpu-tasks.flow-run.summary")
    events = {e["event"]: e for e in flow_run_events(run_id, {"name": list(wanted)}, at_least=3)}
    assert set(events) == set(wanted), list(events)
    for what in wanted[:2]:
        assert events[what]["resource"]["gpu-tasks.priority"] == "10", events[what]["resource"]
        assert events[what]["payload"]["priority"] == 10
        assert events[what]["resource"]["prefect.resource.name"].startswith("train on GPU 0 (emulated): ")
    summary = events["gpu-tasks.flow-run.summary"]
    assert summary["resource"]["gpu-tasks.priority"] == "10"
    assert summary["resource"]["gpu-tasks.priorities"] == "train=10"
    assert summary["payload"]["priority"] == 10 and summary["payload"]["priorities"] == {"train": 10}
