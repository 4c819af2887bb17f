"""Memory as the request: ``ResourceProfile(gpu_memory_per_task="20GiB")`` (docs/shared-hosts.md).

Pure checks of the profile's rules and the policy's packing, then real flows on emulated devices
against the session's Prefect test server: an 80 GiB device runs four 20 GiB tasks at once (a fifth
waits), two next to a program declared to use 30 GiB, and each worker sees its cap.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest
from prefect import flow, task
from test_other_programs import _end, _outsider

from gpu_tasks import (
    ProfileTaskRunner,
    ResourceProfile,
    UnsatisfiableProfileError,
    current_allocation,
    profile,
)
from gpu_tasks.devices.discovery import Device, Inventory
from gpu_tasks.errors import GpuOutOfMemoryError, ProfileError
from gpu_tasks.policy import (
    GPU_MEMORY_RESOURCE,
    GPU_RESOURCE,
    desired_workers,
    memory_slots,
    task_resources,
    unsatisfiable_reason,
    worker_spec,
)

GiB = 2**30
MEM = ResourceProfile(name="mem", gpu_memory_per_task="20GiB", idle_timeout=30)


def _device(memory: int | None = 80 * GiB, address: str = "0") -> Device:
    name = "H100 (emulated)"
    return Device(address=address, index=int(address), name=name, memory_total=memory, emulated=True)


# ----------------------------------------------------------------------------- the profile
def test_the_field_parses_sizes_and_makes_a_gpu_profile_of_one_device_per_worker():
    assert MEM.gpu_memory_per_task == 20 * GiB and MEM.is_gpu and MEM.by_memory
    assert MEM.devices_per_worker == 1 and MEM.gpus == 0
    assert ResourceProfile(name="m", gpu_memory_per_task=GiB, gpu_model="H100").gpu_model == "H100"


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"gpus": 0.25}, ["gpu_memory_per_task (20GiB) and gpus (0.25) exclude each other", "remove gpus"]),
        (
            {"address": "tcp://h:8786"},
            ["applies to local profiles, not to this address", "use gpus=1/k there"],
        ),
        ({"processes": False}, ["processes=False is not possible"]),
    ],
)
def test_construction_refuses_what_cannot_go_with_it_naming_the_fix(fields, words):
    with pytest.raises(ProfileError) as info:
        ResourceProfile(name="m", gpu_memory_per_task="20GiB", **fields)
    for w in words:
        assert w in str(info.value)


def test_a_profiles_file_sets_it_and_a_deployment_describes_it():
    from gpu_tasks.deployments import describe_profile
    from gpu_tasks.profiles import profiles_from_mapping

    loaded = profiles_from_mapping({"profiles": {"infer": {"gpu_memory_per_task": "20GiB"}}})
    assert loaded["infer"].gpu_memory_per_task == 20 * GiB
    assert describe_profile(loaded["infer"]).startswith("infer: 20 GiB of device memory per task")


def test_a_size_that_is_no_size_names_the_field():
    with pytest.raises(ProfileError, match="gpu_memory_per_task must be a size such as '16GiB'"):
        ResourceProfile(name="m", gpu_memory_per_task="lots")


# ----------------------------------------------------------------------------- the policy
def test_tasks_per_device_are_free_or_total_memory_over_the_request():
    assert memory_slots(MEM, _device()) == 4  # free unknown: the total
    assert memory_slots(MEM, _device(), free=50 * GiB) == 2  # another program uses 30 GiB
    assert memory_slots(MEM, _device(None)) == 1  # memory unknown: one at a time
    assert memory_slots(MEM, _device(), free=5 * GiB) == 1  # never 0: the lease asked for one share


def test_the_worker_spec_carries_slots_resources_and_the_cap():
    spec = worker_spec(MEM, 0, (_device(),), emulated=True, free=70 * GiB)
    assert spec.nthreads == 3
    assert spec.resources == {GPU_RESOURCE: 1.0, GPU_MEMORY_RESOURCE: float(60 * GiB)}
    assert spec.env["_GPU_TASKS_WORKER_GPU_MEMORY_PER_TASK"] == str(20 * GiB)
    assert spec.env["_GPU_TASKS_WORKER_GPU_MEMORY_LIMIT"] == str(60 * GiB)
    assert task_resources(MEM) == {GPU_MEMORY_RESOURCE: float(20 * GiB)}
    # gpus= profiles are as before
    quarter = ResourceProfile(name="q", gpus=0.25)
    assert task_resources(quarter) == {GPU_RESOURCE: 0.25}
    assert worker_spec(quarter, 0, (_device(),), emulated=True).resources == {GPU_RESOURCE: 1.0}


def test_workers_grow_by_the_slots_their_devices_tell():
    assert desired_workers(MEM, outstanding=6, current=0, limit=2) == 1  # the first device tells
    assert desired_workers(MEM, outstanding=4, current=1, limit=2, slots=4) == 1
    assert desired_workers(MEM, outstanding=5, current=1, limit=2, slots=4) == 2


def test_a_request_above_every_device_names_request_devices_and_fix():
    inv = Inventory(source="emulated", devices=[_device(), _device(address="1")])
    big = ResourceProfile(name="big", gpu_memory_per_task="100GiB")
    reason = unsatisfiable_reason(big, inv) or ""
    assert "gpu_memory_per_task=100.0GiB" in reason and "more than any matching device's memory" in reason
    assert "0: H100 (emulated)" in reason and "Lower gpu_memory_per_task to at most 80.0GiB" in reason
    assert unsatisfiable_reason(MEM, inv) is None


# ----------------------------------------------------------------------------- real flows
@task
def share(folder: str, n: int, seconds: float = 1.0) -> dict:
    """Wait (up to 60 s) until ``n`` tasks have arrived, hold the slot ``seconds``; what it saw."""
    from gpu_tasks.worker import memory_caps

    Path(folder, uuid.uuid4().hex).write_text("")
    deadline = time.time() + 60
    while len(list(Path(folder).iterdir())) < n and time.time() < deadline:
        time.sleep(0.02)
    start = time.time()
    time.sleep(seconds)
    a = current_allocation()
    return {
        "start": start,
        "end": time.time(),
        "pid": os.getpid(),
        "devices": a.devices,
        "memory_per_task": a.memory_per_task,
        "memory_limit": a.memory_limit,
        "env_limit": os.environ.get("_GPU_TASKS_WORKER_GPU_MEMORY_LIMIT"),
        "applied": memory_caps.applied(),
    }


def _most_at_once(rows: list[dict]) -> int:
    return max(sum(1 for o in rows if o["start"] < r["start"] < o["end"]) + 1 for r in rows)


def _run(tmp_path: Path, tasks: int, meet: int) -> list[dict]:
    t = share.with_options(tags=[profile("mem")])

    @flow(task_runner=ProfileTaskRunner(profiles=[MEM]))
    def f() -> list[dict]:
        return [x.result() for x in [t.submit(str(tmp_path), meet) for _ in range(tasks)]]

    return f()


@pytest.mark.usefixtures("no_leaked_processes", "lease_dir")
def test_an_80gib_device_runs_four_20gib_tasks_at_once_a_fifth_waits_and_the_worker_sees_its_cap(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "H100:80GiB")
    rows = _run(tmp_path, tasks=5, meet=4)
    assert _most_at_once(rows) == 4
    assert {r["devices"] for r in rows} == {("0",)} and len({r["pid"] for r in rows}) == 1
    r = rows[0]
    assert (r["memory_per_task"], r["memory_limit"], r["env_limit"]) == (20 * GiB, 80 * GiB, str(80 * GiB))
    assert r["applied"]["limit"] == 80 * GiB and r["applied"]["emulated"] is True
    assert r["applied"]["capped"]["cupy"] == "not capped: emulated device (no allocator)"


@pytest.mark.usefixtures("no_leaked_processes", "lease_dir")
def test_next_to_a_program_using_30gib_it_runs_two(tmp_path, monkeypatch):
    pid = _outsider()
    try:
        monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", f"H100:80GiB@{pid}:30GiB")
        monkeypatch.setenv("GPU_TASKS_OTHER_PROGRAMS_MEMORY", "40GiB")  # let gpu-tasks share the device
        rows = _run(tmp_path, tasks=3, meet=2)
    finally:
        _end(pid)
    assert _most_at_once(rows) == 2
    assert rows[0]["memory_limit"] == 40 * GiB


@pytest.mark.usefixtures("lease_dir")
def test_a_request_above_every_device_fails_at_submit_with_the_fix(monkeypatch):
    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "H100:80GiB")
    big = ResourceProfile(name="big", gpu_memory_per_task="100GiB")
    t = share.with_options(tags=[profile("big")])

    @flow(task_runner=ProfileTaskRunner(profiles=[big]))
    def f() -> None:
        t.submit("/nonexistent", 1).result()

    with pytest.raises(UnsatisfiableProfileError, match="Lower gpu_memory_per_task to at most 80.0GiB"):
        f()


@task
def allocate(nbytes: int) -> int:
    """Stand in for an allocator capped to the worker's share: past the cap, its out-of-memory."""
    limit = current_allocation().memory_limit or 0
    if nbytes > limit:
        raise MemoryError(f"out of memory allocating {nbytes} bytes (past the worker's cap of {limit})")
    time.sleep(0.5)
    return nbytes


