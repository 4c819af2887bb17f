"""ProfileTaskRunner on emulated devices against a real Prefect test server."""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from faults._procs import server_task_run
from prefect import flow, tags, task, unmapped
from prefect.context import FlowRunContext
from prefect.futures import as_completed, wait
from prefect_api import api, flow_run_events

from gpu_tasks import (
    ProfileTaskRunner,
    ResourceProfile,
    UnknownProfileError,
    UnsatisfiableProfileError,
    current_allocation,
    profile,
)

pytestmark = pytest.mark.usefixtures("no_leaked_processes", "emulated")

CPU = ResourceProfile(name="cpu", cpus=0.5)
GPU = ResourceProfile(name="gpu", gpus=1, idle_timeout=30)
QUARTER = ResourceProfile(name="quarter", gpus=0.25, idle_timeout=30)


def runner(*profiles: ResourceProfile, **kw) -> ProfileTaskRunner:
    return ProfileTaskRunner(profiles=[CPU, *profiles], default="cpu", **kw)


@task
def hold(seconds: float, tag: int = 0, meet: str | None = None, n: int = 0) -> dict:
    """Record where and when the task ran; with ``meet``, first wait (up to 60 s) until
    ``n`` tasks have arrived in that folder (a rendezvous, see :func:`gather`)."""
    a = current_allocation()
    if meet is not None:
        _arrive_and_wait(meet, n)
    start = time.time()
    time.sleep(seconds)
    return {
        "tag": tag,
        "profile": a.profile,
        "devices": a.devices,
        "fraction": a.fraction,
        "emulated": a.emulated,
        "pid": os.getpid(),
        "start": start,
        "end": time.time(),
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def _status():
    return FlowRunContext.get().task_runner.status()


def _until(predicate, what: str, seconds: float = 60.0) -> None:
    """Poll ``predicate`` until it holds; fail naming ``what`` after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {seconds:g}s"
        time.sleep(0.05)


def _overlaps(intervals: list[tuple[float, float]]) -> int:
    """Most intervals open at one instant."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    best = cur = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def test_whole_devices_are_never_shared(tmp_path: Path):
    gpu_hold = hold.with_options(tags=[profile("gpu")])

    @flow(task_runner=runner(GPU))
    def f():
        # the first two tasks wait for each other: a second one can only run on the other device,
        # so both devices are used however long the second worker takes to start
        return [
            fut.result()
            for fut in gpu_hold.map(
                [0.2] * 8, tag=list(range(8)), meet=unmapped(str(tmp_path)), n=unmapped(2)
            )
        ]

    rows = f()
    by_device = defaultdict(list)
    for r in rows:
        assert r["profile"] == "gpu" and r["emulated"] is True and r["fraction"] == 1.0
        assert len(r["devices"]) == 1 and r["visible"] == r["devices"][0]
        by_device[r["devices"][0]].append((r["start"], r["end"]))
    assert set(by_device) == {"0", "1"}, "8 whole-device tasks should use both devices"
    for dev, intervals in by_device.items():
        assert _overlaps(intervals) == 1, f"device {dev} ran two whole-device tasks at once"
    # a worker process per device: never the flow process
    assert os.getpid() not in {r["pid"] for r in rows}


def test_two_profiles_never_hold_the_same_device_at_once(monkeypatch):
    """One device, a whole-device profile and a fractional one: the device has one holder at a time."""
    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "1")
    long_idle = ResourceProfile(name="gpu", gpus=1, idle_timeout=600)
    gpu_hold = hold.with_options(tags=[profile("gpu")])
    quarter_hold = hold.with_options(tags=[profile("quarter")])

    @flow(task_runner=runner(long_idle, QUARTER))
    def f():
        first = [gpu_hold.submit(0.5, tag=i) for i in range(2)]
        _until(lambda: _status()["gpu"]["state"] == "running", "profile 'gpu' holds the device")
        second = [quarter_hold.submit(0.3, tag=10 + i) for i in range(4)]
        return [x.result() for x in first + second], list(FlowRunContext.get().task_runner.ledger)

    rows, ledger = f()
    whole = [(r["start"], r["end"]) for r in rows if r["profile"] == "gpu"]
    shared = [(r["start"], r["end"]) for r in rows if r["profile"] == "quarter"]
    assert {r["devices"] for r in rows} == {("0",)}
    # every quarter task started after the last whole-device task ended, and vice versa
    assert min(s for s, _ in shared) >= max(e for _, e in whole)
    # the idle 'gpu' cluster gave its device back at once, not after its 600 s idle timeout
    reasons = {row.profile: row.reason for row in ledger}
    assert "profile 'quarter' is waiting" in reasons["gpu"]


@task
def rendezvous(folder: str, me: str, other: str, limit: float = 60.0) -> dict:
    """Arrive, then wait for ``other`` to arrive too: True only if both ran at once."""
    Path(folder, me).write_text(",".join(current_allocation().devices))
    deadline = time.time() + limit
    while time.time() < deadline:
        if Path(folder, other).exists():
            return {"met": True, "devices": current_allocation().devices}
        time.sleep(0.05)
    return {"met": False, "devices": current_allocation().devices}


