"""Device leases across processes on one host (gpu_tasks.devices.leases and DeviceBook).

Every test sets GPU_TASKS_LEASE_DIR to its own tmp_path, so leases are never shared
with another test or with the developer's own flow runs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpu_tasks import ClusterError, ProfileTaskRunner, ResourceProfile, profile
from gpu_tasks.cli import app
from gpu_tasks.devices import leases
from gpu_tasks.devices.book import DeviceBook
from gpu_tasks.devices.discovery import Device

HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from gpu_tasks.devices import leases

    lease_dir, address, ready = sys.argv[1:4]
    info = dict(leases.owner_info("holder"), flow_run_name="holder-run", flow_run_id="holder-id")
    assert leases.take([address], info, lease_dir) is not None
    Path(ready).write_text("held")
    time.sleep(120)
    """
)

TWO_RUNS = textwrap.dedent(
    """
    import json, logging, os, sys, time
    from pathlib import Path
    from prefect import flow, task
    from gpu_tasks import ProfileTaskRunner, ResourceProfile, current_allocation, profile
    from gpu_tasks.devices import leases

    OUT, MINE, PEER, PEER_OUT = (Path(p) for p in sys.argv[1:5])

    def peer_waits_or_is_done():
        # this task runs in a worker process; its parent is this flow run's process
        return PEER_OUT.exists() or any(w.get("pid") != os.getppid() for w in leases.waiters())

    @task(tags=[profile("gpu")])
    def hold(i):
        deadline = time.monotonic() + 30
        while not peer_waits_or_is_done() and time.monotonic() < deadline:
            time.sleep(0.05)  # the device is held until the other flow run queues for it
        start = time.time()
        time.sleep(0.3)
        return {"device": current_allocation().devices[0], "start": start, "end": time.time()}

    GPU = ResourceProfile(name="gpu", gpus=1, idle_timeout=0.5)

    @flow(task_runner=ProfileTaskRunner(profiles=[GPU]))
    def leased_run():
        MINE.write_text("started")
        return [f.result() for f in hold.map(range(3))]

    if __name__ == "__main__":
        handler = logging.StreamHandler()
        logging.getLogger("gpu_tasks").addHandler(handler)
        logging.getLogger("gpu_tasks").setLevel(logging.INFO)
        OUT.write_text(json.dumps({"pid": os.getpid(), "rows": leased_run()}))
    """
)


def _info(name: str = "p") -> dict:
    return leases.owner_info(name)


def _wait_for(path: Path, proc: subprocess.Popen, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, "the helper process exited early"
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)


def _holder(tmp_path: Path, lease_dir: Path, address: str = "0") -> subprocess.Popen:
    """A process that leases ``address`` and sleeps; returns once it holds the lease."""
    script, ready = tmp_path / "holder.py", tmp_path / "holder-ready"
    script.write_text(HOLDER)
    proc = subprocess.Popen([sys.executable, str(script), str(lease_dir), address, str(ready)])
    _wait_for(ready, proc)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


# ------------------------------------------------------------------ unit
def test_take_is_all_or_nothing(lease_dir):
    held = leases.take(["1"], _info("other"))
    assert held is not None and tuple(held.files) == ("1",)
    assert stat.S_IMODE(lease_dir.stat().st_mode) == 0o700
    assert leases.take(["0", "1"], _info()) is None
    assert leases.holders(lease_dir, ["0"]) == {"0": None}, "a partial take must give back what it took"
    leases.release(held)
    both = leases.take(["0", "1"], _info())
    assert both is not None and set(leases.holders(lease_dir)) == {"0", "1"}
    assert all(info is not None for info in leases.holders(lease_dir).values())
    leases.release(both, ["0"])
    assert leases.holders(lease_dir) == {"0": None, "1": leases.holders(lease_dir)["1"]}
    leases.release(both)
    assert leases.holders() == {"0": None, "1": None}


