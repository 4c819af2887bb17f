"""Queued waiting for devices: priorities and first-come-first-served, across and within processes.

Every test sets GPU_TASKS_LEASE_DIR to its own tmp_path (the ``lease_dir`` fixture, or
the subprocess environment), so queues are never shared with another test.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
from test_leases import _env, _stop, _wait_for

from gpu_tasks import ClusterError, ProfileTaskRunner, ResourceProfile, current_allocation, profile
from gpu_tasks.devices import leases
from gpu_tasks.devices.book import DeviceBook
from gpu_tasks.devices.discovery import Device

DEV0 = (Device(address="0", index=0, name="EMU"),)

DEAD_WAITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from gpu_tasks.devices import leases

    lease_dir, ready = sys.argv[1:3]
    waiter = leases.enqueue(["0"], leases.owner_info("doomed"), priority=3, lease_dir=lease_dir)
    Path(ready).write_text(waiter.name)
    time.sleep(120)
    """
)

# Leases device 0 until the file ``go`` appears.
HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from gpu_tasks.devices import leases

    lease_dir, ready, go = sys.argv[1:4]
    lease = leases.take(["0"], leases.owner_info("holder"), lease_dir)
    assert lease is not None
    Path(ready).write_text("held")
    deadline = time.monotonic() + 60
    while not Path(go).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    leases.release(lease)
    """
)

# Waits (queued, with a priority) for device 0 through a DeviceBook, holds it 0.5 s, records when.
WAITER = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from gpu_tasks.devices.book import DeviceBook
    from gpu_tasks.devices.discovery import Device

    lease_dir, name, priority, out = sys.argv[1:5]
    book = DeviceBook(lease_dir=Path(lease_dir), lease_timeout=60)
    assert book.acquire(name, [(Device(address="0", index=0, name="EMU"),)], 1, block=True,
                        priority=int(priority)) == [0]
    got = time.time()
    time.sleep(0.5)
    released = time.time()
    book.release(name, ["0"])
    Path(out).write_text(json.dumps({"got": got, "released": released}))
    """
)

STRESS = textwrap.dedent(
    """
    import json, os, random, sys, time
    from pathlib import Path
    from prefect import flow, task
    from gpu_tasks import ProfileTaskRunner, ResourceProfile, current_allocation, profile

    OUT, N = Path(sys.argv[1]), int(sys.argv[2])

    @task(tags=[profile("gpu")])
    def work(seconds):
        start = time.time()
        time.sleep(seconds)
        device = current_allocation().devices[0]
        return {"pid": os.getpid(), "device": device, "start": start, "end": time.time()}

    GPU = ResourceProfile(name="gpu", gpus=1, idle_timeout=0.2)

    @flow(task_runner=ProfileTaskRunner(profiles=[GPU]))
    def stress(n):
        rng = random.Random(os.getpid())
        return [f.result() for f in work.map([rng.uniform(0.005, 0.05) for _ in range(n)])]

    if __name__ == "__main__":
        OUT.write_text(json.dumps({"run": os.getpid(), "rows": stress(N)}))
    """
)


def _script(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    return str(path)


def _until(predicate, what: str, seconds: float = 30.0, procs: tuple[subprocess.Popen, ...] = ()):
    deadline = time.monotonic() + seconds
    while not (value := predicate()):
        assert all(p.poll() is None for p in procs), f"a helper process exited early (waiting for {what})"
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.02)
    return value


# ------------------------------------------------------------------ unit
def test_rank_orders_by_priority_then_arrival_then_file():
    a = {"priority": 0, "arrived": 1.0, "file": "b.json", "addresses": ["0"]}
    b = {"priority": 5, "arrived": 9.0, "file": "z.json", "addresses": ["0", "1"]}
    c = {"priority": 0, "arrived": 1.0, "file": "a.json", "addresses": ["1"]}
    d = {"priority": 0, "arrived": 2.0, "file": "0.json", "addresses": ["0"]}
    assert sorted([a, b, c, d], key=leases.rank) == [b, c, a, d]
    unregistered = {"priority": 0, "arrived": 1.0}
    assert leases.rank(unregistered) > leases.rank(a), "a registered waiter goes before an equal newcomer"
    assert leases.ahead(d, [a, b, c], ["0"]) == [b, a], "only waiters wanting device 0 that rank before d"
    assert leases.ahead(b, [a, c, d], ["0", "1"]) == []


