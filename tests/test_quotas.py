"""Team quotas kept in Prefect global concurrency limits: validation, the CLI, fail-fast, and
four flow-run processes that never hold more of a quota's devices than its limit.

Every test runs against the session's real Prefect server; subprocess flow runs use the
script of tests/test_preemption.py.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
from prefect import flow, task
from test_preemption import _finish, _start
from typer.testing import CliRunner

from gpu_tasks import ClusterError, ProfileError, ProfileTaskRunner, ResourceProfile, profile
from gpu_tasks.cli import app
from gpu_tasks.devices import leases
from gpu_tasks.prefect_api import quotas

CPU = ResourceProfile(name="cpu", cpus=0.5)


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


@pytest.fixture
def quota(prefect_server, request):
    """A fresh quota name for the test; deleted afterwards."""
    name = f"q-{request.node.name[:20].replace('_', '-')}-{random.randrange(10**6)}"
    yield name
    quotas.delete_limit(name)


def test_quota_needs_a_gpu_profile_not_a_cluster_class_and_a_plain_name():
    with pytest.raises(ProfileError, match="quota applies to GPU profiles"):
        ResourceProfile(name="cpu", cpus=1, quota="team-a")
    with pytest.raises(ProfileError, match="not to this cluster_class profile"):
        ResourceProfile(name="slurm", gpus=1, quota="team-a", cluster_class="a.B", max_workers=2)
    assert ResourceProfile(name="far", gpus=1, quota="team-a", address="tcp://10.0.0.5:8786").quota
    with pytest.raises(ProfileError, match="quota must be a name"):
        ResourceProfile(name="gpu", gpus=1, quota="team a/b")
    assert ResourceProfile(name="gpu", gpus=1, quota="team-a").quota == "team-a"


def test_cli_sets_lists_and_deletes_a_quota(quota):
    code, out = _cli("quotas", "set", quota, "3")
    assert code == 0 and f"quota {quota!r}: at most 3 device(s)" in out, out
    code, out = _cli("quotas", "--json")
    assert code == 0, out
    import json

    [row] = [q for q in json.loads(out)["quotas"] if q["quota"] == quota]
    assert (row["limit"], row["in_use"], row["holders_here"]) == (3, 0, [])
    code, out = _cli("quotas", "set", quota, "2")  # changed, not duplicated
    assert code == 0 and [q["limit"] for q in quotas.usage() if q["quota"] == quota] == [2]
    for bad in ("0", "-1"):  # a negative count is the count, not an unknown option
        code, out = _cli("quotas", "set", quota, bad)
        assert code == 2 and f"devices must be at least 1 (got {bad})" in out, out
    code, out = _cli("quotas", "delete", quota)
    assert code == 0 and quota not in [q["quota"] for q in quotas.usage()]
    code, out = _cli("quotas", "delete", quota)  # a name the user gave: exit 2, as operations.md says
    assert code == 2 and "no quota" in out and "gpu-tasks quotas lists them" in out, out


@task
def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@pytest.mark.usefixtures("no_leaked_processes", "emulated")
def test_a_request_larger_than_its_quota_fails_fast_naming_the_fix(quota):
    quotas.set_limit(quota, 1)
    gang = ResourceProfile(name="gang", gpus=1, max_workers=2, gang=True, quota=quota)

    @flow(task_runner=ProfileTaskRunner(profiles=[CPU, gang], default="cpu"))
    def too_big():
        return nap.with_options(tags=[profile("gang")]).submit(0.1).result()

    started = time.monotonic()
    with pytest.raises(ClusterError) as err:
        too_big()
    assert time.monotonic() - started < 60  # no waiting for room that can never come
    assert f"needs 2 device(s) at once but quota {quota!r} allows 1" in str(err.value)
    assert f"gpu-tasks quotas set {quota} 2" in str(err.value)


@pytest.mark.usefixtures("no_leaked_processes", "emulated")
def test_a_quota_without_a_limit_says_how_to_create_it(quota):
    gpu = ResourceProfile(name="gpu", gpus=1, quota=quota)

    @flow(task_runner=ProfileTaskRunner(profiles=[CPU, gpu], default="cpu"))
    def no_limit():
        return nap.with_options(tags=[profile("gpu")]).submit(0.1).result()

    with pytest.raises(
        ClusterError,
        match=rf"profile 'gpu': quota {quota!r} has no limit: create it with `gpu-tasks quotas set",
    ):
        no_limit()


@pytest.mark.usefixtures("no_leaked_processes")
def test_four_flow_runs_never_hold_more_than_the_quota(quota, tmp_path, lease_dir):
    """Four flow runs of one quota (limit 2) on four emulated devices, with random sizes, task
    lengths and start times, submitting together: never more than 2 of the quota's devices in use (task bodies
    and the limit's own count, sampled), no deadlock, every result back, nothing left held."""
    quotas.set_limit(quota, 2)
    rng = random.Random(7)
    samples: list[int] = []
    stop = threading.Event()
    go = tmp_path / "go"

    def sample() -> None:
        while not stop.wait(0.1):
            rows = [q for q in quotas.usage(leases.holders(lease_dir)) if q["quota"] == quota]
            if rows:
                samples.append(rows[0]["in_use"])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    procs = {}
    try:
        for n in range(4):
            holder = {
                "name": f"t{n}",
                "gpus": 1,
                "max_workers": rng.choice([1, 2]),
                "quota": quota,
                "idle_timeout": 0.3,
            }
            procs[f"run{n}"] = _start(
                tmp_path,
                lease_dir,
                f"run{n}",
                holder,
                3,
                rng.uniform(0.3, 1.2),
                go=go,
                # a task holds its device until another run waits for room in the quota: on a
                # loaded machine the runs' leases came seconds apart, each found the quota free and
                # none waited (the test would show nothing; 1 of 2 parallel phases on 2026-12-04);
                # ending the hold at any wait (for a device another run had leased a moment) let
                # the runs finish before any met the full quota (a clean-clone CI run, stop 63)
                hold_for="*",
                GPU_TASKS_EMULATED_GPUS="4",
            )
            time.sleep(rng.uniform(0.0, 0.8))
        # all four submit together once all are in their flow runs (on a loaded machine, runs
        # started apart could each find the quota free and none wait: the test would show nothing)
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("go.*.ready"))) < 4:
            assert all(p.poll() is None for p in procs.values()), _finish(procs, tmp_path)
            assert time.monotonic() < deadline, "the flow runs did not start"
            time.sleep(0.1)
        go.touch()
        outs = _finish(procs, tmp_path)
    finally:
        stop.set()
        sampler.join(timeout=10)
    spans = []
    for name, out in outs.items():
        assert sorted(r["i"] for r in out["results"]) == [0, 10, 20], (name, out["results"])
        spans += [(r["start"], r["end"]) for r in out["results"]]
    points = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    running = most = 0
    for _, step in points:
        running += step
        most = max(most, running)
    assert most <= 2, f"{most} tasks of quota {quota!r} ran at once"
    assert samples and max(samples) <= 2, samples
    assert max(samples) == 2  # the quota was used up at times: the runs had to share it
    waited = [out["log"] for out in outs.values() if f"waiting for room in quota {quota!r}" in out["log"]]
    said = [f"{name}: {line}" for name, out in outs.items() for line in out["log"].splitlines()]
    assert waited, "no flow run waited for the quota:\n" + "\n".join(s for s in said if "profile '" in s)
    assert "held on this host by device" in waited[0]
    [row] = [q for q in quotas.usage(leases.holders(lease_dir)) if q["quota"] == quota]
    assert row["in_use"] == 0 and row["holders_here"] == []