def test_holders_reports_the_holder(lease_dir):
    lease = leases.take(["MIG-1/2"], _info("train"))
    try:
        info = leases.holders(lease_dir)["MIG-1/2"]
        assert info["pid"] == os.getpid() and info["profile"] == "train" and info["since"] <= time.time()
        assert "pid" in leases.describe(info) and leases.describe(None) == "free"
    finally:
        leases.release(lease)


def test_sigkilled_holder_frees_the_device(tmp_path, lease_dir):
    proc = _holder(tmp_path, lease_dir)
    try:
        info = leases.holders(lease_dir)["0"]
        assert info["pid"] == proc.pid and info["flow_run_name"] == "holder-run"
        assert leases.take(["0"], _info()) is None
        proc.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 2
        lease = None
        while lease is None and time.monotonic() < deadline:
            lease = leases.take(["0"], _info())
            time.sleep(0.02)
        assert lease is not None, "the device was still leased 2s after its holder was killed"
        leases.release(lease)
    finally:
        _stop(proc)


def test_device_book_leases_and_times_out(lease_dir):
    dev0, dev1 = Device(address="0", index=0, name="EMU"), Device(address="1", index=1, name="EMU")
    groups = [(dev0,), (dev1,)]
    mine, theirs = (
        DeviceBook(lease_dir=lease_dir, lease_timeout=0.3),
        DeviceBook(lease_dir=lease_dir, lease_timeout=0.3),
    )
    assert mine.acquire("a", groups, 1, block=True) == [0]
    assert mine.acquire("b", groups[:1], 1, block=False) == [], "in-process sharing is unchanged"
    assert leases.holders(lease_dir)["0"]["profile"] == "a"
    assert theirs.acquire("c", groups, 2, block=False) == [1]
    with pytest.raises(
        ClusterError,
        match=rf"device 0: profile 'a' \(priority 0\), pid {os.getpid()}.*GPU_TASKS_LEASE_TIMEOUT",
    ):
        theirs.acquire("d", groups[:1], 1, block=True)
    mine.release("a", ["0"])
    assert leases.holders(lease_dir)["0"] is None
    assert theirs.acquire("d", groups, 1, block=False) == [0]
    theirs.release("c", ["1"])
    theirs.release("d", ["0"])
    assert leases.holders(lease_dir) == {"0": None, "1": None}


def test_a_wait_line_names_only_the_devices_still_leased(lease_dir, caplog):
    """The periodic wait line reads the holders when it is written: a device given back since the
    waiter looked (a preempted holder's, say) is not named as leased (the line read "device 0: free")."""
    import logging

    from gpu_tasks.devices.book import _WaitLog

    dev1 = Device(address="1", index=1, name="EMU")
    holder, waiter = DeviceBook(lease_dir=lease_dir), DeviceBook(lease_dir=lease_dir)
    assert holder.acquire("a", [(dev1,)], 1, block=False) == [0]
    log = _WaitLog(waiter, "b", 0, ["0", "1"])

    def lines() -> list[str]:
        caplog.clear()
        log.last.clear()  # due again
        with caplog.at_level(logging.INFO, logger="gpu_tasks.devices.book"):
            log.waiting(time.monotonic(), set(), {"0", "1"}, [])  # both were leased when it looked
        return [r.getMessage() for r in caplog.records if "leased by other flow runs" in r.getMessage()]

    [line] = lines()
    assert "device 1: profile 'a'" in line and f"pid {os.getpid()} (this process)" in line, line
    assert "device 0" not in line, line
    holder.release("a", ["1"])
    assert lines() == []


