"""Pure scheduling decisions of gpu_tasks.policy: no clusters, no processes."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_tasks.allocation import WORKER_ENV_DEVICES, WORKER_ENV_EMULATED, WORKER_ENV_PROFILE
from gpu_tasks.devices.discovery import Device, Inventory, parse_emulated
from gpu_tasks.policy import (
    GPU_RESOURCE,
    IdleView,
    bound_at_most,
    close_reason,
    desired_workers,
    device_groups,
    matching_devices,
    max_worker_count,
    slots_per_worker,
    task_resources,
    unsatisfiable_reason,
    worker_spec,
)
from gpu_tasks.profiles import MAX_SHARE, ResourceProfile

GiB = 2**30


def _inventory(spec: str = "H100:80GiB,H100:80GiB,L4:24GiB,A10G:24GiB") -> Inventory:
    return Inventory(devices=parse_emulated(spec), source="emulated", detail="test")


def _dev(i: int, name: str = "NVIDIA H100 80GB HBM3", memory: int | None = 80 * GiB) -> Device:
    return Device(address=str(i), index=i, name=name, memory_total=memory, memory_free=memory)


# --------------------------------------------------------- matching_devices
@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("H100", ["0", "1"]),
        ("h100", ["0", "1"]),
        ("l4", ["2"]),
        ("a10", ["3"]),
        ("emulated", ["0", "1", "2", "3"]),
        ("A100", []),
    ],
)
def test_matching_by_model_is_a_case_insensitive_substring(model, expected):
    prof = ResourceProfile(name="g", gpus=1, gpu_model=model)
    assert [d.address for d in matching_devices(prof, _inventory())] == expected


@pytest.mark.parametrize(
    ("memory", "expected"),
    [
        (None, ["0", "1", "2", "3"]),
        ("24GiB", ["0", "1", "2", "3"]),
        ("25GiB", ["0", "1"]),
        ("80GiB", ["0", "1"]),
        ("81GiB", []),
    ],
)
def test_matching_by_memory_is_a_minimum(memory, expected):
    prof = ResourceProfile(name="g", gpus=1, gpu_memory_total=memory)
    assert [d.address for d in matching_devices(prof, _inventory())] == expected


def test_matching_by_model_and_memory_together():
    prof = ResourceProfile(name="g", gpus=1, gpu_model="a10", gpu_memory_total="25GiB")
    assert matching_devices(prof, _inventory()) == []
    prof = ResourceProfile(name="g", gpus=1, gpu_model="H1", gpu_memory_total="40GiB")
    assert len(matching_devices(prof, _inventory())) == 2


def test_unknown_memory_never_satisfies_a_memory_request():
    inv = Inventory(devices=(_dev(0, memory=None), _dev(1)), source="command")
    assert [
        d.address for d in matching_devices(ResourceProfile(name="g", gpus=1, gpu_memory_total="1GiB"), inv)
    ] == ["1"]
    assert len(matching_devices(ResourceProfile(name="g", gpus=1), inv)) == 2


# ------------------------------------------------------ unsatisfiable_reason
def test_cpu_profiles_are_always_satisfiable():
    assert unsatisfiable_reason(ResourceProfile(name="cpu"), Inventory()) is None


def test_satisfiable_gpu_profile():
    assert unsatisfiable_reason(ResourceProfile(name="g", gpus=0.25, gpu_model="L4"), _inventory()) is None
    assert unsatisfiable_reason(ResourceProfile(name="g", gpus=2, gpu_model="H100"), _inventory()) is None


def test_reason_without_devices_names_request_and_why():
    inv = Inventory(devices=(), source="none", detail="no NVIDIA driver (NVMLError_LibraryNotFound)")
    reason = unsatisfiable_reason(ResourceProfile(name="train", gpus=1), inv)
    assert reason is not None
    assert "profile 'train'" in reason and "gpus=1" in reason
    assert "no NVIDIA driver" in reason


def test_reason_when_no_device_matches_names_request_and_inventory():
    reason = unsatisfiable_reason(
        ResourceProfile(name="big", gpus=1, gpu_model="A100", gpu_memory_total="40GiB"), _inventory()
    )
    assert reason is not None
    assert "profile 'big'" in reason
    assert "gpu_model='A100'" in reason and "gpu_memory_total>=40.0GiB" in reason
    assert "no device matches" in reason
    assert "4 emulated device(s)" in reason and "H100 (emulated)" in reason and "L4 (emulated)" in reason


def test_reason_when_too_few_matching_devices_for_one_task():
    reason = unsatisfiable_reason(ResourceProfile(name="wide", gpus=3, gpu_model="H100"), _inventory())
    assert reason is not None
    assert "profile 'wide'" in reason and "gpus=3" in reason
    assert "only 2 matching device(s)" in reason and reason.endswith("Lower gpus to at most 2")


@pytest.mark.parametrize(
    ("filters", "fix"),
    [
        ({"gpu_model": "A100"}, "Change gpu_model to match a device"),
        ({"gpu_memory_total": "100GiB"}, "Lower gpu_memory_total to match a device"),
        ({"gpu_memory_free": "90GiB"}, "Lower gpu_memory_free to match a device"),
        ({"gpu_model": "H100", "gpu_memory_free": "90GiB"}, "Lower gpu_memory_free to match a device"),
        ({"gpu_model": "L4", "gpu_memory_total": "40GiB"}, "Change gpu_model or lower gpu_memory_total to"),
        ({"gpu_model": "A100", "gpu_memory_total": "100GiB"}, "Change gpu_model and lower gpu_memory_total"),
    ],
)
def test_a_memory_request_whose_other_filters_match_nothing_names_the_filter_at_fault(filters, fix):
    """gpu_memory_per_task is blamed only when the other filters alone match a device."""
    prof = ResourceProfile(name="m", gpu_memory_per_task="8GiB", **filters)
    reason = unsatisfiable_reason(prof, _inventory()) or ""
    assert "no device matches" in reason and fix in reason, reason
    assert "gpu_memory_per_task to at most" not in reason, reason
    too_big = ResourceProfile(name="m", gpu_memory_per_task="30GiB", gpu_model="L4")
    reason = unsatisfiable_reason(too_big, _inventory()) or ""
    assert reason.endswith(
        "Lower gpu_memory_per_task to at most 24.0GiB or run the profile on a host with larger devices"
    )


@given(k=st.integers(min_value=2, max_value=MAX_SHARE), n=st.integers(min_value=0, max_value=8))
def test_fractional_needs_one_device(k, n):
    reason = unsatisfiable_reason(ResourceProfile(name="f", gpus=1 / k), _inventory(str(n)))
    assert (reason is None) == (n >= 1)


# ------------------------------------------------------------ device_groups
def test_two_gpu_tasks_on_five_devices_make_two_groups():
    devices = [_dev(i) for i in range(5)]
    groups = device_groups(ResourceProfile(name="g", gpus=2), devices)
    assert [[d.address for d in g] for g in groups] == [["0", "1"], ["2", "3"]]


def test_max_workers_caps_workers_not_eligible_devices():
    devices = [_dev(i) for i in range(5)]
    capped = ResourceProfile(name="g", gpus=2, max_workers=1)
    assert len(device_groups(capped, devices)) == 2, "either pair may be taken"
    assert max_worker_count(capped, len(device_groups(capped, devices))) == 1
    three = ResourceProfile(name="g", gpus=1, max_workers=3)
    assert len(device_groups(three, devices)) == 5 and max_worker_count(three, 5) == 3
    assert len(device_groups(ResourceProfile(name="g", gpus=0.5), devices)) == 5


def test_no_groups_for_cpu_or_too_few_devices():
    devices = [_dev(i) for i in range(3)]
    assert device_groups(ResourceProfile(name="c"), devices) == []
    assert device_groups(ResourceProfile(name="g", gpus=4), devices) == []


@given(
    per=st.integers(min_value=1, max_value=8),
    n=st.integers(min_value=0, max_value=32),
    cap=st.one_of(st.none(), st.integers(min_value=1, max_value=10)),
)
def test_groups_are_disjoint_and_full(per, n, cap):
    devices = [_dev(i) for i in range(n)]
    prof = ResourceProfile(name="g", gpus=per, max_workers=cap)
    groups = device_groups(prof, devices)
    assert len(groups) == n // per
    assert max_worker_count(prof, len(groups)) == (n // per if cap is None else min(cap, n // per))
    assert all(len(g) == per for g in groups)
    used = [d.address for g in groups for d in g]
    assert len(used) == len(set(used))


# ---------------------------------------------------------- slots_per_worker
@pytest.mark.parametrize(
    ("fields", "cores", "slots"),
    [
        ({"gpus": 0.25}, None, 4),
        ({"gpus": 0.5}, None, 2),
        ({"gpus": 1 / 64}, None, 64),
        ({"gpus": 1}, None, 1),
        ({"gpus": 2}, None, 1),
        ({"cpus": 0.5}, 2, 4),
        ({"cpus": 1}, 2, 2),
        ({"cpus": 3}, 2, 1),
        ({"cpus": 0.3}, 3, 10),
        ({"cpus": 1.5}, 4, 2),
    ],
)
def test_slots_per_worker(fields, cores, slots):
    assert slots_per_worker(ResourceProfile(name="p", **fields), cores) == slots


def test_max_worker_count():
    assert max_worker_count(ResourceProfile(name="g", gpus=1), groups=3) == 3
    assert max_worker_count(ResourceProfile(name="g", gpus=1, max_workers=2), groups=3) == 2
    assert max_worker_count(ResourceProfile(name="c"), groups=0) == 1
    assert max_worker_count(ResourceProfile(name="c", max_workers=4), groups=0) == 4


# ------------------------------------------------------------ desired_workers
@settings(max_examples=300)
@given(
    k=st.integers(min_value=1, max_value=MAX_SHARE),
    outstanding=st.integers(min_value=0, max_value=1000),
    current=st.integers(min_value=0, max_value=20),
    limit=st.integers(min_value=1, max_value=20),
)
def test_fractional_tasks_fill_a_device_before_the_next(k, outstanding, current, limit):
    prof = ResourceProfile(name="f", gpus=1 / k if k > 1 else 1)
    got = desired_workers(prof, outstanding, current, limit)
    assert got == max(current, min(limit, math.ceil(outstanding / k)))
    assert got >= current  # never shrinks


@pytest.mark.parametrize(
    ("outstanding", "expected"), [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3), (100, 3)]
)
def test_quarter_device_packing(outstanding, expected):
    prof = ResourceProfile(name="q", gpus=0.25)
    assert desired_workers(prof, outstanding, current=0, limit=3) == expected


def test_never_shrinks_when_work_drains():
    prof = ResourceProfile(name="g", gpus=1)
    assert desired_workers(prof, outstanding=0, current=3, limit=4) == 3
    assert desired_workers(prof, outstanding=1, current=3, limit=4) == 3


def test_gang_asks_for_all_workers_at_once():
    prof = ResourceProfile(name="train", gpus=1, gang=True, max_workers=4)
    assert desired_workers(prof, outstanding=1, current=0, limit=4) == 4
    assert desired_workers(prof, outstanding=0, current=0, limit=4) == 4


def test_cpu_profile_uses_one_worker():
    prof = ResourceProfile(name="c", max_workers=4)
    assert desired_workers(prof, outstanding=0, current=0, limit=4) == 0
    assert desired_workers(prof, outstanding=50, current=0, limit=4) == 1
    assert desired_workers(prof, outstanding=50, current=2, limit=4) == 2


def test_no_capacity_means_no_workers():
    assert desired_workers(ResourceProfile(name="g", gpus=1), outstanding=10, current=0, limit=0) == 0


# --------------------------------------------------------------- close_reason
@settings(max_examples=300)
@given(
    running=st.booleans(),
    outstanding=st.integers(min_value=1, max_value=10_000),
    idle_since=st.one_of(st.none(), st.floats(min_value=0, max_value=1e6)),
    timeout=st.floats(min_value=0, max_value=1e4),
    later=st.floats(min_value=0, max_value=1e7),
)
def test_never_closes_with_outstanding_work(running, outstanding, idle_since, timeout, later):
    view = IdleView(running=running, outstanding=outstanding, idle_since=idle_since, idle_timeout=timeout)
    assert close_reason(view, now=(idle_since or 0) + later) is None


def test_closes_once_the_timeout_has_passed():
    view = IdleView(running=True, outstanding=0, idle_since=100.0, idle_timeout=30.0)
    assert close_reason(view, now=100.0) is None
    assert close_reason(view, now=129.9) is None
    reason = close_reason(view, now=130.0)
    assert reason is not None and "idle for 30.0s" in reason and "idle_timeout=30s" in reason
    assert close_reason(view, now=500.0) is not None


def test_zero_timeout_closes_at_once():
    view = IdleView(running=True, outstanding=0, idle_since=5.0, idle_timeout=0.0)
    assert close_reason(view, now=5.0) is not None


def test_nothing_to_close():
    assert (
        close_reason(IdleView(running=False, outstanding=0, idle_since=0.0, idle_timeout=1), now=99) is None
    )
    assert (
        close_reason(IdleView(running=True, outstanding=0, idle_since=None, idle_timeout=1), now=99) is None
    )


@given(
    idle_since=st.floats(min_value=0, max_value=1e6),
    timeout=st.floats(min_value=0, max_value=1e4),
    elapsed=st.floats(min_value=0, max_value=2e4),
)
def test_close_decision_follows_the_timeout(idle_since, timeout, elapsed):
    view = IdleView(running=True, outstanding=0, idle_since=idle_since, idle_timeout=timeout)
    reason = close_reason(view, now=idle_since + elapsed)
    if elapsed >= timeout + 1e-3:
        assert reason is not None
    elif elapsed <= timeout - 1e-3:
        assert reason is None


# ---------------------------------------------------------------- worker_spec
def test_worker_spec_for_two_devices():
    prof = ResourceProfile(name="train", gpus=2, memory="32GiB")
    devices = (_dev(2), _dev(3))
    spec = worker_spec(prof, 0, devices, emulated=False)
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert spec.resources == {GPU_RESOURCE: 2.0}
    assert spec.env[WORKER_ENV_EMULATED] == "0"
    assert spec.env[WORKER_ENV_PROFILE] == "train"
    assert spec.env[WORKER_ENV_DEVICES] == "NVIDIA H100 80GB HBM3|NVIDIA H100 80GB HBM3"
    assert spec.nthreads == 1
    assert spec.memory_limit == 32 * GiB
    assert spec.devices == devices
    assert spec.name == "train-gpu2-3"


def test_worker_spec_for_a_shared_emulated_device():
    prof = ResourceProfile(name="etl", gpus=0.25)
    dev = parse_emulated("L4:24GiB")
    spec = worker_spec(prof, 0, dev, emulated=True, extra_env={"EXTRA": "1"})
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "0"
    assert spec.env[WORKER_ENV_EMULATED] == "1"
    assert spec.env["EXTRA"] == "1"
    assert spec.resources == {GPU_RESOURCE: 1.0}
    assert spec.nthreads == 4
    # four tasks of 0.25 fit exactly on the worker's resources
    assert 4 * task_resources(prof)[GPU_RESOURCE] == spec.resources[GPU_RESOURCE]


def test_worker_spec_for_cpu():
    prof = ResourceProfile(name="etl-cpu", cpus=0.5)
    spec = worker_spec(prof, 3, (), emulated=True, cores=2)
    assert spec.resources == {}
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "", "CPU workers hide the host's GPUs"
    assert WORKER_ENV_EMULATED not in spec.env
    assert spec.env[WORKER_ENV_PROFILE] == "etl-cpu"
    assert spec.nthreads == 4
    assert spec.name == "etl-cpu-3"
    assert task_resources(prof) is None


def test_bound_at_most_counts_each_profiles_cap_on_the_devices_it_matches():
    inv = _inventory("H100:80GiB,H100:80GiB,L4:24GiB")
    whole = ResourceProfile(name="whole", gpus=1)  # one worker per device: 3
    quarter = ResourceProfile(name="quarter", gpus=0.25, max_workers=1)  # capped: 1
    big = ResourceProfile(name="big", gpus=2, gpu_memory_total="40GiB")  # the two H100s make one group: 1
    cpu = ResourceProfile(name="cpu", cpus=1, processes=True, max_workers=2)  # its cap: 2
    assert bound_at_most([whole], inv) == 3
    assert bound_at_most([whole, quarter, big, cpu], inv) == 3 + 1 + 1 + 2
    assert bound_at_most([], inv) == 0


def test_a_crashed_task_run_is_retried_by_one_rule_with_prefects_retry_delay():
    """One rule for a dead worker's task run, in the runner and on a shared scheduler's re-run:
    retried while its counted runs <= retries, after retry_delay_seconds (a number, or one per retry
    with the last repeating); None once they are used up. Runs that used no retry (preempted, moved
    to on_oom) do not count; a crash counts even when Prefect never counted its run."""
    from gpu_tasks.policy import crash_retry, rerun_retries, runs_counted

    assert crash_retry(0, 0, run_count=1) is None
    assert crash_retry(2, 5, run_count=1) == 5.0
    assert crash_retry(2, None, run_count=2) == 0.0
    assert crash_retry(2, 5, run_count=3) is None
    per_retry = [1, 4]
    assert [crash_retry(3, per_retry, runs) for runs in (1, 2, 3, 4)] == [1.0, 4.0, 4.0, None]
    assert crash_retry(1, [], run_count=1) == 0.0
    # preempted once, then its worker died: the documented "no retry used" holds
    assert crash_retry(1, 0, run_count=2, free_runs=1) == 0.0
    assert crash_retry(1, 0, run_count=3, free_runs=1) is None
    # a worker that died before Prefect counted its run (run count still 0) still spends a retry
    assert crash_retry(1, 0, run_count=0, crashes=2) is None
    assert runs_counted(0, 0, crashes=2) == 2
    # what a re-run keeps: after one crash of the first run, one retry less; after a preemption, all
    assert rerun_retries(3, run_count=1, crashes=1) == 2
    assert rerun_retries(3, run_count=1, free_runs=1) == 3
    assert rerun_retries(1, run_count=2, free_runs=0) == 0  # Prefect retried it once already
