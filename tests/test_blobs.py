"""A GPU profile's tasks carry their Prefect objects pickled once per runner (gpu_tasks.worker.blobs)."""

from __future__ import annotations

import pickle
import uuid

import pytest
from prefect import flow, task

from gpu_tasks import ProfileTaskRunner, ResourceProfile, current_allocation, profile
from gpu_tasks.worker.blobs import Blob, Blobs, opened


class Counted:
    """Counts how often it is pickled in this process (the flow process)."""

    pickled = 0

    def __init__(self, value: int) -> None:
        self.value = value

    def __reduce__(self):
        Counted.pickled += 1
        return Counted, (self.value,)


def test_a_blob_passes_through_a_pickle_round_trip_unopened_and_opens_once():
    blobs = Blobs()
    obj = {"values": [1, 2, 3]}
    made = blobs.blob(obj)
    assert blobs.blob(obj) is made  # the same object: pickled once
    assert blobs.blob({"values": [1, 2, 3]}) is not made  # an equal but other object: its own
    again = pickle.loads(pickle.dumps(made))  # as Dask's scheduler passes it on
    assert isinstance(again, Blob) and again.key == made.key
    first, second = again.open(), pickle.loads(pickle.dumps(made)).open()
    assert first == obj and first is not obj  # unpickled, not the flow side's object
    assert second is first  # once per process
    assert opened(made) is first and opened(5) == 5


def test_the_flow_run_context_is_validated_once_when_opened():
    from prefect.client.schemas.objects import FlowRun

    run = FlowRun(name="x", flow_id=uuid.uuid4())
    made = Blobs().blob({"flow_run": run.model_dump(mode="json"), "parameters": {}}, "flow_run_context")
    ctx = made.open()
    assert isinstance(ctx["flow_run"], FlowRun) and ctx["flow_run"].id == run.id


@pytest.mark.usefixtures("no_leaked_processes", "emulated")
def test_a_gpu_profile_pickles_its_task_once_per_runner_not_once_per_task():
    counted = Counted(41)

    @task(tags=[profile("quarter")])
    def add(x: int) -> tuple[int, str]:
        return counted.value + x, current_allocation().worker

    quarter = ResourceProfile(name="quarter", gpus=0.25, idle_timeout=30)

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="cpu", cpus=0.5), quarter]))
    def twelve() -> list[tuple[int, str]]:
        return [f.result() for f in add.map(range(12))]

    Counted.pickled = 0
    out = twelve()
    assert [v for v, _ in out] == [41 + i for i in range(12)]
    assert all(w != "in-process" for _, w in out)  # they ran in worker processes
    # once with the task's function and once with the flow's (it calls add): not twice per task
    assert Counted.pickled == 2