def test_cli_devices_shows_who_holds_each_device(tmp_path, lease_dir, monkeypatch):
    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "2")
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "250")  # the whole table on one line a row
    proc = _holder(tmp_path, lease_dir, "1")
    try:
        data = json.loads(CliRunner().invoke(app, ["devices", "--json"]).stdout)
        held_by = {d["address"]: d["held_by"] for d in data["devices"]}
        assert held_by["0"] is None and held_by["1"]["pid"] == proc.pid
        table = CliRunner().invoke(app, ["devices"]).stdout
        assert "Held by" in table and "free" in table and f"pid {proc.pid}" in table
        assert "holder-run" in table
    finally:
        _stop(proc)


# ------------------------------------------------------------------ integration
def _env(lease_dir: Path, **extra: str) -> dict[str, str]:
    import prefect.settings

    return {
        **os.environ,
        "GPU_TASKS_EMULATED_GPUS": "1",
        "GPU_TASKS_LEASE_DIR": str(lease_dir),
        "PREFECT_API_URL": str(prefect.settings.PREFECT_API_URL.value()),
        **extra,
    }


@pytest.mark.usefixtures("prefect_server")
def test_two_flow_runs_never_share_a_device(tmp_path, lease_dir):
    script = tmp_path / "leased_run.py"
    script.write_text(TWO_RUNS)
    names = ("a", "b")
    procs = {
        n: subprocess.Popen(
            [
                sys.executable,
                str(script),
                str(tmp_path / f"{n}.json"),
                str(tmp_path / f"{n}.started"),
                str(tmp_path / f"{'b' if n == 'a' else 'a'}.started"),
                str(tmp_path / f"{'b' if n == 'a' else 'a'}.json"),
            ],
            env=_env(lease_dir),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for n in names
    }
    logs = {}
    try:
        for n, proc in procs.items():
            logs[n], _ = proc.communicate(timeout=50)
            assert proc.returncode == 0, logs[n][-3000:]
    finally:
        for proc in procs.values():
            _stop(proc)
    runs = {n: json.loads((tmp_path / f"{n}.json").read_text()) for n in names}
    for n in names:
        assert [r["device"] for r in runs[n]["rows"]] == ["0"] * 3
    first, second = sorted(names, key=lambda n: min(r["start"] for r in runs[n]["rows"]))
    assert max(r["end"] for r in runs[first]["rows"]) <= min(r["start"] for r in runs[second]["rows"]), (
        "two flow runs used device 0 at the same time"
    )
    waited = logs[second]
    assert "leased by other flow runs" in waited and f"pid {runs[first]['pid']}" in waited, waited[-3000:]


@pytest.mark.usefixtures("no_leaked_processes")
def test_lease_timeout_names_the_holder(tmp_path, lease_dir, monkeypatch):
    from prefect import flow, task

    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "1")
    monkeypatch.setenv("GPU_TASKS_LEASE_TIMEOUT", "2")

    @task(tags=[profile("gpu")])
    def never_runs():
        return "ran"

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="gpu", gpus=1, idle_timeout=0.5)]))
    def blocked():
        return never_runs.submit().result()

    proc = _holder(tmp_path, lease_dir)
    try:
        with pytest.raises(ClusterError) as err:
            blocked()
    finally:
        _stop(proc)
    message = str(err.value)
    waited = re.search(r"waited ([0-9.]+)s for devices", message)
    assert waited and float(waited.group(1)) >= 2, f"gave up before GPU_TASKS_LEASE_TIMEOUT: {message}"
    assert f"pid {proc.pid}" in message and "flow run 'holder-run' (id holder-id)" in message
    assert "device 0" in message and "GPU_TASKS_LEASE_TIMEOUT" in message


