"""Out of memory: a worker killed for exceeding its memory limit, a task raising an out-of-memory
error, and the opt-in ``on_oom`` escalation to a larger profile. Real worker processes, a real server."""

from __future__ import annotations

import time

import pytest
from prefect import flow, task
from prefect.states import StateType
from prefect_api import api

from faults._procs import server_task_run
from gpu_tasks import ProfileTaskRunner, ResourceProfile, current_allocation, profile
from gpu_tasks.errors import ProfileError, UnknownProfileError

pytestmark = pytest.mark.usefixtures("emulated", "no_leaked_processes")

SMALL = dict(name="small", gpus=1, max_workers=1, memory="700MiB")  # the nanny kills a worker past 95% of it
BIG = ResourceProfile(name="big", gpus=1, max_workers=1)


@task(tags=[profile("small")])
def hog() -> str:
    block = bytearray(1536 * 2**20)  # 1.5 GiB, touched: resident
    if current_allocation().profile == "small":
        time.sleep(60)  # until the nanny kills the worker: it checks memory every 100 ms
    return f"{current_allocation().profile}:{len(block)}"


@task(tags=[profile("small")])
def cuda_oom() -> str:
    if current_allocation().profile == "small":
        raise MemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    return current_allocation().profile


def test_worker_killed_for_memory_ends_crashed_saying_out_of_memory():
    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(**SMALL)]))
    def too_big():
        future = hog.submit()
        future.wait()
        return future.task_run_id, future.state

    task_run_id, state = too_big()
    assert state.type == StateType.CRASHED, state
    for words in ("Out of memory", "profile 'small'", "device(s) ", "memory limit"):
        assert words in state.message, state.message
    # the limit that was set and the fix, not only the size it reached (a new-user pass)
    assert "its memory is 700.00 MiB per worker" in state.message, state.message
    assert "on_oom='<a profile with more memory>'" in state.message, state.message
    run = server_task_run(task_run_id)
    assert run["state_type"] == "CRASHED" and "Out of memory" in run["state"]["message"], run


def test_out_of_memory_error_names_profile_and_device():
    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(**SMALL)]))
    def raises_oom():
        future = cuda_oom.submit()
        future.wait()
        return future.state.is_failed(), future.state.message  # (a returned Failed state would fail the flow)

    failed, message = raises_oom()
    assert failed
    for words in ("GpuOutOfMemoryError", "out of memory on profile 'small'", "device(s) ", "on_oom"):
        assert words in message, message


@pytest.mark.parametrize("which", ["killed", "raised"])
def test_on_oom_reruns_the_task_once_on_the_larger_profile(which: str):
    runner = ProfileTaskRunner(profiles=[ResourceProfile(**SMALL, on_oom="big"), BIG])

    @flow(task_runner=runner)
    def escalates():
        future = (hog if which == "killed" else cuda_oom).submit()
        return future.task_run_id, future.result()

    task_run_id, result = escalates()
    assert result.startswith("big"), result
    # its first attempt FAILED (then AwaitingRetry, Running): wait for the rerun's final state
    run = server_task_run(task_run_id, lambda r: r["state_type"] == "COMPLETED")
    assert run["state_type"] == "COMPLETED" and run["run_count"] == 2, run
    if which == "raised":  # the failed attempt says where it re-runs, not to set what is set
        _, states = api("GET", "/task_run_states/", params={"task_run_id": str(task_run_id)})
        failed = [s["message"] for s in states if s["type"] == "FAILED"]
        assert len(failed) == 1 and "The task re-runs once on profile 'big'" in failed[0], states
        assert "give the profile on_oom" not in failed[0], failed
    escalated: list = []
    deadline = time.monotonic() + 30  # events are persisted in batches
    while not escalated and time.monotonic() < deadline:
        _, events = api(
            "POST",
            "/events/filter",
            json={
                "filter": {
                    "event": {"prefix": ["gpu-tasks.task.escalated"]},
                    "related": {"id": [f"prefect.task-run.{task_run_id}"]},
                },
                "limit": 50,
            },
        )
        escalated = events["events"]
        if not escalated:
            time.sleep(0.5)
    assert len(escalated) == 1 and escalated[0]["payload"]["to_profile"] == "big", events


@task(tags=[profile("small")])
def always_oom() -> str:
    raise MemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


def test_out_of_memory_on_the_on_oom_profile_too_fails_without_promising_another_rerun():
    """Two profiles that name each other in on_oom: the task moves once, then fails, saying so (it said
    "The task re-runs once on profile 'small'", which never came); its run is tagged where it ran last."""
    big = ResourceProfile(name="big", gpus=1, max_workers=1, on_oom="small")
    runner = ProfileTaskRunner(profiles=[ResourceProfile(**SMALL, on_oom="big"), big])

    @flow(task_runner=runner)
    def twice():
        future = always_oom.submit()
        future.wait()
        return future.task_run_id, future.state.is_failed(), future.state.message

    task_run_id, failed, message = twice()
    assert failed and "out of memory on profile 'big'" in message, message
    assert "re-runs once" not in message and "on_oom moves a task once" in message, message
    run = server_task_run(task_run_id, lambda r: r["state_type"] == "FAILED" and r["run_count"] == 2)
    assert run["state_type"] == "FAILED" and run["run_count"] == 2, run
    assert {"profile:big", "gpu-tasks:on-oom", "gpu-tasks:emulated"} <= set(run["tags"]), run["tags"]
    assert len([t for t in run["tags"] if t.startswith("gpu:")]) == 1, run["tags"]  # this device's alone


def test_on_oom_must_name_a_known_other_profile():
    with pytest.raises(ProfileError, match="on_oom must name another profile"):
        ResourceProfile(name="small", gpus=1, on_oom="small")
    with pytest.raises(UnknownProfileError, match="on_oom='huge'.*Add a ResourceProfile"):
        ProfileTaskRunner(profiles=[ResourceProfile(name="small", gpus=1, on_oom="huge")])  # as it is built
