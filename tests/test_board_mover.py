"""The waiter board's mover on a real Dask scheduler: a task queued behind another on a worker's one GPU
moves to a worker with room, and the scheduler's count of used GPUs stays what its workers are given."""

from __future__ import annotations

import time

import pytest

from gpu_tasks.cluster.board import _mover


def _run_on(address: str, seconds: float) -> str:
    from distributed import get_worker

    time.sleep(seconds)
    return get_worker().address


def _until(check, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_a_moved_task_takes_its_gpu_count_with_it():
    """Dask's stealing moves a task without its resource count: each move left the worker it left one
    GPU too many and the other one too few, for good (a new-user pass saw -3/+3 on an idle shared
    scheduler, and one waiter preempt twice). The mover reads room from what each worker is given and
    sets Dask's count to match."""
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=1,
            processes=False,
            threads_per_worker=2,
            resources={"GPU": 1},
            dashboard_address=None,
            host="127.0.0.1",
            protocol="tcp",
        ) as cluster,
        Client(cluster) as client,
    ):
        [first] = client.scheduler_info()["workers"]
        # both on the only worker: the second waits there for its GPU (Dask never steals such a task)
        running = client.submit(_run_on, "a", 3.0, resources={"GPU": 1})
        queued = client.submit(_run_on, "b", 0.5, resources={"GPU": 1})

        def counts() -> dict[str, tuple[float, float]]:
            """Per worker: (Dask's count of used GPUs, the GPUs of the tasks it is given)."""

            def read(dask_scheduler=None):
                return {
                    ws.address: (
                        ws.used_resources.get("GPU", 0.0),
                        sum((t.resource_restrictions or {}).get("GPU", 0.0) for t in ws.processing),
                    )
                    for ws in dask_scheduler.workers.values()
                }

            return client.run_on_scheduler(read)

        _until(lambda: counts()[first][1] == 2.0, "both tasks given to the only worker")
        cluster.scale(2)  # a worker with room joins (a nanny's restart, a freed host)
        client.wait_for_workers(2, timeout=30)
        [other] = set(client.scheduler_info()["workers"]) - {first}
        assert counts()[other] == (0.0, 0.0)
        assert client.run_on_scheduler(_mover([queued.key])) == [queued.key]
        assert queued.result(timeout=30) == other  # it ran on the worker with room, not after the other
        assert running.result(timeout=30) == first
        client.run_on_scheduler(_mover([]))  # any later call of the board's sets Dask's count right again
        after = counts()
        assert after == {first: (0.0, 0.0), other: (0.0, 0.0)}, after