@pytest.mark.parametrize("seed", [1, 2])
def test_all_or_nothing_takes_never_deadlock_in_random_orders(lease_dir, seed):
    """Four independent books (separate lock files, as separate flow runs would have)
    repeatedly take random pairs of four devices, listed in random order: every take
    completes and no device ever has two holders."""
    import random
    import threading

    devices = [Device(address=str(i), index=i, name="EMU", memory_total=None) for i in range(4)]
    rng = random.Random(seed)
    plans = [[rng.sample(devices, 2) for _ in range(10)] for _ in range(4)]
    intervals: list[tuple[str, float, float, int]] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def run(who: int) -> None:
        book = DeviceBook(lease_dir=lease_dir, lease_timeout=30)
        try:
            for pair in plans[who]:
                got = book.acquire(f"run{who}", [tuple(pair)], 1, block=True)
                start = time.monotonic()
                time.sleep(rng.uniform(0.001, 0.01))
                end = time.monotonic()
                book.release(f"run{who}", [d.address for d in pair])
                assert got == [0]
                with lock:
                    intervals.extend((d.address, start, end, who) for d in pair)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert not any(t.is_alive() for t in threads), "a take never completed: deadlock"
    assert not errors, errors
    assert len(intervals) == 4 * 10 * 2
    for address in "0123":
        spans = sorted((s, e, w) for a, s, e, w in intervals if a == address)
        for (_s1, e1, w1), (s2, _e2, w2) in zip(spans, spans[1:], strict=False):
            assert s2 >= e1, f"device {address} held by run{w1} and run{w2} at once"


@pytest.mark.usefixtures("no_leaked_processes")
def test_a_profile_short_of_devices_grows_when_one_frees(tmp_path, lease_dir, monkeypatch):
    """Two long tasks of a profile of up to two one-device workers, while another process holds one of
    the two devices: the profile starts on the free one; once the other frees, it grows onto it and the
    second task starts there, rather than waiting out the first on the one worker (it grew only when a
    task was handed out, so it never grew: a preempted task of such a profile waited the same way)."""
    from prefect import flow, task

    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "2")
    starts = tmp_path / "starts"
    starts.mkdir()

    @task(tags=[profile("gpu")])
    def long(i: int) -> dict:
        from gpu_tasks import current_allocation

        start = time.time()
        (starts / str(i)).write_text(str(start))
        time.sleep(15 if i == 0 else 0.5)
        return {"device": current_allocation().devices[0], "start": start, "end": time.time()}

    gpu = ResourceProfile(name="gpu", gpus=1, max_workers=2, idle_timeout=0.5)

    @flow(task_runner=ProfileTaskRunner(profiles=[gpu]))
    def two_long():
        return [f.result() for f in long.map(range(2))]

    proc = _holder(tmp_path, lease_dir, address="1")
    freed = None
    try:
        import threading

        def free_device_1() -> None:
            nonlocal freed
            deadline = time.monotonic() + 60
            while not (starts / "0").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1.0)
            _stop(proc)
            freed = time.time()

        freeing = threading.Thread(target=free_device_1, daemon=True)
        freeing.start()
        first, second = two_long()
        freeing.join(timeout=10)
    finally:
        _stop(proc)
    assert first["device"] == "0" and freed is not None, (first, freed)
    assert second["device"] == "1", (first, second)
    # it started soon after the device freed, long before the first task ended
    assert second["start"] < first["end"] - 5, (first, second, freed)


