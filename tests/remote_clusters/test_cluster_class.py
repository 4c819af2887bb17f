"""cluster_class profiles, on dask-jobqueue's job-queue cluster that runs its jobs as local
processes (``dask_jobqueue.local.LocalCluster``): the job-queue machinery without Slurm."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import cloudpickle
import psutil
import pytest
from prefect import flow, task
from prefect.context import FlowRunContext
from prefect_api import api, flow_run_events

from gpu_tasks import ProfileTaskRunner, ResourceProfile, current_allocation
from gpu_tasks.errors import ClusterError
from remote_clusters import jobqueue_local
from remote_clusters.hosts import kill_when_written
from remote_clusters.jobqueue_local import DrainedLocalJob

pytestmark = pytest.mark.slow
# the workers cannot import this test module: its flows and tasks travel by value
cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(jobqueue_local)  # the runner, its profiles included, travels too

JOBQUEUE = "dask_jobqueue.local.LocalCluster"


def job_kwargs(resources: bool = True, **extra: Any) -> dict[str, Any]:
    """One worker per job on 127.0.0.1 advertising GPU=1; each job is an emulated one-GPU host.

    LocalCluster runs its job script without a shell, so the job's environment goes in
    front of the interpreter with env(1).
    """
    args = ["--host", "127.0.0.1", "--dashboard-address", "127.0.0.1:0"]
    if resources:
        args = ["--resources", "GPU=1", *args]
    return {
        "cores": 1,
        "memory": "1GiB",
        "processes": 1,
        "python": f"env CUDA_VISIBLE_DEVICES=0 GPU_TASKS_EMULATED_GPUS=H100:80GiB {sys.executable}",
        "job_cls": DrainedLocalJob,
        "worker_extra_args": args,
        "scheduler_options": {"host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"},
        **extra,
    }


def job_workers() -> list[psutil.Process]:
    """This test process's dask-jobqueue job processes that still run."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "dask_worker" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            continue
    return out


def test_provision_scale_up_scale_to_zero_and_reprovision(prefect_server, no_leaked_processes, tmp_path):
    prof = ResourceProfile(
        name="queue",
        gpus=1,
        cluster_class=JOBQUEUE,
        cluster_kwargs=job_kwargs(),
        max_workers=2,
        idle_timeout=1,
    )

    marks = tmp_path / "marks"  # the jobs run on this host: they see the test's files
    marks.mkdir()

    @task(tags=["profile:queue"])
    def train(i: int, until_both: bool = False) -> dict:
        import os

        start = time.time()
        (marks / str(os.getpid())).mkdir(exist_ok=True)  # one folder a worker process
        # the first batch holds on (at most 60 s) until a task runs on the other job's worker: on a
        # loaded machine (a clean-clone CI run) the second job's worker came up after the first had
        # run all four tasks
        while until_both and len(list(marks.iterdir())) < 2 and time.time() - start < 60:
            time.sleep(0.1)
        time.sleep(1.5)
        alloc = current_allocation()
        return {"pid": os.getpid(), "devices": alloc.device_keys, "emulated": alloc.emulated}

    @flow(task_runner=ProfileTaskRunner(profiles=[prof]))
    def queued() -> dict:
        runner = FlowRunContext.get().task_runner
        first = [f.result() for f in [train.submit(i, until_both=True) for i in range(4)]]
        deadline = time.monotonic() + 30
        while not runner.ledger and time.monotonic() < deadline:
            time.sleep(0.2)
        between = {"rows": len(runner.ledger), "workers": len(job_workers()), **runner.status()["queue"]}
        second = [f.result() for f in [train.submit(i) for i in range(2)]]
        return {"first": first, "between": between, "second": second}

    out = queued()
    first, between, second = out["first"], out["between"], out["second"]
    # scaled up to the queue: the four tasks ran on two workers (max_workers), devices emulated
    assert len({r["pid"] for r in first}) == 2, first
    assert all(r["emulated"] and len(r["devices"]) == 1 for r in first + second)
    # scaled to zero when idle: a ledger row, no job process left, the profile closed
    assert between["rows"] == 1 and between["workers"] == 0 and between["state"] == "closed", between
    # re-provisioned by the next tasks, on new workers
    assert not {r["pid"] for r in second} & {r["pid"] for r in first}
    assert job_workers() == []