def test_waiters_come_back_ranked_and_leave_when_dequeued(lease_dir):
    info = leases.owner_info("p")
    late = leases.enqueue(["0"], info, priority=0, arrived=200.0)
    early = leases.enqueue(["0"], info, priority=0, arrived=100.0)
    urgent = leases.enqueue(["1"], info, priority=7, arrived=300.0)
    try:
        live = leases.waiters(lease_dir)
        assert [w["file"] for w in live] == [urgent.name, early.name, late.name]
        assert live[1]["addresses"] == ["0"] and live[1]["profile"] == "p" and live[0]["priority"] == 7
    finally:
        for w in (late, early, urgent):
            leases.dequeue(w)
    assert leases.waiters(lease_dir) == [] and list((lease_dir / leases.QUEUE).iterdir()) == []


def test_dead_waiter_is_ignored_and_removed(tmp_path, lease_dir):
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, _script(tmp_path, "dead_waiter", DEAD_WAITER), str(lease_dir), str(ready)]
    )
    book = DeviceBook(lease_dir=lease_dir, lease_timeout=5)
    try:
        _wait_for(ready, proc)
        (live,) = leases.waiters(lease_dir)
        assert live["pid"] == proc.pid and live["priority"] == 3 and live["file"] == ready.read_text()
        assert book.acquire("low", [DEV0], 1, block=False) == [], "a live priority-3 waiter goes first"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert leases.waiters(lease_dir) == []
        assert not (lease_dir / leases.QUEUE / ready.read_text()).exists(), (
            "the dead waiter's file is deleted"
        )
        assert book.acquire("low", [DEV0], 1, block=False) == [0]
        book.release("low", ["0"])
    finally:
        _stop(proc)


def test_book_yields_to_a_higher_ranked_waiter_and_says_so(lease_dir, caplog):
    other = leases.enqueue(["0"], dict(leases.owner_info("urgent"), flow_run_name="urgent-run"), priority=5)
    book = DeviceBook(lease_dir=lease_dir, lease_timeout=0.6, log_every=30)
    try:
        assert book.acquire("mine", [DEV0], 1, block=False, priority=9) == [0], "priority 9 outranks 5"
        book.release("mine", ["0"])
        caplog.set_level(logging.INFO, logger="gpu_tasks.devices.book")
        with pytest.raises(ClusterError, match=r"waiters that rank before it: profile 'urgent'.*priority 5"):
            book.acquire("mine", [DEV0], 1, block=True, priority=0)
    finally:
        leases.dequeue(other)
    yielded = [r.getMessage() for r in caplog.records if "letting waiter(s)" in r.getMessage()]
    assert len(yielded) == 1, "logged once per log_every"
    assert "profile 'mine' (priority 0)" in yielded[0] and "flow run 'urgent-run'" in yielded[0]
    assert leases.waiters(lease_dir) == [], "a waiter that gave up leaves the queue"
    assert book.acquire("mine", [DEV0], 1, block=False) == [0]
    book.release("mine", ["0"])


def test_book_keeps_a_free_device_for_a_higher_priority_profile_of_its_own(lease_dir, caplog):
    """'high' waits for the group (0, 1) while 'busy' holds 1: 'low' may not take the free 0 meanwhile."""
    dev1 = (Device(address="1", index=1, name="EMU"),)
    book = DeviceBook(lease_dir=lease_dir, lease_timeout=0.2, log_every=30)
    caplog.set_level(logging.INFO, logger="gpu_tasks.devices.book")
    assert book.acquire("busy", [dev1], 1, block=False) == [0]
    results: dict[str, object] = {}

    def wait(name: str, groups: list, priority: int) -> None:
        try:
            results[name] = book.acquire(name, groups, 1, block=True, priority=priority)
        except ClusterError as exc:
            results[name] = exc

    high = threading.Thread(target=wait, args=("high", [DEV0 + dev1], 5))
    high.start()
    _until(lambda: any(w["profile"] == "high" for w in leases.waiters(lease_dir)), "profile 'high' waits")
    low = threading.Thread(target=wait, args=("low", [DEV0], 0))
    low.start()
    _until(
        lambda: any("letting waiter(s)" in r.getMessage() for r in caplog.records), "'low' yields", seconds=10
    )
    time.sleep(0.5)  # longer than lease_timeout: yielding within the run does not count towards it
    assert "low" not in results and book.holders == {"1": "busy"}
    book.release("busy", ["1"])
    high.join(timeout=10)
    assert results["high"] == [0] and book.holders == {"0": "high", "1": "high"}
    book.release("high", ["0", "1"])
    low.join(timeout=10)
    assert results["low"] == [0]
    book.release("low", ["0"])
    (message,) = [r.getMessage() for r in caplog.records if "letting waiter(s)" in r.getMessage()]
    assert (
        "profile 'low' (priority 0)" in message and "profile 'high' of this flow run (priority 5" in message
    )
    assert leases.waiters(lease_dir) == []