def _arrive_and_wait(folder: str, n: int, limit: float = 60.0, name: str | None = None) -> bool:
    """Leave a file in ``folder``, then wait until ``n`` files are there: True if they were in time."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    Path(folder, name or uuid.uuid4().hex).write_text("")
    deadline = time.time() + limit
    while time.time() < deadline:
        if len(list(Path(folder).iterdir())) >= n:
            return True
        time.sleep(0.02)
    return False


@task
def gather(folder: str, me: int, n: int, limit: float = 60.0) -> dict:
    """Arrive, then wait until ``n`` tasks have arrived: ``met`` only if all ``n`` ran at once."""
    met = _arrive_and_wait(folder, n, limit, name=str(me))
    a = current_allocation()
    return {"met": met, "devices": a.devices, "fraction": a.fraction}


def test_profiles_spread_over_free_devices_concurrently(tmp_path: Path):
    """Two whole-device profiles, two devices: each takes a device and they run side by side."""
    other = ResourceProfile(name="other", gpus=1, idle_timeout=30)

    @flow(task_runner=runner(GPU, other))
    def f():
        a = rendezvous.with_options(tags=[profile("gpu")]).submit(str(tmp_path), "a", "b")
        b = rendezvous.with_options(tags=[profile("other")]).submit(str(tmp_path), "b", "a")
        return a.result(), b.result()

    a, b = f()
    assert a["met"] and b["met"], "the two profiles' tasks did not run at the same time"
    assert a["devices"] != b["devices"]


def test_gang_profile_starts_all_its_workers_or_none(tmp_path: Path):
    """gang=True: the cluster starts only once every device group it needs is free."""
    gang = ResourceProfile(name="gang", gpus=1, gang=True, max_workers=2, idle_timeout=30)
    other = ResourceProfile(name="other", gpus=1, idle_timeout=0.2)

    gate = tmp_path / "gate"

    @flow(task_runner=runner(gang, other))
    def f():
        # holds one device until the flow opens the gate (the second arrival of a rendezvous)
        busy = hold.with_options(tags=[profile("other")]).submit(0, meet=str(gate), n=2)
        _until(lambda: gate.exists() and any(gate.iterdir()), "the 'other' task started")
        g = hold.with_options(tags=[profile("gang")]).submit(0.1)
        # the gang has its chance to start while 'other' holds a device: it must not take it
        seen = set()
        until = time.monotonic() + 1.0
        while time.monotonic() < until:
            seen.add(_status()["gang"]["state"])
            time.sleep(0.05)
        (gate / "open").write_text("")
        return busy.result(), g.result(), _status(), seen

    busy, g, status, seen = f()
    assert "running" not in seen, "the gang started while one of its devices was held"
    assert g["start"] >= busy["end"], "the gang started before all of its devices were free"
    assert status["gang"]["workers"] == 2 and sorted(status["gang"]["devices"]) == ["0", "1"]


def test_cpu_worker_processes_see_no_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # as on a GPU host
    procs = ResourceProfile(name="cpu", cpus=1, processes=True)

    @flow(task_runner=ProfileTaskRunner(profiles=[procs], default="cpu"))
    def f():
        return hold.submit(0).result()

    row = f()
    assert row["visible"] == "" and row["devices"] == () and os.getpid() != row["pid"]


def test_fractional_tasks_pack_one_device_before_the_next(tmp_path: Path):
    q_gather = gather.with_options(tags=[profile("quarter")])

    @flow(task_runner=runner(QUARTER))
    def f():
        # a rendezvous, not timing: all four must be running at once for any of them to meet
        first = [fut.result() for fut in q_gather.map(unmapped(str(tmp_path / "a")), range(4), unmapped(4))]
        st = _status()["quarter"]
        # eight at once: more than one device's four slots, so the profile must take the second device
        second = [fut.result() for fut in q_gather.map(unmapped(str(tmp_path / "b")), range(8), unmapped(8))]
        return first, st, second

    first, st, second = f()
    assert {r["devices"] for r in first} == {("0",)}, "four quarter tasks fit on the first device"
    assert all(r["fraction"] == 0.25 for r in first)
    assert all(r["met"] for r in first), "the four quarter tasks did not run at the same time"
    assert st["workers"] == 1 and st["devices"] == ["0"]
    assert all(r["met"] for r in second), "eight quarter tasks did not run at the same time"
    per_device = Counter(r["devices"] for r in second)
    assert per_device == {("0",): 4, ("1",): 4}, "eight tasks running at once: four per device, never more"


def test_unknown_profile_fails_at_submit_listing_known_profiles():
    bad = hold.with_options(tags=[profile("tpu")])

    @flow(task_runner=runner(GPU))
    def f():
        bad.submit(0)

    with pytest.raises(UnknownProfileError) as info:
        f()
    msg = str(info.value)
    assert "'tpu'" in msg and "cpu" in msg and "gpu" in msg


@pytest.mark.parametrize(
    "prof, words",
    [
        (ResourceProfile(name="big", gpus=4), ["gpus=4", "2 matching", "H100", "Lower gpus to at most 2"]),
        (
            ResourceProfile(name="a100", gpus=1, gpu_model="A100"),
            ["gpu_model='A100'", "no device matches", "H100", "Change gpu_model to match a device"],
        ),
        (
            ResourceProfile(name="huge", gpus=1, gpu_memory_total="200GiB"),
            ["gpu_memory_total", "no device matches", "Lower gpu_memory_total to match a device"],
        ),
    ],
)
def test_unsatisfiable_profile_fails_fast_naming_request_and_inventory(prof, words):
    t = hold.with_options(tags=[profile(prof.name)])

    @flow(task_runner=runner(prof))
    def f():
        try:
            t.submit(0)
        except UnsatisfiableProfileError as exc:  # raised by submit itself: nothing was waited for
            return exc, _status()[prof.name]
        return None, _status()[prof.name]

    err, status = f()
    assert err is not None, "submit must raise, not return a future that fails later"
    assert status["state"] == "absent", "no cluster was started for an unsatisfiable profile"
    for w in words:
        assert w in str(err)
    # one fix (the profile's own; its words come last), and the fallback that is always open
    assert str(err).endswith(f"{words[-1]}, or set fallback='cpu' on the profile"), str(err)
    assert "Lower the request" not in str(err)


def test_gpu_profile_on_a_host_without_gpus_says_how_to_emulate_or_fall_back(monkeypatch):
    """No GPU and no GPU_TASKS_EMULATED_GPUS (a Prefect worker on a CPU-only host): the error names
    both ways out, emulation and fallback='cpu', and nothing is emulated behind the user's back."""
    from gpu_tasks.devices import discovery as devices_module

    monkeypatch.delenv("GPU_TASKS_EMULATED_GPUS")
    monkeypatch.setattr(
        devices_module, "nvml_devices", lambda: ((), "no NVIDIA driver (NVMLError_LibraryNotFound)")
    )
    prof = ResourceProfile(name="gpu", gpus=1)
    t = hold.with_options(tags=[profile("gpu")])

    @flow(task_runner=runner(prof))
    def f():
        try:
            t.submit(0)
        except UnsatisfiableProfileError as exc:
            return str(exc), _status()["gpu"]["state"]
        return None, _status()["gpu"]["state"]

    err, state = f()
    assert err is not None and state == "absent"
    assert "this host has no GPUs (no NVIDIA driver" in err, err
    assert "GPU_TASKS_EMULATED_GPUS=2" in err and "fallback='cpu'" in err, err
    assert "--emulate" not in err and "example" not in err, "a flow's error speaks of the plugin only"
    assert "GPU_TASKS_EMULATED_GPUS" not in os.environ