@pytest.mark.usefixtures("no_leaked_processes", "lease_dir")
def test_a_task_past_the_cap_fails_in_its_own_run_and_its_neighbours_complete(monkeypatch):
    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "H100:80GiB")
    t = allocate.with_options(tags=[profile("mem")])

    @flow(task_runner=ProfileTaskRunner(profiles=[MEM]))
    def f() -> list:
        futures = [t.submit(n * GiB) for n in (10, 90, 10)]
        return [x.wait() or x.state for x in futures]

    states = f()
    assert [s.is_completed() for s in states] == [True, False, True]
    with pytest.raises(GpuOutOfMemoryError, match=r"profile 'mem', device\(s\) 0 \(emulated\)"):
        states[1].result()


CAPPED_SCRIPT = """
from prefect import flow, task
from gpu_tasks import ProfileTaskRunner, ResourceProfile, profile

@task(tags=[profile("mem")])
def one() -> int:
    return 1

@flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="mem", gpu_memory_per_task="20GiB")]))
def f() -> int:
    return one.submit().result()

if __name__ == "__main__":
    print("RESULT", f())
"""


@pytest.mark.usefixtures("prefect_server")
def test_the_worker_logs_what_it_capped_where_the_user_runs_the_flow(tmp_path):
    """docs/shared-hosts.md: what was applied is logged by the worker. A worker's loggers are at
    Prefect's WARNING, which dropped that INFO line: it never reached the terminal."""
    import subprocess
    import sys

    from faults._procs import clean_env, kill_marked
    from prefect.settings import get_current_settings

    marker = uuid.uuid4().hex
    (tmp_path / "capped.py").write_text(CAPPED_SCRIPT)
    env = clean_env(
        marker, GPU_TASKS_EMULATED_GPUS="H100:80GiB", PREFECT_API_URL=str(get_current_settings().api.url)
    )
    try:
        out = subprocess.run(
            [sys.executable, "capped.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
        )
    finally:
        kill_marked(marker)
    assert out.returncode == 0 and "RESULT 1" in out.stdout, out.stderr[-3000:]
    [line] = [ln for ln in out.stderr.splitlines() if "worker allocators capped to 80.00 GiB" in ln]
    assert "'cupy': 'not capped: emulated device (no allocator)'" in line, line