# ------------------------------------------------------------------ across processes
@pytest.mark.parametrize(
    "first_priority, second_priority, winner",
    [(0, 5, "second"), (0, 0, "first")],
    ids=["priority-beats-arrival", "equal-priority-first-come-first-served"],
)
def test_released_device_goes_to_the_first_ranked_waiting_process(
    tmp_path,
    lease_dir,
    first_priority,
    second_priority,
    winner,
):
    ready, go = tmp_path / "holder-ready", tmp_path / "go"
    holder_script = _script(tmp_path, "holder", HOLDER)
    holder = subprocess.Popen([sys.executable, holder_script, str(lease_dir), str(ready), str(go)])
    waiter_script = _script(tmp_path, "waiter", WAITER)
    procs = {"holder": holder}
    try:
        _wait_for(ready, holder)
        for n, (name, priority) in enumerate(
            (("first", first_priority), ("second", second_priority)), start=1
        ):
            procs[name] = subprocess.Popen(
                [
                    sys.executable,
                    waiter_script,
                    str(lease_dir),
                    name,
                    str(priority),
                    str(tmp_path / f"{name}.json"),
                ]
            )
            _until(
                lambda n=n: len(leases.waiters(lease_dir)) == n,
                f"waiter {name!r} queued",
                procs=tuple(procs.values()),
            )
        queued = leases.waiters(lease_dir)
        by_name = {w["profile"]: w for w in queued}
        assert by_name["first"]["arrived"] < by_name["second"]["arrived"]
        assert [w["profile"] for w in queued] == ([winner] + [n for n in ("first", "second") if n != winner])
        go.write_text("release")
        for proc in procs.values():
            assert proc.wait(timeout=40) == 0
    finally:
        for proc in procs.values():
            _stop(proc)
    got = {n: json.loads((tmp_path / f"{n}.json").read_text()) for n in ("first", "second")}
    loser = "first" if winner == "second" else "second"
    assert got[winner]["got"] < got[loser]["got"], (
        f"the {winner} waiter should have got device 0 first: {got}"
    )
    assert got[winner]["released"] <= got[loser]["got"], "both waiters held device 0 at once"
    assert leases.waiters(lease_dir) == [] and leases.holders(lease_dir, ["0"]) == {"0": None}


@pytest.mark.usefixtures("prefect_server")
def test_four_flow_runs_never_share_a_device(tmp_path, lease_dir):
    script, runs, per_run = _script(tmp_path, "stress", STRESS), 4, 25
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(tmp_path / f"run{i}.json"), str(per_run)],
            env=_env(lease_dir, GPU_TASKS_EMULATED_GPUS="2", GPU_TASKS_LEASE_TIMEOUT="120"),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(runs)
    ]
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0, out[-3000:]
    finally:
        for proc in procs:
            _stop(proc)
    by_device: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    for i in range(runs):
        data = json.loads((tmp_path / f"run{i}.json").read_text())
        assert len(data["rows"]) == per_run
        for row in data["rows"]:
            by_device[row["device"]].append((row["start"], row["end"], data["run"]))
    assert set(by_device) <= {"0", "1"}
    for device, intervals in by_device.items():
        intervals.sort()
        for (_s1, e1, run1), (s2, _e2, run2) in zip(intervals, intervals[1:], strict=False):
            assert run1 == run2 or e1 <= s2, f"flow runs {run1} and {run2} used device {device} at once"
    assert leases.waiters(lease_dir) == []