def test_fallback_cpu_runs_on_the_cpu_profile():
    prof = ResourceProfile(name="a100", gpus=1, gpu_model="A100", fallback="cpu")
    t = hold.with_options(tags=[profile("a100")])

    @flow(task_runner=runner(prof))
    def f():
        return t.submit(0).result(), _status()

    row, status = f()
    assert row["profile"] == "cpu" and row["devices"] == ()
    assert status["a100"]["state"] == "absent"


def test_fallback_is_announced_when_the_profile_comes_from_a_tags_block(caplog):
    """`with use_profile(...)` / `prefect.tags(...)`: the fallback is logged and tagged as well; once
    per task in a flow run, not once per task run (a new-user pass: 8 task runs gave 8 warnings of
    about 450 characters each)."""
    import logging

    from gpu_tasks import use_profile

    prof = ResourceProfile(name="a100", gpus=1, gpu_model="A100", fallback="cpu")

    @flow(task_runner=runner(prof))
    def f():
        with use_profile("a100"):
            futs = [hold.submit(i) for i in range(3)]
        return [fut.result() for fut in futs], futs[-1].task_run_id

    with caplog.at_level(logging.WARNING):
        rows, run_id = f()
    assert [row["profile"] for row in rows] == ["cpu"] * 3
    said = [r for r in caplog.records if "asks for profile 'a100'" in r.getMessage()]
    assert len(said) == 1 and "fallback='cpu'" in said[0].getMessage(), [r.getMessage() for r in said]

    # the server records the task run from its events, a moment later
    run = server_task_run(run_id, lambda r: "gpu-tasks:fallback" in (r.get("tags") or []))
    assert "gpu-tasks:fallback" in run.get("tags", []), run


def test_idle_scale_down_then_reprovision_within_one_flow():
    quick = ResourceProfile(name="gpu", gpus=1, idle_timeout=0.5)
    g = hold.with_options(tags=[profile("gpu")])

    @flow(task_runner=runner(quick))
    def f():
        first = g.submit(0.1)
        first.wait()
        running = _status()["gpu"]
        _until(lambda: _status()["gpu"]["state"] == "closed", "the idle 'gpu' cluster closed")
        closed = _status()["gpu"]
        again = g.submit(0.1).result()
        ledger = [r.as_dict() for r in FlowRunContext.get().task_runner.ledger]
        # the result of a task whose cluster is gone is still readable
        return first.result(), running, closed, again, ledger

    first, running, closed, again, ledger = f()
    assert running["state"] == "running" and running["workers"] == 1
    assert closed["state"] == "closed" and closed["devices"] == []
    assert first["profile"] == again["profile"] == "gpu"
    assert first["pid"] != again["pid"], "a new worker process after re-provisioning"
    gpu_rows = [r for r in ledger if r["profile"] == "gpu"]
    assert len(gpu_rows) == 1 and "idle" in gpu_rows[0]["reason"]
    assert 0 < gpu_rows[0]["busy_s"] <= gpu_rows[0]["held_s"]


def test_busy_cluster_is_never_closed(tmp_path: Path):
    quick = ResourceProfile(name="gpu", gpus=1, idle_timeout=0.2)
    g = hold.with_options(tags=[profile("gpu")])

    @flow(task_runner=runner(quick))
    def f():
        fut = g.submit(0, meet=str(tmp_path), n=2)  # runs until the flow's own arrival below
        _until(lambda: any(tmp_path.iterdir()), "the task started")
        states = set()
        until = time.monotonic() + 1.0  # five idle timeouts while the task runs
        while time.monotonic() < until:
            states.add(_status()["gpu"]["state"])
            time.sleep(0.05)
        (tmp_path / "flow").write_text("")
        return states, fut.result()

    states, row = f()
    assert states == {"running"} and row["profile"] == "gpu"


@task
def produce(n: int) -> list[int]:
    return list(range(n))


@task(tags=[profile("gpu")])
def total_on_gpu(values: list[int]) -> tuple[int, tuple[str, ...]]:
    return sum(values), current_allocation().devices


@task
def describe(pair: tuple[int, tuple[str, ...]], marker: str) -> str:
    return f"{marker}:{pair[0]}@{','.join(pair[1])}"


def test_the_runner_a_flow_was_built_with_reports_its_latest_flow_run():
    """Prefect runs each flow run with a copy of the runner: the object the user built said every
    profile was ``absent`` and had no ledger, during the run and after it (a new-user pass)."""
    built = runner(GPU)

    @flow(task_runner=built)
    def f():
        total_on_gpu.submit([1]).result()
        return built.status()["gpu"]["state"]

    assert f() == "running"
    assert [row.profile for row in built.ledger if row.profile == "gpu"], built.ledger


@task(tags=[profile("gpu")])
def started_then_sleeps(marker: str, seconds: float) -> str:
    Path(marker).write_text("started")
    time.sleep(seconds)
    return "done"


def test_a_task_that_finishes_during_the_close_keeps_its_completed_record(tmp_path: Path, caplog):
    """The flow raised while a GPU task ran; the task finished on its worker as the runner closed, its
    worker reported Completed, and the close, which had not got the result, reported it Crashed over
    that record (a new-user pass, 3 of 3). The worker notes that it reported a final state."""
    import logging

    marker = tmp_path / "started"
    ids: list[uuid.UUID] = []

    @flow(task_runner=runner(GPU))
    def f():
        total_on_gpu.submit([1]).result()  # the worker is up
        ids.append(started_then_sleeps.submit(str(marker), 1.0).task_run_id)
        _until(marker.exists, "the task's start", 60)
        raise RuntimeError("the flow fails while its GPU task runs")

    with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError, match="the flow fails"):
        f()
    crashed = [r.getMessage() for r in caplog.records if "while this task ran" in r.getMessage()]
    run = server_task_run(ids[0], lambda r: r["state"]["type"] in ("COMPLETED", "CRASHED"))
    assert not crashed and run["state"]["type"] == "COMPLETED", (crashed, run["state"])


@task
def etl_fails() -> list[int]:
    raise ValueError("the ETL failed")


def test_a_gpu_task_whose_upstream_failed_leases_no_device():
    """As Prefect's engine does, a task whose upstream task failed ends NotReady without running; its
    profile's cluster was started for it all the same (a device leased, a worker started, for nothing).
    Now it ends NotReady in the flow process; ``allow_failure`` still runs it on its profile."""
    from prefect import allow_failure

    @flow(task_runner=runner(GPU))
    def f():
        failed = etl_fails.submit()
        as_arg, waited = total_on_gpu.submit(failed), total_on_gpu.submit([1], wait_for=[failed])
        for fut in (as_arg, waited):
            fut.wait()
        states, gpu = [as_arg.state.name, waited.state.name], _status()["gpu"]["state"]
        ran = total_on_gpu.submit([2], wait_for=[allow_failure(failed)]).result()
        return states, gpu, ran

    states, gpu, ran = f()
    assert states == ["NotReady", "NotReady"], states
    assert gpu == "absent", "a cluster was started for tasks that could not run"
    assert ran == (2, ("0",)), "allow_failure: it ran on its profile"