@pytest.mark.usefixtures("no_leaked_processes")
def test_a_subflow_with_its_own_runner_gets_the_device_its_blocked_parent_holds_idle(lease_dir, monkeypatch):
    """A parent flow run's GPU profile is idle while the parent is blocked in a subflow's call; the
    subflow's own runner waits for that device. The parent's idle cluster gives it back at once, as a
    profile of the subflow's own runner would (before, the subflow waited out the parent's idle timeout:
    it failed here, its lease timeout being shorter, with an error naming the script's own pid)."""
    from prefect import flow, task
    from prefect.context import FlowRunContext

    from gpu_tasks import current_allocation

    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "1")
    monkeypatch.setenv("GPU_TASKS_LEASE_TIMEOUT", "20")  # well below the parent's idle timeout

    @task(tags=[profile("gpu")])
    def on_gpu(i: int) -> str:
        return current_allocation().devices[0]

    def runner() -> ProfileTaskRunner:
        return ProfileTaskRunner(profiles=[ResourceProfile(name="gpu", gpus=1, idle_timeout=600)])

    @flow(task_runner=runner())
    def child() -> tuple[str, str]:
        return on_gpu.submit(1).result(), FlowRunContext.get().flow_run.name

    @flow(task_runner=runner())
    def parent() -> tuple[str, tuple[str, str], list[str]]:
        first = on_gpu.submit(0).result()
        second = child()
        ledger = FlowRunContext.get().task_runner.ledger  # the run's copy of the runner
        return first, second, [r.reason for r in ledger if r.profile == "gpu"]

    first, (second, child_run), reasons = parent()
    assert (first, second) == ("0", "0")
    assert reasons == [
        f"released its devices early: profile 'gpu' of flow run {child_run!r} is waiting for them"
    ]


@pytest.mark.usefixtures("prefect_server", "no_leaked_processes")
def test_a_task_its_flow_run_ends_before_keeps_the_tags_of_its_submit(tmp_path, lease_dir, monkeypatch):
    """A GPU task still waiting for its device when its flow run ends is reported (``Cancelled``: the
    flow returned without waiting for it; ``Failed`` until 2026-12-07) with the tags
    Prefect's engine would have given it, those of the blocks around its submit too (it had its task's
    and its profile's only)."""
    from faults._procs import server_task_run
    from prefect import flow, tags, task

    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "1")

    @task(tags=[profile("gpu")])
    def never_starts() -> None:
        return None

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="gpu", gpus=1)]))
    def ends_first() -> str:
        with tags("team-x"):
            return str(never_starts.submit().task_run_id)

    proc = _holder(tmp_path, lease_dir)
    try:
        task_run_id = ends_first()
    finally:
        _stop(proc)
    run = server_task_run(task_run_id, lambda r: r.get("state_type") == "CANCELLED")
    assert run.get("state_type") == "CANCELLED", run  # it never ran: no result
    assert {"team-x", "profile:gpu"} <= set(run["tags"]), run["tags"]
    # ended as Prefect's engine ends a run: the UI showed no end time for runs gpu-tasks ended
    assert run.get("end_time") is not None, run  # (a new-user pass, 7 of 7)


@pytest.mark.usefixtures("no_leaked_processes")
def test_a_profile_that_could_use_more_workers_gets_the_devices_an_idle_profile_holds(monkeypatch):
    """A quarter-GPU profile runs on one device while a whole-GPU profile that ran before sits idle on
    the other: once that one has been idle a while (not between two tasks), it gives its device back
    and the quarter profile grows onto it (before, it kept it until its idle timeout, and the map ran
    four at a time on one device)."""
    from prefect import flow, task
    from prefect.context import FlowRunContext

    from gpu_tasks import current_allocation

    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "2")

    @task(tags=[profile("gpu")])
    def whole() -> str:
        return current_allocation().devices[0]

    @task(tags=[profile("quarter")])
    def part(i: int) -> str:
        time.sleep(1.5)
        return current_allocation().devices[0]

    profiles = [
        ResourceProfile(name="gpu", gpus=1, idle_timeout=600),
        ResourceProfile(name="quarter", gpus=0.25, idle_timeout=600),
    ]

    @flow(task_runner=ProfileTaskRunner(profiles=profiles))
    def both() -> tuple[str, list[str], list[str]]:
        first = whole.submit().result()
        parts = [f.result() for f in part.map(range(24))]  # 9 s on one device, four at a time
        ledger = FlowRunContext.get().task_runner.ledger
        return first, parts, [r.reason for r in ledger if r.profile == "gpu"]

    first, parts, reasons = both()
    assert set(parts) == {"0", "1"}, (first, parts)
    assert reasons == ["released its devices early: profile 'quarter' is waiting for them"], reasons