# ------------------------------------------------------------------ within one process
@pytest.mark.usefixtures("no_leaked_processes", "emulated")
def test_higher_priority_profile_of_one_run_gets_the_device_first(tmp_path, lease_dir, monkeypatch):
    from prefect import flow, task

    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "1")
    gate = tmp_path / "gate"
    profiles = [
        ResourceProfile(name="busy", gpus=1, idle_timeout=30),
        ResourceProfile(name="low", gpus=1, idle_timeout=30, priority=0),
        ResourceProfile(name="high", gpus=1, idle_timeout=30, priority=5),
    ]

    @task
    def stamp(wait_for_gate: bool) -> dict:
        if wait_for_gate:
            Path(gate.with_suffix(".started")).write_text("started")
            deadline = time.monotonic() + 60
            while not gate.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        start = time.time()
        time.sleep(0.2)
        return {"profile": current_allocation().profile, "start": start, "end": time.time()}

    def queued(name: str) -> bool:
        return any(w["profile"] == name for w in leases.waiters(lease_dir))

    @flow(task_runner=ProfileTaskRunner(profiles=profiles))
    def f():
        busy = stamp.with_options(tags=[profile("busy")]).submit(True)
        _until(gate.with_suffix(".started").exists, "the busy task started", seconds=60)
        low = stamp.with_options(tags=[profile("low")]).submit(False)
        _until(lambda: queued("low"), "profile 'low' waits")
        high = stamp.with_options(tags=[profile("high")]).submit(False)
        _until(lambda: queued("high"), "profile 'high' waits")
        gate.write_text("go")
        return [x.result() for x in (busy, low, high)]

    busy, low, high = f()
    assert busy["end"] <= high["start"] < high["end"] <= low["start"], (busy, low, high)


def test_a_book_whose_runner_stops_grants_no_device_even_a_free_one(lease_dir):
    """A grant once the runner stops would start workers for a closing flow process (a cancel whose
    SIGTERM had also killed the profile's scheduler held the close until Prefect's SIGKILL): a
    waiting acquire raises, a non-blocking one gets nothing, and the device stays free."""
    stop = threading.Event()
    book = DeviceBook(lease_dir=lease_dir, lease_timeout=60, stop=stop)
    stop.set()
    with pytest.raises(ClusterError, match="the runner stopped while waiting for devices"):
        book.acquire("late", [DEV0], 1, block=True)
    assert book.acquire("late", [DEV0], 1, block=False) == []
    assert book.holders.get("0") is None and leases.holders(lease_dir, ["0"]) == {"0": None}


def test_the_wait_line_names_only_the_devices_its_own_profiles_hold(lease_dir, caplog):
    """'train' wants (0, 1): another book (another flow run) leases 0 and its own 'etl' holds 1. The
    line on its own profiles named both devices as held by 'etl' (a new-user pass); it names 1."""
    dev1 = (Device(address="1", index=1, name="EMU"),)
    other = DeviceBook(lease_dir=lease_dir, lease_timeout=5)
    stop = threading.Event()  # its own profile's hold has no timeout: the runner's stop ends the wait
    book = DeviceBook(lease_dir=lease_dir, lease_timeout=60, log_every=30, stop=stop)
    caplog.set_level(logging.INFO, logger="gpu_tasks.devices.book")
    timer = threading.Timer(1.5, stop.set)
    try:
        assert other.acquire("elsewhere", [DEV0], 1, block=False) == [0]
        assert book.acquire("etl", [dev1], 1, block=False) == [0]
        timer.start()
        with pytest.raises(ClusterError, match="the runner stopped"):
            book.acquire("train", [DEV0 + dev1], 1, block=True)
    finally:
        timer.cancel()
        book.release("etl", ["1"])
        other.release("elsewhere", ["0"])
    said = [r.getMessage() for r in caplog.records if "of this flow run" in r.getMessage()]
    assert said and all("waiting for devices 1, held by profile(s) 'etl'" in line for line in said), said