def test_gpu_tasks_downstream_of_a_completed_gpu_task_run_on_their_profile_once(caplog):
    """The failed-upstream check read a done upstream future's state from the server, which had not
    recorded its Completed yet: downstream tasks went to the flow process as NotReady, found their
    function called after all, and ran again as a crash retry (a new-user pass, 2 of 10 task runs,
    5 of 5 flow runs; with retries=1 they ended Failed). It reads the future's own final state."""
    import logging

    @flow(task_runner=runner(GPU))
    def f():
        up = total_on_gpu.submit([1])
        downs = [total_on_gpu.submit([i], wait_for=[up]) for i in range(5)]
        downs += [describe.with_options(tags=[profile("gpu")]).submit(up, str(i)) for i in range(5)]
        return [d.result() for d in downs]

    with caplog.at_level(logging.INFO):
        results = f()
    assert [total for total, _ in results[:5]] == list(range(5))
    assert [text.split("@")[0] for text in results[5:]] == [f"{i}:1" for i in range(5)]
    detours = [r.getMessage() for r in caplog.records if "upstream task" in r.getMessage()]
    assert not detours, detours


def test_futures_cross_profiles_as_arguments_and_wait_for(tmp_path: Path):
    flag = tmp_path / "first.txt"

    @task
    def write_flag() -> None:
        time.sleep(0.5)
        flag.write_text("done")

    @task(tags=[profile("gpu")])
    def read_flag() -> str:
        return flag.read_text()

    @flow(task_runner=runner(GPU))
    def f():
        nums = produce.submit(5)
        pair = total_on_gpu.submit(nums)
        text = describe.submit(pair, "sum")
        w = write_flag.submit()
        r = read_flag.submit(wait_for=[w])
        return text.result(), r.result()

    assert f() == ("sum:10@0", "done")


def test_failed_upstream_stops_downstream_on_another_profile(tmp_path: Path):
    ran = tmp_path / "ran"

    @task
    def boom() -> int:
        raise ValueError("upstream failed on purpose")

    @task(tags=[profile("gpu")])
    def downstream(x: int) -> int:
        ran.write_text("ran")
        return x

    @flow(task_runner=runner(GPU))
    def f():
        up = boom.submit()
        down = downstream.submit(up)
        after = downstream.submit(1, wait_for=[up])
        for fut in (up, down, after):
            fut.wait()
        return up.state.type.value, down.state.type.value, down.state.name, after.state.type.value

    up, down, down_name, after = f()
    assert up == "FAILED"
    assert down != "COMPLETED" and after != "COMPLETED"
    assert down_name == "NotReady", (
        "Prefect marks tasks with failed upstreams NotReady, as with its own runners"
    )
    assert not ran.exists(), "a downstream task ran on failed upstream data"


def test_async_tasks_map_retries_timeouts_and_as_completed(tmp_path: Path):
    attempts = tmp_path / "attempts"

    @task(tags=[profile("quarter")])
    async def async_square(x: int) -> tuple[int, tuple[str, ...]]:
        await asyncio.sleep(0.05)
        return x * x, current_allocation().devices

    @task(tags=[profile("gpu")], retries=2, retry_delay_seconds=0)
    def flaky() -> int:
        with attempts.open("a") as fh:
            fh.write("x")
        if len(attempts.read_text()) < 3:
            raise RuntimeError("transient")
        return 42

    @task(tags=[profile("gpu")], timeout_seconds=0.5)
    def too_slow() -> None:
        time.sleep(5)

    @flow(task_runner=runner(GPU, QUARTER))
    def f():
        squares = async_square.map(range(6))
        done_order = [fut.result()[0] for fut in as_completed(squares)]
        slow = too_slow.submit()
        retried = flaky.submit()
        wait([slow, retried])
        return sorted(done_order), squares[0].result()[1], retried.result(), slow.state

    squares, devices, retried, slow_state = f()
    assert squares == [0, 1, 4, 9, 16, 25]
    assert devices == ("0",)
    assert retried == 42 and len(attempts.read_text()) == 3
    assert slow_state.is_failed() and "timeout" in (slow_state.message or "").lower()


def test_tags_context_routes_submit_and_map():
    @flow(task_runner=runner(GPU))
    def f():
        with tags(profile("gpu")):
            one = hold.submit(0)
            many = hold.map([0, 0])
        plain = hold.submit(0)
        return one.result(), [m.result() for m in many], plain.result()

    one, many, plain = f()
    assert one["profile"] == "gpu" and all(m["profile"] == "gpu" for m in many)
    assert plain["profile"] == "cpu" and plain["devices"] == () and plain["pid"] == os.getpid()


@task
def submits_a_gpu_task() -> str:
    """A CPU task (the runner's default profile) whose body submits a GPU task: the child's id, once
    it ran (a child still starting when the flow run ends is reported Crashed)."""
    child = hold.with_options(tags=[profile("gpu")]).submit(0)
    child.wait()
    return str(child.task_run_id)


def test_a_task_a_cpu_task_submits_gets_the_submitters_tags_not_its_profile_tag():
    """As on Prefect's own runners, a task submitted by a task body gets the tags of the blocks around
    the submit (here the flow's `with tags("team-x")`), not the tags the runner gave its parent: the
    in-process body ran inside the runner's `tags("profile:cpu")`, so the GPU child was tagged
    profile:cpu too (a Prefect tag limit of 1 on profile:cpu then left parent and child waiting for
    the same slot, and the flow hung)."""

    @flow(task_runner=runner(GPU))
    def f():
        with tags("team-x"):
            return submits_a_gpu_task.submit().result()

    child = server_task_run(f(), lambda run: run.get("state_type") == "COMPLETED")
    assert "profile:gpu" in child["tags"] and "team-x" in child["tags"], child["tags"]
    assert "profile:cpu" not in child["tags"], child["tags"]


def test_status_reports_absent_running_and_devices():
    @flow(task_runner=runner(GPU, QUARTER))
    def f():
        before = _status()
        hold.with_options(tags=[profile("gpu")]).submit(0).result()
        return before, _status()

    before, after = f()
    assert {v["state"] for v in before.values()} == {"absent"}
    assert after["gpu"]["state"] == "running" and after["gpu"]["devices"] == ["0"]
    assert after["gpu"]["emulated"] is True
    assert after["quarter"]["state"] == "absent"


