"""Generic task-runner conformance: what any Prefect task runner must do, checked on ProfileTaskRunner.

Modelled on the checks prefect-dask runs on its DaskTaskRunner (``tests/test_task_runners.py`` in
PrefectHQ/prefect, ``src/integrations/prefect-dask/``): results, failures and ``NotReady``
downstream tasks, async tasks and flows, timeouts, ``submit`` and ``wait`` on the runner itself,
``as_completed`` order, crash capture of ``KeyboardInterrupt``, plain data (dataclasses, Dask
collections) across tasks, nested submission and ``wait_for``. Each check runs on the three
kinds of profile a task can land on: a CPU profile (threads in the flow process), a CPU profile of
worker processes, and a ``gpus=0.25`` profile (worker processes on emulated devices).

This file runs in both dependency stages: the full suite (the lowest Prefect, .venv) and
scripts/test-compat (the newest Prefect 3.x, .venv-compat).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest
from prefect import flow, task
from prefect.futures import as_completed
from prefect.states import StateType

from gpu_tasks import ProfileTaskRunner, ResourceProfile, current_allocation, profile
from gpu_tasks.runner import ProfileFuture

pytestmark = pytest.mark.usefixtures("no_leaked_processes", "emulated")

KINDS = {
    "threads": ResourceProfile(name="p", cpus=0.5),
    "processes": ResourceProfile(name="p", cpus=0.5, processes=True, max_workers=1),
    "gpu": ResourceProfile(name="p", gpus=0.25, max_workers=1),
}
ON_P = [profile("p")]  # every task here asks for the profile under test


# scripts/test-compat leaves the "processes" kind out (-m "not cpu_processes"): on a CPU profile of
# processes a task takes the gpu kind's path (a Dask worker process from the warm pool, Prefect's engine
# there), and that stage has a few minutes in all.
@pytest.fixture(
    params=[pytest.param(k, marks=pytest.mark.cpu_processes) if k == "processes" else k for k in KINDS]
)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def task_runner(kind: str) -> ProfileTaskRunner:
    return ProfileTaskRunner(profiles=[KINDS[kind]], idle_timeout=30)


def test_duplicate_is_an_equal_fresh_runner(task_runner: ProfileTaskRunner):
    new = task_runner.duplicate()
    assert new == task_runner and new is not task_runner


def test_results_reach_the_flow_and_downstream_tasks(task_runner: ProfileTaskRunner, kind: str):
    @task(tags=ON_P)
    def letter(s: str) -> str:
        return s

    @task(tags=ON_P)
    def append(s: str) -> tuple[str, tuple[str, ...]]:
        return s + "c", current_allocation().devices

    @flow(task_runner=task_runner)
    def ok():
        a, b = letter.submit("a"), letter.submit("b")
        c = append.submit(b)
        return a.result(), b.result(), c.result()

    a, b, (c, devices) = ok()
    assert (a, b, c) == ("a", "b", "bc")
    assert len(devices) == (1 if kind == "gpu" else 0)


def test_failures_raise_and_downstream_tasks_are_not_ready(task_runner: ProfileTaskRunner):
    @task(tags=ON_P)
    def fails(exc: type[Exception], text: str) -> str:
        raise exc(text)

    @task(tags=ON_P)
    def append(s: str) -> str:
        return s + "c"

    @flow(task_runner=task_runner)
    def failing():
        a = fails.submit(RuntimeError, "this task fails")
        b = fails.submit(ValueError, "this one fails and passes data downstream")
        c = append.submit(b)
        d = append.submit(c)
        return a, b, c, d

    state = failing(return_state=True)
    assert state.is_failed()
    a, b, c, d = state.result(raise_on_failure=False)
    with pytest.raises(RuntimeError, match="this task fails"):
        a.result()
    with pytest.raises(ValueError, match="passes data downstream"):
        b.result()
    for down, up in ((c, b), (d, c)):
        assert down.is_pending() and down.name == "NotReady", down
        assert f"Upstream task run '{up.state_details.task_run_id}' did not reach a 'COMPLETED' state" in (
            down.message or ""
        )


def test_async_tasks_in_an_async_flow(task_runner: ProfileTaskRunner):
    @task(tags=ON_P)
    async def letter(s: str) -> str:
        await asyncio.sleep(0.01)
        return s

    @task(tags=ON_P)
    async def append(s: str) -> str:
        return s + "c"

    @flow(task_runner=task_runner)
    async def async_flow():
        a, b = letter.submit("a"), letter.submit("b")
        c = append.submit(b)
        return a.result(), b.result(), c.result()

    assert asyncio.run(async_flow()) == ("a", "b", "bc")


@pytest.mark.parametrize("style", ["sync", "async"])
def test_a_timed_out_task_fails_its_dependents_not_the_others(task_runner: ProfileTaskRunner, style: str):
    if style == "sync":

        @task(tags=ON_P, timeout_seconds=0.5)
        def too_slow() -> int:
            time.sleep(3)
            return 42

    else:

        @task(tags=ON_P, timeout_seconds=0.5)
        async def too_slow() -> int:
            await asyncio.sleep(3)
            return 42

    @task(tags=ON_P)
    def dependent(x: int) -> int:
        return x

    @task(tags=ON_P)
    def independent() -> int:
        return 7

    @flow(task_runner=task_runner)
    def timeouts():
        a = too_slow.submit()
        return a, dependent.submit(a), independent.submit()

    state = timeouts(return_state=True)
    assert state.is_failed()
    a, b, c = state.result(raise_on_failure=False)
    assert a.type == StateType.FAILED and "timeout" in (a.message or "").lower(), a
    assert b.type == StateType.PENDING and b.name == "NotReady", b
    assert c.type == StateType.COMPLETED and c.result() == 7


def test_submit_and_wait_on_the_runner_itself(task_runner: ProfileTaskRunner):
    @task(tags=ON_P)
    def answer() -> int:
        return 42

    @flow(task_runner=task_runner)
    def direct():
        from prefect.context import FlowRunContext

        runner = FlowRunContext.get().task_runner
        future = runner.submit(answer, parameters={}, wait_for=[])
        assert isinstance(future, ProfileFuture)
        future.wait()
        return future.state

    state = direct()
    assert state.is_completed() and state.result() == 42


def test_as_completed_yields_in_finishing_order(task_runner: ProfileTaskRunner, tmp_path):
    """The tasks sleep from a common start (each waits for the others to begin), so the order they
    finish in is their sleeps' however late a starved machine starts each (one started 5 s after
    another under a CI run on four test processes, which made the first sleep end second)."""
    started = tmp_path / "started"
    started.mkdir()

    @task(tags=ON_P)
    def sleep_for(seconds: float) -> float:
        (started / str(seconds)).touch()
        deadline = time.monotonic() + 60
        while len(list(started.iterdir())) < 3:  # all three run at once on every kind here
            assert time.monotonic() < deadline, "the three tasks never ran at the same time"
            time.sleep(0.01)
        time.sleep(seconds)
        return seconds

    timings = [0.5, 2.0, 4.0]  # far enough apart for a busy 2-core machine

    @flow(task_runner=task_runner)
    def order():
        futures = [sleep_for.submit(s) for s in reversed(timings)]
        return [f.result() for f in as_completed(futures)]

    assert order() == timings


def test_keyboard_interrupt_in_a_task_is_captured_as_crashed(task_runner: ProfileTaskRunner):
    @task(tags=ON_P)
    def interrupts() -> None:
        raise KeyboardInterrupt()

    @flow(task_runner=task_runner)
    def crash():
        future = interrupts.submit()
        future.wait()  # returns: the interrupt does not escape into the flow
        return future.state.type  # (a returned Crashed state would crash the flow)

    assert crash() == StateType.CRASHED


def test_dataclasses_pass_to_submit_and_map(task_runner: ProfileTaskRunner):
    @dataclass
    class Point:  # defined here, as a user's script would: pickled by value to worker processes
        value: int

    @task(tags=ON_P)
    def make(n: int) -> list[Point]:
        return [Point(value=i) for i in range(n)]

    @task(tags=ON_P)
    def echo(x: Point) -> Point:
        return x

    @flow(task_runner=task_runner)
    def dataclasses(n: int = 3) -> list[Point]:
        points = make(n)  # called, not submitted: runs in the flow
        one = echo.submit(points[0])
        many = echo.map(points)
        return [f.result() for f in [*many, one]]

    assert dataclasses() == [Point(value=i) for i in range(3)] + [Point(value=0)]


def test_allow_failure_and_quote_reach_the_task_as_their_values(task_runner: ProfileTaskRunner):
    """Prefect's annotations unwrap as on ThreadPoolTaskRunner: on worker processes a task got
    ``((5,),)`` for ``allow_failure(5)`` (each pickle of an annotation wraps its value once more)."""
    from prefect import allow_failure
    from prefect.utilities.annotations import quote

    @task(tags=ON_P)
    def fails() -> int:
        raise ValueError("boom")

    @task(tags=ON_P)
    def five() -> int:
        return 5

    @task(tags=ON_P)
    def show(x: object) -> str:
        return repr(x)

    @flow(task_runner=task_runner)
    def annotated() -> list[str]:
        bad, ok = fails.submit(), five.submit()
        shown = [
            show.submit(allow_failure(ok)),
            show.submit({"a": allow_failure(bad)}),
            show.submit(quote([1, (2, 3)])),
            show.submit(allow_failure(quote(4))),
        ]
        return [f.result() for f in shown]

    assert annotated() == ["5", "{'a': ValueError('boom')}", "[1, (2, 3)]", "4"]


def test_a_dask_collection_passes_between_tasks(task_runner: ProfileTaskRunner):
    dd = pytest.importorskip("dask.dataframe", reason="dask.dataframe needs the pipeline extra (pandas)")
    import pandas as pd

    @task(tags=ON_P)
    def frame():
        return dd.from_dict({"x": [1, 1, 1], "y": [2, 2, 2]}, npartitions=1)

    @task(tags=ON_P)
    def total(ddf):
        return ddf.sum()

    @task(tags=ON_P)
    def compute(ddf):
        return ddf.compute()

    @flow(task_runner=task_runner)
    def dataframe():
        return compute.submit(total.submit(frame.submit())).result()

    assert dataframe().equals(pd.Series([3, 6], index=["x", "y"]))


def test_nested_task_submission(task_runner: ProfileTaskRunner):
    @task(tags=ON_P)
    def nested() -> str:
        return "nested task"

    @task(tags=ON_P)
    def parent() -> str:
        future = nested.submit()
        assert isinstance(future, ProfileFuture), type(future)
        return future.result()

    @flow(task_runner=task_runner)
    def umbrella():
        future = parent.submit()
        assert isinstance(future, ProfileFuture)
        return future.result()

    assert umbrella() == "nested task"


def test_wait_for_orders_tasks_with_no_data_between_them(task_runner: ProfileTaskRunner):
    @task(tags=ON_P)
    def stamp() -> float:
        time.sleep(0.05)
        return time.time()

    @flow(task_runner=task_runner)
    def ordered():
        a, b = stamp.submit(), stamp.submit()
        after_a = stamp.submit(wait_for=[a])
        after_both = stamp.submit(wait_for=[a, b])
        return a.result(), b.result(), after_a.result(), after_both.result()

    a, b, after_a, after_both = ordered()
    assert after_a > a
    assert after_both > a and after_both > b