def test_ledger_counts_held_time_from_the_request(prefect_server):
    prof = ResourceProfile(
        name="ledger", gpus=1, cluster_class=JOBQUEUE, cluster_kwargs=job_kwargs(), max_workers=1
    )

    @task(tags=["profile:ledger"])
    def nap() -> None:
        time.sleep(1.0)

    runner_box: list = []

    @flow(task_runner=ProfileTaskRunner(profiles=[prof]))
    def one():
        runner_box.append(FlowRunContext.get().task_runner)
        nap.submit().result()
        return FlowRunContext.get().flow_run.id

    run_id = one()
    [row] = runner_box[0].ledger
    assert row.profile == "ledger" and row.tasks == 1 and row.workers == 1
    assert row.busy_seconds >= 1.0 and row.held_seconds > row.busy_seconds  # start-up counts as held
    assert row.emulated and row.devices and row.reason.startswith("flow run ended")
    # the same row in the flow run's resource-ledger artifact, and events on both ends
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all(timeout=10)
    events = flow_run_events(run_id, {"prefix": ["gpu-tasks.cluster."]}, at_least=2)
    deadline, artifacts = time.monotonic() + 15, []
    while time.monotonic() < deadline and not artifacts:
        by_run = {"artifacts": {"flow_run_id": {"any_": [str(run_id)]}}}
        _, artifacts = api("POST", "/artifacts/filter", json=by_run)
        time.sleep(0.25)
    assert [e["event"] for e in events] == ["gpu-tasks.cluster.provisioned", "gpu-tasks.cluster.closed"]
    assert events[0]["resource"]["gpu-tasks.kind"] == "cluster_class"
    assert events[1]["payload"]["held_s"] == round(row.held_seconds, 3)
    [ledger] = [a for a in artifacts if a["key"] == "resource-ledger"]
    [published] = ledger["data"] if isinstance(ledger["data"], list) else json.loads(ledger["data"])
    assert published["profile"] == "ledger" and published["held_s"] == round(row.held_seconds, 1)


def test_the_started_mark_puts_no_error_in_the_schedulers_log(prefect_server):
    """Each task's started mark is read on its scheduler, here ``distributed.LocalCluster``'s in the flow
    process: ``Variable.get(timeout=0)`` logged ``Exception while handling op variable_get`` there
    with a traceback, once per task, into the user's console."""
    import logging

    prof = ResourceProfile(
        name="local",
        cluster_class="distributed.LocalCluster",
        cluster_kwargs={"n_workers": 0, "threads_per_worker": 1, "dashboard_address": None},
        max_workers=1,
    )

    @task(tags=["profile:local"])
    def one(i: int) -> int:
        return i

    @flow(task_runner=ProfileTaskRunner(profiles=[prof]))
    def marked() -> list[int]:
        return [f.result() for f in [one.submit(i) for i in range(2)]]

    errors: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append  # type: ignore[method-assign]
    logging.getLogger("distributed").addHandler(handler)
    try:
        assert marked() == [0, 1]
    finally:
        logging.getLogger("distributed").removeHandler(handler)
    assert not [r.getMessage() for r in errors if "Exception while handling op" in r.getMessage()]


def _fails(prof: ResourceProfile) -> BaseException:
    @task(tags=[f"profile:{prof.name}"])
    def never() -> None:
        raise AssertionError("must not run")

    @flow(task_runner=ProfileTaskRunner(profiles=[prof]))
    def bad():
        return never.submit().result(raise_on_failure=False)

    started = time.monotonic()
    error = bad()
    assert time.monotonic() - started < 60
    assert isinstance(error, ClusterError), error
    assert f"profile {prof.name!r}" in str(error)
    assert job_workers() == []
    return error


@pytest.mark.parametrize(
    ("path", "kwargs", "says"),
    [
        ("dask_nowhere.SLURMCluster", {}, "cannot be imported"),
        ("dask_jobqueue.NoSuchCluster", {}, "has no 'NoSuchCluster'"),
        ("collections.OrderedDict", {}, "is not a Dask cluster class"),
        (JOBQUEUE, {"bogus": 1, "cores": 1}, "rejected cluster_kwargs ['bogus']: ValueError"),
    ],
)
def test_bad_cluster_class_or_kwargs_is_a_clear_error(
    prefect_server, no_leaked_processes, path, kwargs, says
):
    prof = ResourceProfile(name="bad", gpus=1, cluster_class=path, cluster_kwargs=kwargs, max_workers=1)
    assert says in str(_fails(prof))


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        ({"bogus_kw": 1}, "['bogus_kw']"),
        ({"threads_per_worker": "abc"}, "['dashboard_address', 'host', 'n_workers', 'threads_per_worker']"),
    ],
)
def test_cluster_kwargs_its_workers_reject_fail_at_once_naming_them(
    prefect_server, no_leaked_processes, monkeypatch, bad, named
):
    """distributed.LocalCluster hands kwargs it does not take to its workers, which fail to start:
    the error names them at once, not after GPU_TASKS_PROVISION_TIMEOUT."""
    monkeypatch.setenv("GPU_TASKS_PROVISION_TIMEOUT", "90")
    kwargs = {"n_workers": 0, "host": "127.0.0.1", "dashboard_address": ":0", **bad}
    prof = ResourceProfile(
        name="badkw", cluster_class="distributed.LocalCluster", cluster_kwargs=kwargs, max_workers=1
    )
    started = time.monotonic()
    error = str(_fails(prof))
    assert time.monotonic() - started < 30
    assert f"LocalCluster's worker rejected cluster_kwargs {named}: TypeError" in error, error