def test_a_task_whose_hand_off_fails_is_not_counted_on_its_cluster_after():
    """A task that fails as it is handed to its started cluster (it does not pickle) fails alone and
    leaves no count behind: the profile's next task wants one worker, as the first did, not a
    second device for a task that is no longer there."""
    import functools
    import threading

    @flow(task_runner=runner(GPU))
    def f():
        # a hook holding a lock: the task cannot be sent to a worker process (made here, so the
        # flow itself, which goes to the workers in the context, holds none)
        hook = functools.partial(_no_hook, threading.Lock())
        failed = hold.with_options(tags=[profile("gpu")], on_completion=[hook]).submit(0)
        failed.wait()
        after_failure = _status()["gpu"]["devices"]
        ran = hold.with_options(tags=[profile("gpu")]).submit(0).result()
        return failed.state, after_failure, ran, _status()["gpu"]["devices"]

    failed, after_failure, ran, devices = f()
    assert failed.is_failed() and "pickle" in (failed.message or ""), failed.message
    assert len(after_failure) == 1 and devices == after_failure == list(ran["devices"])


def _no_hook(lock, *args):
    raise AssertionError("the task never ran")


def test_profiles_file_overrides_code_profiles(tmp_path: Path, monkeypatch):
    path = tmp_path / "profiles.toml"
    path.write_text('default = "cpu"\n[profiles.cpu]\ncpus = 1\n[profiles.gpu]\ngpus = 0.5\n')
    monkeypatch.setenv("GPU_TASKS_PROFILES_FILE", str(path))

    @flow(task_runner=runner(GPU))
    def f():
        return hold.with_options(tags=[profile("gpu")]).submit(0).result()

    assert f()["fraction"] == 0.5


def test_workers_listen_on_localhost_only():
    import psutil

    @flow(task_runner=runner(GPU))
    def f():
        hold.with_options(tags=[profile("gpu")]).submit(0).result()
        me = psutil.Process()
        addrs = set()
        for proc in [me, *me.children(recursive=True)]:
            try:
                conns = proc.net_connections(kind="inet")
            except psutil.Error:
                continue
            addrs |= {c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN}
        return addrs

    addrs = f()
    assert addrs and addrs <= {"127.0.0.1"}, addrs


def test_flow_failure_closes_every_cluster():
    @flow(task_runner=runner(GPU))
    def f():
        hold.with_options(tags=[profile("gpu")]).submit(0).result()
        raise RuntimeError("flow body failed")

    with pytest.raises(RuntimeError, match="flow body failed"):
        f()
    # no_leaked_processes checks that the worker processes are gone


def _artifacts(run_id: uuid.UUID, key: str) -> list[dict]:
    """The flow run's artifacts of ``key``, read back through the Prefect client."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    async def read():
        async with get_client() as client:
            return await client.read_artifacts(
                artifact_filter=ArtifactFilter(
                    key=ArtifactFilterKey(any_=[key]), flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])
                )
            )

    return [a.model_dump() for a in asyncio.run(read())]


def _table(artifact: dict) -> list[dict]:
    import json as _json

    data = artifact["data"]
    return data if isinstance(data, list) else _json.loads(data)


def test_flow_run_gets_a_resource_ledger_artifact():
    """Each cluster lifetime becomes a row of the flow run's `resource-ledger` table artifact."""
    short = ResourceProfile(name="gpu", gpus=1, idle_timeout=0.3)

    @flow(task_runner=runner(short))
    def f():
        first = hold.with_options(tags=[profile("gpu")]).submit(0.5).result()
        # idle past the timeout: the cluster closes, a second lifetime follows
        _until(lambda: _status()["gpu"]["state"] == "closed", "the idle 'gpu' cluster closed")
        second = hold.with_options(tags=[profile("gpu")]).submit(0.2).result()
        return FlowRunContext.get().flow_run.id, first, second

    run_id, *_ = f()
    arts = _artifacts(run_id, "resource-ledger")
    assert len(arts) == 1 and arts[0]["type"] == "table"
    rows = _table(arts[0])
    gpu_rows = [r for r in rows if r["profile"] == "gpu"]
    assert len(gpu_rows) == 2, rows
    assert gpu_rows[0]["reason"].startswith("scaled down, idle")
    assert gpu_rows[1]["reason"] == "flow run ended" or gpu_rows[1]["reason"].startswith("scaled down, idle")
    for r in gpu_rows:
        assert r["devices"].endswith("(H100 80 GiB)") and r["tasks"] == 1
        assert 0 < r["busy_s"] <= r["held_s"] and 0 < r["busy %"] <= 100
    assert gpu_rows[0]["busy_s"] >= 0.4, "the 0.5 s task is counted as busy time"
    assert "EMULATED" in arts[0]["description"]


@task
def mark_then_sleep(ready: str, seconds: float) -> None:
    Path(ready).write_text("started")
    time.sleep(seconds)


def test_a_task_running_when_the_flow_stops_counts_as_busy_and_raises_no_waste_alert(
    tmp_path: Path, monkeypatch
):
    """A GPU task still running when the flow run is interrupted (here the flow raises; Ctrl-C and
    SIGTERM close the same way) is busy from its start up to the close, and counted as a task: the
    row said `busy 0.0, 0 tasks`, and the summary raised a false held-busy alert."""
    monkeypatch.setenv("GPU_TASKS_TUNE_ALERT_MIN_HELD_SECONDS", "0")  # seconds held here, not minutes
    ready = tmp_path / "ready"
    box: list = []

    @flow(task_runner=runner(GPU))
    def interrupted():
        box.append((FlowRunContext.get().task_runner, FlowRunContext.get().flow_run.id))
        mark_then_sleep.with_options(tags=[profile("gpu")]).submit(str(ready), 120)
        _until(ready.exists, "the GPU task started")
        time.sleep(3.0)
        raise RuntimeError("the flow stops while its GPU task runs")

    with pytest.raises(RuntimeError, match="while its GPU task runs"):
        interrupted()
    runner_, run_id = box[0]
    [row] = [r for r in runner_.ledger if r.profile == "gpu"]
    assert row.reason.startswith("flow run ended"), row.reason
    assert row.tasks == 1 and 3.0 <= row.busy_seconds <= row.held_seconds, row.as_dict()
    assert row.interrupted == 1, row.as_dict()
    [span] = row.spans
    assert span.tasks == 1 and span.busy_seconds == pytest.approx(row.busy_seconds), span.as_dict()
    [table] = _artifacts(run_id, "resource-ledger")
    [gpu_row] = [r for r in _table(table) if r["profile"] == "gpu"]
    assert gpu_row["tasks"] == 1 and gpu_row["busy_s"] >= 3.0, gpu_row
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all(timeout=10)
    [summary] = flow_run_events(run_id, {"name": ["gpu-tasks.flow-run.summary"]})
    assert summary["resource"]["gpu-tasks.alert"] == "none", summary["resource"]