def test_fair_share_serves_the_team_that_used_less_and_the_cli_shows_it(quota, lease_dir):
    """Fair share, wired end to end on a real device book, lease directory and quota limits: a team's
    held device-seconds are recorded when it gives the device back; then a waiter of another flow run
    (a waiter file) of that team, though it arrived first, lets a profile of an unused team of equal
    priority go first; with the half-life at 0, arrival order again. ``gpu-tasks quotas`` shows both."""
    import json

    from gpu_tasks.devices import fair_share
    from gpu_tasks.devices.book import DeviceBook
    from gpu_tasks.devices.discovery import Device

    heavy, light = f"{quota}-a", f"{quota}-b"
    dev0 = (Device(address="0", index=0, name="EMU"),)
    book = DeviceBook(lease_dir=lease_dir, lease_timeout=5, fair_share_half_life=3600)
    waiter = None
    try:
        quotas.set_limit(heavy, 1)
        quotas.set_limit(light, 1)
        assert book.acquire("train-a", [dev0], 1, block=False, quota=heavy) == [0]
        time.sleep(0.5)
        book.release("train-a", ["0"])
        used = fair_share.read(lease_dir)
        assert 0.5 <= used[heavy] < 5 and light not in used, used
        # another flow run's waiter of the heavy team, arrived first
        info = dict(leases.owner_info("train-a2"), quota=heavy)
        waiter = leases.enqueue(["0"], info, priority=0, arrived=time.time() - 5, lease_dir=lease_dir)
        off = DeviceBook(lease_dir=lease_dir, lease_timeout=5, fair_share_half_life=0)
        assert off.acquire("train-b", [dev0], 1, block=False, quota=light) == [], "off: arrival order"
        assert book.acquire("train-b", [dev0], 1, block=False, quota=light) == [0], "the unused team first"
        book.release("train-b", ["0"])
        code, out = _cli("quotas", "--json")
        assert code == 0, out
        rows = {q["quota"]: q for q in json.loads(out)["quotas"]}
        assert rows[heavy]["usage_device_seconds"] >= 0.5 and rows[heavy]["share"] > 0.5, rows[heavy]
        assert rows[light]["share"] < 0.5, rows[light]
        code, out = _cli("quotas")
        assert code == 0 and "Share" in out and heavy in out, out
    finally:
        leases.dequeue(waiter)
        book.close()
        quotas.delete_limit(heavy)
        quotas.delete_limit(light)


def test_a_quota_wait_that_times_out_names_the_quota_not_free_devices(quota, lease_dir):
    """A waiter whose team's quota is full (held elsewhere: another host, or a killed flow run whose
    slots free when their lease ends) gives up after GPU_TASKS_LEASE_TIMEOUT naming the quota and its
    fixes (before: "waited ... for devices other processes on this host lease (device 0: free)")."""
    from gpu_tasks.devices.book import DeviceBook
    from gpu_tasks.devices.discovery import Device

    quotas.set_limit(quota, 1)
    elsewhere = quotas.QuotaSlots(60)
    book = DeviceBook(lease_dir=lease_dir, lease_timeout=2)
    try:
        assert elsewhere.take(quota, 1) is not None
        dev0 = (Device(address="0", index=0, name="EMU"),)
        with pytest.raises(ClusterError) as err:
            book.acquire("train", [dev0], 1, block=True, quota=quota)
        message = str(err.value)
        assert "waited" in message and f"for room in quota {quota!r}" in message, message
        assert "1 of 1 device(s) in use" in message and "a killed flow run's slots free" in message, message
        assert f"gpu-tasks quotas set {quota} N" in message and "GPU_TASKS_LEASE_TIMEOUT" in message, message
        assert "on this host lease" not in message, message
    finally:
        book.close()
        elsewhere.close()
