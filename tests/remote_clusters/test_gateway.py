"""cluster_class on a real dask-gateway server (remote_clusters/gateway.py: its local backend on
127.0.0.1, simple password auth): ``dask_gateway.GatewayCluster`` through a cluster_class profile."""

from __future__ import annotations

import contextlib
import logging
import sys
import time

import cloudpickle
import psutil
import pytest
from prefect import flow, task
from prefect.context import FlowRunContext

from gpu_tasks import ProfileTaskRunner, ResourceProfile, current_allocation
from remote_clusters.gateway import GatewayServer, clusters, processes_under

pytestmark = pytest.mark.slow
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _workers_under(gateway_pid: int) -> list:
    """The gateway's worker processes (``dask worker``) that still run."""
    return processes_under(gateway_pid, "dask_worker")


def _cluster_processes(gateway_pid: int) -> list[str]:
    """What the gateway server runs besides its proxy: its clusters' schedulers, nannies and workers."""
    cmds = []
    for p in processes_under(gateway_pid):
        with contextlib.suppress(psutil.Error):  # it ended since it was listed (the clean-clone CI saw one)
            cmds.append(" ".join(p.cmdline()))
    return [c for c in cmds if "dask-gateway-proxy" not in c]


def test_gateway_cluster_runs_tasks_on_its_workers_and_scales_to_zero(
    prefect_server, gateway_server: GatewayServer, no_leaked_processes, caplog
):
    # the flow travels to the workers by value: it may hold plain values only, not the server object
    address, gateway_pid = gateway_server.address, gateway_server.process.pid
    prof = ResourceProfile(
        name="gateway",
        gpus=1,
        cluster_class="dask_gateway.GatewayCluster",
        cluster_kwargs={"address": address, "auth": gateway_server.auth()},
        max_workers=2,
        idle_timeout=1,
    )

    @task(tags=["profile:gateway"])
    def train(i: int, gateway_pid: int) -> dict:
        import os

        import psutil
        from distributed import get_worker

        time.sleep(1.5)
        alloc = current_allocation()
        ancestors = [p.pid for p in psutil.Process().parents()]
        return {
            "pid": os.getpid(),
            "worker": get_worker().address,
            "under_gateway": gateway_pid in ancestors,
            "devices": alloc.device_keys,
            "emulated": alloc.emulated,
        }

    @flow(task_runner=ProfileTaskRunner(profiles=[prof]))
    def on_gateway() -> dict:
        runner = FlowRunContext.get().task_runner
        futures = [train.submit(i, gateway_pid) for i in range(4)]
        results = [f.result() for f in futures]
        deadline = time.monotonic() + 30
        while not runner.ledger and time.monotonic() < deadline:
            time.sleep(0.2)
        while _workers_under(gateway_pid) and time.monotonic() < deadline:  # stopped by SIGINT
            time.sleep(0.2)
        after_idle = {
            "ledger": [(r.profile, r.tasks, r.workers, r.reason) for r in runner.ledger],
            "clusters": clusters(address),
            "workers": len(_workers_under(gateway_pid)),
        }
        again = train.submit(4, gateway_pid).result()  # from zero workers, on the same gateway cluster
        return {"results": results, "after_idle": after_idle, "again": again, "clusters": clusters(address)}

    caplog.set_level(logging.INFO, logger="gpu_tasks.runner")
    started = time.monotonic()
    out = on_gateway()
    took = time.monotonic() - started
    results, after_idle, again = out["results"], out["after_idle"], out["again"]

    # the tasks ran in worker processes the gateway server started (its descendants), not in this
    # one; scaled to the queue: two workers (max_workers), each with its own address and process
    import os

    assert all(r["under_gateway"] and r["pid"] != os.getpid() for r in results), results
    assert len({r["pid"] for r in results}) == 2 and len({r["worker"] for r in results}) == 2, results
    assert all(r["emulated"] and len(r["devices"]) == 1 for r in results), results
    # scaled to zero when idle: the gateway's cluster stays (for the next task) with no worker
    [(profile, tasks, workers, reason)] = after_idle["ledger"]
    assert (profile, tasks, workers) == ("gateway", 4, 2) and "idle" in reason, after_idle
    assert list(after_idle["clusters"].values()) == ["RUNNING"] and after_idle["workers"] == 0, after_idle
    # the next task got a new worker of that same gateway cluster
    assert again["under_gateway"] and again["pid"] not in {r["pid"] for r in results}, again
    assert out["clusters"] == after_idle["clusters"], out
    assert "scaled dask_gateway.GatewayCluster to zero (" in caplog.text
    # the flow run ended: its gateway cluster was shut down, no scheduler or worker process is left
    assert clusters(address) == {}
    deadline = time.monotonic() + 20
    while _cluster_processes(gateway_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _cluster_processes(gateway_pid) == []  # no scheduler, nanny or worker
    assert took < 60, took