def test_a_cluster_whose_scheduler_process_was_killed_closes_at_once_and_keeps_its_row(tmp_path: Path):
    """A Prefect worker's cancel sends SIGTERM to the flow run's whole process group, the profile's
    scheduler process included: the close skips Dask's request to the dead scheduler, which retried
    the connection for 30 s (distributed.comm.timeouts.connect), and the row counts the task."""
    import signal

    ready = tmp_path / "ready"
    box: list = []

    @flow(task_runner=runner(GPU))
    def scheduler_killed():
        box.append(FlowRunContext.get().task_runner)
        mark_then_sleep.with_options(tags=[profile("gpu")]).submit(str(ready), 120)
        _until(ready.exists, "the GPU task started")
        scheduler = box[0]._live.states["gpu"].cluster.backend.cluster.scheduler
        os.kill(scheduler.warm.pid, signal.SIGTERM)
        _until(lambda: not scheduler.warm.process.is_alive(), "the scheduler process ended", 10)
        time.sleep(0.5)
        box.append(time.monotonic())
        raise RuntimeError("the flow stops after its scheduler died")

    with pytest.raises(RuntimeError, match="after its scheduler died"):
        scheduler_killed()
    took = time.monotonic() - box[1]
    assert took < 10, f"the runner closed {took:.1f}s after the flow stopped"
    [row] = [r for r in box[0].ledger if r.profile == "gpu"]
    assert row.tasks == 1 and row.busy_seconds > 0, row.as_dict()


def _seconds_of_day(hms: str) -> int:
    h, m, s = (int(x) for x in hms.split(":"))
    return h * 3600 + m * 60 + s


def _later_or_same(a: str, b: str) -> bool:
    """``b`` (HH:MM:SS) is ``a`` or up to an hour after it (across midnight too)."""
    return (_seconds_of_day(b) - _seconds_of_day(a)) % 86400 < 3600


def test_flow_run_gets_a_device_timeline_and_a_readable_ledger():
    """Two GPU profiles in sequence: the `device-timeline` markdown shows who held which device
    when, and how busy; the `resource-ledger` table is in time order with device names."""
    etl = ResourceProfile(name="etl", gpus=1, idle_timeout=30)
    train = ResourceProfile(name="train", gpus=2, idle_timeout=30)
    box = []

    @flow(task_runner=runner(etl, train))
    def f():
        box.append(FlowRunContext.get().task_runner)
        hold.submit(0.05).result()  # the default CPU profile: a row without devices
        hold.with_options(tags=[profile("etl")]).submit(1.0).result()
        # train needs both devices: the idle etl cluster gives device 0 back early
        hold.with_options(tags=[profile("train")]).submit(1.0).result()
        return FlowRunContext.get().flow_run.id

    run_id = f()
    ledger = box[0].ledger
    held = sum(r.held_seconds for r in ledger if r.devices)
    busy = sum(r.busy_seconds for r in ledger if r.devices)

    [table] = _artifacts(run_id, "resource-ledger")
    rows = _table(table)
    assert [r["profile"] for r in rows] == [r.profile for r in sorted(ledger, key=lambda r: r.provisioned_at)]
    assert [r["profile"] for r in rows] == ["cpu", "etl", "train"], rows
    starts = [r["held (UTC)"].split("–")[0] for r in rows]
    assert all(_later_or_same(a, b) for a, b in itertools.pairwise(starts)), starts
    assert rows[0]["devices"] == "none (CPU)"
    assert rows[1]["devices"] == "0 (H100 80 GiB)"  # EMULATED is in the description
    assert rows[2]["devices"] == "0,1 (H100 80 GiB)"
    assert rows[1]["reason"] == "released for 'train'"
    assert all(str(v).strip() not in {"-", "*", "+"} for r in rows for v in r.values()), rows
    description = table["description"]
    assert (
        description == f"Held {held:.1f} device-s, busy {busy:.1f} ({round(100 * busy / held)}%), EMULATED."
    )
    assert len(description) <= 60 and "..." not in description

    [timeline] = _artifacts(run_id, "device-timeline")
    assert timeline["type"] == "markdown"
    assert timeline["description"] == f"2 devices held {held:.1f} device-s, busy {busy:.1f} " + (
        f"({round(100 * busy / held)}%), EMULATED."
    )
    markdown = timeline["data"]
    assert markdown.startswith(f"**2 devices held {held:.1f} device-s"), markdown
    lines = [line for line in markdown.splitlines() if line.startswith("| ")]
    assert lines[0].startswith("| device | profile | held (UTC) |")
    cells = [[c.strip() for c in line.strip("|").split(" | ")] for line in lines[2:]]  # after the header
    assert [(c[0], c[1]) for c in cells] == [
        ("0", "etl"),
        ("0", "train"),
        ("1", "train"),
    ], markdown
    assert "\nDevices: 0, 1: H100 80 GiB, emulated.\n" in markdown
    spans = [c[2].split("–") for c in cells]
    assert all(_later_or_same(a, b) for a, b in spans), spans
    assert _later_or_same(spans[0][1], spans[1][0]), "device 0: etl gave it back before train took it"
    # emulated devices: said once above the table (no measured column, no right-size heading)
    assert lines[0].rstrip().endswith("| across the run |"), lines[0]
    assert "GPU use was not measured" in markdown and "Right-size" not in markdown, markdown
    for device, prof, _, held_s, busy_pct, tasks, bar in cells:
        assert 0 < float(held_s) and 0 < int(busy_pct) <= 100 and tasks == "1", (device, prof)
        assert bar.startswith("`") and bar.endswith("`") and len(bar) == 26, bar
        assert set(bar.strip("`")) <= set("#+-.") and re.search("[#+]", bar), bar
    # the strips line up in time: etl's busy part comes before train's on the same device
    assert re.search("[#+]", cells[0][6]).start() < re.search("[#+]", cells[1][6]).start()
    assert cells[0][6].rstrip("`").endswith("."), "etl no longer holds device 0 at the end of the run"