def test_workers_without_gpu_resources_fail_at_start_up_with_the_fix(prefect_server, no_leaked_processes):
    prof = ResourceProfile(
        name="nogpu",
        gpus=1,
        cluster_class=JOBQUEUE,
        cluster_kwargs=job_kwargs(resources=False),
        max_workers=1,
    )
    error = _fails(prof)
    assert "advertise no Dask resource 'GPU'" in str(error)
    assert 'worker_extra_args = ["--resources", "GPU=1"]' in str(error)


def test_a_job_worker_killed_mid_task_is_reported_and_retried(prefect_server, tmp_path):
    import os
    from pathlib import Path

    marker = tmp_path / "running"
    prof = ResourceProfile(
        name="fragile", gpus=1, cluster_class=JOBQUEUE, cluster_kwargs=job_kwargs(), max_workers=1
    )

    @task(tags=["profile:fragile"], retries=1)
    def once_killed() -> int:
        done = Path(str(marker) + ".done")
        if not done.exists():
            done.write_text("")
            marker.write_text(str(os.getpid()))
            time.sleep(30)
        return os.getpid()

    @flow(task_runner=ProfileTaskRunner(profiles=[prof]))
    def killed():
        return once_killed.submit().result()

    killer = kill_when_written(marker)
    pid = killed()
    killer.join(5)
    assert pid != int(marker.read_text())  # the retry ran in a new worker process
    assert job_workers() == []


def test_a_gang_starts_all_of_its_workers_before_its_first_task(prefect_server):
    prof = ResourceProfile(
        name="gang", gpus=1, gang=True, cluster_class=JOBQUEUE, cluster_kwargs=job_kwargs(), max_workers=2
    )

    @task(tags=["profile:gang"])
    def first() -> int:
        from distributed import get_client

        return len(get_client().scheduler_info(n_workers=-1)["workers"])

    @flow(task_runner=ProfileTaskRunner(profiles=[prof]))
    def gang_flow():
        return first.submit().result()

    assert gang_flow() == 2  # both workers were up when the first task ran


NO_GUARD = """
from prefect import flow, task
from gpu_tasks import ProfileTaskRunner, ResourceProfile

LOCAL = ResourceProfile(
    name="lc", gpus=1, max_workers=1, cluster_class="distributed.LocalCluster",
    cluster_kwargs={"n_workers": 0, "threads_per_worker": 1, "dashboard_address": None,
                    "host": "127.0.0.1", "resources": {"GPU": 1}},
)

@task(tags=["profile:lc"])
def one():
    return 1

@flow(task_runner=ProfileTaskRunner(profiles=[LOCAL]))
def unguarded():
    return one.submit().result()

try:
    unguarded()  # no `if __name__ == "__main__":`: each spawned worker process runs this again
except Exception as exc:
    print("ERROR", exc, flush=True)
"""


@pytest.mark.parametrize("n_workers", [0, 1], ids=["scaled", "in_cluster_kwargs"])
def test_a_local_cluster_class_in_a_script_without_a_main_guard_names_the_guard(
    prefect_server, tmp_path, n_workers
):
    """A LocalCluster's worker processes are spawned and re-import the script: without a `__main__`
    guard none joins, and the error named only the cluster manager's logs and the network; with
    workers asked for in cluster_kwargs, the class itself timed out and the error said "fix
    cluster_kwargs" (new-user passes). Both now name the guard."""
    import uuid

    from faults._procs import kill_marked, run_flow_script, wait_gone
    from prefect.settings import get_current_settings

    marker = uuid.uuid4().hex
    url = str(get_current_settings().api.url)
    try:
        out = run_flow_script(
            tmp_path,
            "unguarded.py",
            NO_GUARD.replace('"n_workers": 0', f'"n_workers": {n_workers}'),
            marker,
            url,
            180,
            GPU_TASKS_PROVISION_TIMEOUT="15",
        )
        wait_gone(marker, timeout=10)
    finally:
        kill_marked(marker)
    lines = [x for x in out.stdout.splitlines() if x.startswith("ERROR ")]
    assert lines, out.stdout[-2000:] + out.stderr[-2000:]
    assert 'if __name__ == "__main__":' in lines[0] and "re-imports the script" in lines[0], lines[0]