def test_cluster_lifecycle_events_relate_to_the_flow_run():
    """gpu-tasks.cluster.provisioned / .closed events land in the flow run's event feed."""
    from prefect.client.orchestration import get_client
    from prefect.events.worker import EventsWorker

    @flow(task_runner=runner(GPU))
    def f():
        hold.with_options(tags=[profile("gpu")]).submit(0.1).result()
        return FlowRunContext.get().flow_run.id

    run_id = f()
    EventsWorker.drain_all(timeout=10)

    async def read():
        async with get_client() as client:
            response = await client._client.post(
                "/events/filter",
                json={
                    "filter": {
                        "event": {"prefix": ["gpu-tasks.cluster."]},
                        "related": {"resources_in_roles": [[f"prefect.flow-run.{run_id}", "flow-run"]]},
                        "occurred": {"since": "2000-01-01T00:00:00Z"},
                        "order": "ASC",
                    },
                    "limit": 50,
                },
            )
            response.raise_for_status()
            return response.json()["events"]

    events = []
    for _ in range(40):  # the server persists events asynchronously
        events = asyncio.run(read())
        if len(events) >= 2:
            break
        time.sleep(0.25)
    names = [e["event"] for e in events]
    assert names == ["gpu-tasks.cluster.provisioned", "gpu-tasks.cluster.closed"], names
    closed = events[1]
    body_events = flow_run_events(run_id, {"prefix": ["gpu-tasks.device."]}, at_least=2)
    lease_events = [(e["event"], e["resource"]["prefect.resource.name"]) for e in body_events]
    device = f"GPU {closed['payload']['devices'][0]} (emulated)"
    assert lease_events == [
        ("gpu-tasks.device.leased", f"{device} to profile gpu"),
        ("gpu-tasks.device.released", f"{device} from profile gpu: flow run ended"),
    ]
    assert closed["resource"]["gpu-tasks.profile"] == "gpu"
    assert closed["resource"]["gpu-tasks.emulated"] == "true"
    assert closed["payload"]["reason"] == "flow run ended" and len(closed["payload"]["devices"]) == 1


def test_task_runs_carry_profile_and_device_tags():
    """The Prefect UI shows where each task ran: profile:<name>, gpu:<id>, gpu-tasks:emulated."""

    @flow(task_runner=runner(GPU))
    def f():
        on_gpu = hold.with_options(tags=[profile("gpu")]).submit(0.01)
        on_cpu = hold.submit(0.01)
        return on_gpu.result(), on_gpu.task_run_id, on_cpu.task_run_id

    row, gpu_run, cpu_run = f()

    # the server records the task runs from their events, a moment later
    gpu_tags = server_task_run(gpu_run, lambda r: "gpu-tasks:emulated" in (r.get("tags") or [])).get("tags")
    cpu_tags = server_task_run(cpu_run).get("tags")
    assert {"profile:gpu", f"gpu:{row['devices'][0]}", "gpu-tasks:emulated"} <= set(gpu_tags)
    assert not any(t.startswith("gpu") for t in cpu_tags), cpu_tags


def test_dashboard_link_artifact_when_dashboards_are_on(monkeypatch):
    monkeypatch.setenv("GPU_TASKS_DASHBOARD", "true")

    @flow(task_runner=runner(GPU))
    def f():
        hold.with_options(tags=[profile("gpu")]).submit(0).result()
        return FlowRunContext.get().flow_run.id, _status()["gpu"]["dashboard"]

    run_id, link = f()
    assert link and link.startswith("http://127.0.0.1:")
    code, arts = api(
        "POST",
        "/artifacts/filter",
        json={"artifacts": {"flow_run_id": {"any_": [str(run_id)]}, "key": {"any_": ["dask-dashboard-gpu"]}}},
    )
    assert code == 200 and len(arts) == 1, arts
    assert link in arts[0]["data"]


def test_flow_exit_waits_for_unawaited_cpu_tasks_without_deadlock():
    """A flow that returns without awaiting a running task: exit lets it finish, then closes."""
    import threading

    @flow(task_runner=runner(GPU))
    def f():
        hold.submit(0.5)  # never awaited
        return "done"

    box = {}
    t = threading.Thread(target=lambda: box.setdefault("out", f()), daemon=True)
    t.start()
    t.join(timeout=90)
    assert not t.is_alive(), "leaving the flow deadlocked"
    assert box["out"] == "done"


@task
def probe(i: int) -> dict:
    """What a task sees of its flow run, its task run and the settings."""
    from prefect import runtime
    from prefect.context import TagsContext, TaskRunContext
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    return {
        "i": i,
        "pid": os.getpid(),
        "flow_run_id": str(runtime.flow_run.id),
        "flow_name": runtime.flow_run.flow_name,
        "task_run_id": str(TaskRunContext.get().task_run.id),
        "tags": sorted(TagsContext.get().current_tags),
        "level": settings.logging.level,
        "api_url": str(settings.api.url),
        "profile": current_allocation().profile,
        "version_check": settings.client.server_version_check_enabled,
    }


def test_process_workers_get_each_flow_runs_own_context_and_settings():
    """Context and settings serialized once per flow run (and cached per worker) never go stale."""
    from prefect.settings import PREFECT_LOGGING_LEVEL, get_current_settings, temporary_settings

    quarter = probe.with_options(tags=[profile("quarter")])

    def batch(n: int) -> list[tuple[dict, str]]:
        futures = [quarter.submit(i) for i in range(n)]
        return [(f.result(), str(f.task_run_id)) for f in futures]

    @flow(task_runner=runner(QUARTER))
    def first() -> tuple[str, list, list]:
        with tags("batch-a"):
            a = batch(6)
        with temporary_settings({PREFECT_LOGGING_LEVEL: "ERROR"}), tags("batch-b"):
            b = batch(6)
        return str(FlowRunContext.get().flow_run.id), a, b

    @flow(task_runner=runner(QUARTER))
    def second() -> tuple[str, list]:
        with temporary_settings({PREFECT_LOGGING_LEVEL: "CRITICAL"}):
            return str(FlowRunContext.get().flow_run.id), batch(4)

    api_url = str(get_current_settings().api.url)
    level = get_current_settings().logging.level
    checks = get_current_settings().client.server_version_check_enabled
    first_id, a, b = first()
    second_id, c = second()
    assert first_id != second_id
    assert {row["pid"] for row, _ in a + b} - {os.getpid()}, "tasks ran in worker processes"
    for rows, run_id, flow_name, want_level, tag in (
        (a, first_id, "first", level, "batch-a"),
        (b, first_id, "first", "ERROR", "batch-b"),
        (c, second_id, "second", "CRITICAL", None),
    ):
        for row, task_run_id in rows:
            assert row["pid"] != os.getpid() and row["profile"] == "quarter"
            assert (row["flow_run_id"], row["flow_name"], row["task_run_id"]) == (
                run_id,
                flow_name,
                task_run_id,
            )
            assert row["level"] == want_level and row["api_url"] == api_url
            # this host's workers run the flow process's Prefect against the API it checked
            assert row["version_check"] is False and checks is True
            assert "profile:quarter" in row["tags"] and (tag is None or tag in row["tags"])
            assert not {"batch-a", "batch-b"} - {tag} & set(row["tags"]), row["tags"]
            body = server_task_run(task_run_id, lambda r: r["state_type"] == "COMPLETED")  # from events
            assert body["flow_run_id"] == run_id, body
            assert body["state_type"] == "COMPLETED" and "profile:quarter" in body["tags"]


def test_context_serializer_matches_prefects_serialize_context():
    """The runner's cached serialization is Prefect's ``serialize_context``, key for key."""
    import pickle
    import uuid

    from prefect.context import serialize_context
    from prefect.settings import PREFECT_LOGGING_LEVEL, temporary_settings

    from gpu_tasks.runner.payload import ContextSerializer
    from gpu_tasks.worker.blobs import Blob

    def plain(context: dict) -> dict:
        """The flow run context and settings travel pickled (gpu_tasks.worker.blobs): unpickled, with
        the flow (equal only to itself) by name."""
        out = {k: pickle.loads(v.data) if isinstance(v, Blob) else v for k, v in context.items()}
        run = out["flow_run_context"]
        return {**out, "flow_run_context": {**run, "flow": run["flow"].name}}

    def prefects(**kw) -> dict:
        out = serialize_context(**kw)
        run = out["flow_run_context"]
        return {**out, "flow_run_context": {**run, "flow": run["flow"].name}}

    @flow(task_runner=runner())
    def f() -> None:
        ser = ContextSerializer()
        asset = {"task": hold, "task_run_id": uuid.uuid4(), "task_inputs": {}, "copy_to_child_ctx": True}
        with tags("x"):
            ours, key = ser.serialize(asset_ctx_kwargs=asset)
            assert plain(ours) == prefects(asset_ctx_kwargs=asset)
            assert ser.serialize(asset_ctx_kwargs=asset) == (ours, key)  # the same blobs
        with temporary_settings({PREFECT_LOGGING_LEVEL: "ERROR"}):
            changed, other = ser.serialize()
            assert plain(changed) == prefects() and other != key

    f()


def test_a_flow_context_that_cannot_be_pickled_names_the_flow_and_the_fix():
    """A flow pickled by value takes the objects its body uses along; one that cannot be pickled (a
    lock, a future) fails the hand-off with an error that names the flow and what to change."""
    import threading

    from gpu_tasks.errors import GpuTasksError
    from gpu_tasks.runner.payload import ContextSerializer

    lock = threading.Lock()

    @flow
    def holds_a_lock() -> None:
        assert lock is not None  # the body uses it: the flow's pickle carries it
        with pytest.raises(GpuTasksError) as caught:
            ContextSerializer().serialize()
        message = str(caught.value)
        assert "flow 'holds-a-lock'" in message and "cannot pickle '_thread.lock'" in message
        assert "importable module" in message
        assert isinstance(caught.value.__cause__, TypeError)

    holds_a_lock()


@task
def no_limits_cache_ttl() -> tuple[float, float]:
    """(gpu-tasks' own "no limits" cache's time-to-live, Prefect's) in the process it runs in."""
    from prefect.concurrency import services

    from gpu_tasks.compat.prefect import _OWN_NO_LIMITS

    return _OWN_NO_LIMITS["cache"].ttl, services._no_limits_cache.ttl


def test_tag_limit_checks_are_cached_longer_in_flow_and_worker_processes(monkeypatch):
    """Every gpu-tasks task run has tags, so Prefect checks tag concurrency limits for each; gpu-tasks
    keeps the "no limits" answers longer, in a cache of its own, in the flow process and in worker
    processes, and leaves Prefect's 5 s cache as shipped."""
    import cachetools
    from prefect.concurrency import services

    monkeypatch.setattr(
        services, "_no_limits_cache", cachetools.TTLCache(maxsize=1000, ttl=5.0)
    )  # as shipped
    monkeypatch.setenv("GPU_TASKS_TUNE_TAG_LIMIT_CACHE_SECONDS", "45")

    @flow(task_runner=runner(QUARTER))
    def f():
        return (
            no_limits_cache_ttl.with_options(tags=[profile("quarter")]).submit().result(),
            no_limits_cache_ttl.submit().result(),
        )

    on_worker, in_flow_process = f()
    assert on_worker[0] >= 45 and in_flow_process[0] >= 45  # never shortened within a process
    assert on_worker[1] == 5.0 and in_flow_process[1] == 5.0  # Prefect's, as shipped


def test_an_existing_tag_concurrency_limit_is_still_enforced_on_process_workers(tmp_path: Path):
    """A Prefect concurrency limit on a tag (here limit 1) holds across a profile's worker slots,
    with the longer cache: only "no limits" answers are cached."""
    import uuid

    tag = f"one-at-a-time-{uuid.uuid4().hex[:8]}"
    status, body = api("POST", "/v2/concurrency_limits/", json={"name": f"tag:{tag}", "limit": 1})
    assert status == 201, body
    try:

        @flow(task_runner=runner(QUARTER))
        def f():
            limited = hold.with_options(tags=[profile("quarter"), tag])
            return [x.result() for x in limited.map([0.3] * 4)]

        rows = f()
        assert all(r["profile"] == "quarter" for r in rows)
        assert _overlaps([(r["start"], r["end"]) for r in rows]) == 1, rows

        # without the limit the same four tasks share the device's four quarter slots at once
        @flow(task_runner=runner(QUARTER))
        def g():
            met = gather.with_options(tags=[profile("quarter")])
            return [x.result() for x in met.map(unmapped(str(tmp_path)), range(4), unmapped(4))]

        assert all(r["met"] for r in g()), "four quarter tasks without a tag limit did not run at once"
    finally:
        api("DELETE", f"/v2/concurrency_limits/tag:{tag}")
