"""Address profiles: flow runs on an existing Dask cluster (stand-in GPU hosts on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import cloudpickle
import psutil
import pytest
from faults._procs import seed_prefect_home, server_task_run
from prefect import flow, task
from prefect.settings import get_current_settings
from prefect_api import api, flow_run_task_runs, run_logs

from gpu_tasks import ProfileTaskRunner, ResourceProfile, current_allocation
from gpu_tasks.cluster.remote_workers import executing_keys
from gpu_tasks.errors import ClusterError, UnsatisfiableProfileError
from remote_clusters.hosts import (
    Hosts,
    kill_when_written,
    overlaps,
    prioritized_run,
    started_marks,
    tasks_at_scheduler,
)

pytestmark = pytest.mark.slow
# the workers cannot import this test module: its flows and tasks travel by value
cloudpickle.register_pickle_by_value(sys.modules[__name__])

SCRIPT = Path(__file__).with_name("flow_script.py")


def _settled_task_runs(flow_run_id: str, n: int, timeout: float = 20.0) -> list[dict]:
    def settled(runs: list[dict]) -> bool:
        return len(runs) >= n and all(r["state_type"] in ("COMPLETED", "FAILED", "CRASHED") for r in runs)

    return flow_run_task_runs(flow_run_id, settled, timeout)


def _two_flow_runs(hosts: Hosts, gpus: float, n: int, seconds: float, tmp_path: Path) -> list[dict]:
    env = {**os.environ, "PREFECT_API_URL": str(get_current_settings().api.url)}
    env.pop("GPU_TASKS_EMULATED_GPUS", None)  # the flow's host has no devices: the workers do
    outs = [tmp_path / f"run{i}.json" for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), hosts.address, str(gpus), str(n), str(seconds), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for out in outs
    ]
    logs = [p.communicate(timeout=240)[0].decode(errors="replace") for p in procs]
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    return [json.loads(out.read_text()) for out in outs]


def test_two_flow_runs_share_two_hosts_one_task_per_device(gpu_hosts: Hosts, prefect_server, tmp_path: Path):
    runs = _two_flow_runs(gpu_hosts, 1, 4, 1.5, tmp_path)
    tasks = [t for r in runs for t in r["tasks"]]
    assert len(tasks) == 8
    by_device: dict[str, list[tuple[float, float]]] = {}
    for t in tasks:
        # each task saw exactly its own worker's device, announced as emulated, with its host
        assert len(t["devices"]) == 1 and t["cvd"] in ("0", "1"), t
        assert t["devices"] == [f"{t['host']}:{t['cvd']}"] and t["emulated"] is True
        assert t["names"] == ["H100 (emulated)"]
        by_device.setdefault(t["devices"][0], []).append((t["start"], t["end"]))
    assert len(by_device) == 2  # both hosts were used
    for device, intervals in by_device.items():
        # exclusivity across the two flow runs: never two whole-GPU tasks on one device at once
        assert overlaps(intervals) == 1, (device, sorted(intervals))
    for r in runs:
        records = _settled_task_runs(r["flow_run_id"], 4)
        assert [x["state_type"] for x in records] == ["COMPLETED"] * 4
        for x in records:
            gpu_tags = [t for t in x["tags"] if t.startswith("gpu:")]
            assert len(gpu_tags) == 1 and gpu_tags[0].count(":") == 2, x["tags"]  # gpu:<host>:<id>
            assert "gpu-tasks:emulated" in x["tags"]


def test_fractional_tasks_pack_two_per_device(gpu_hosts: Hosts, prefect_server, tmp_path: Path):
    runs = _two_flow_runs(gpu_hosts, 0.5, 4, 2.0, tmp_path)
    by_device: dict[str, list[tuple[float, float]]] = {}
    for t in (t for r in runs for t in r["tasks"]):
        assert t["fraction"] == 0.5 and len(t["devices"]) == 1
        by_device.setdefault(t["devices"][0], []).append((t["start"], t["end"]))
    most = {d: overlaps(iv) for d, iv in by_device.items()}
    assert max(most.values()) == 2, most  # two halves share a device ...
    assert all(m <= 2 for m in most.values()), most  # ... and never more


def _address_flow(profile: ResourceProfile, n: int = 1, seconds: float = 0.1):
    @task(tags=[f"profile:{profile.name}"])
    def where(i: int) -> dict:
        alloc = current_allocation()
        time.sleep(seconds)
        return {"devices": alloc.device_keys, "host": alloc.host, "pid": os.getpid()}

    @flow(task_runner=ProfileTaskRunner(profiles=[profile]))
    def on_address():
        futures = [where.submit(i) for i in range(n)]
        return [f.result(raise_on_failure=False) for f in futures]

    return on_address


def test_a_request_no_worker_can_satisfy_fails_fast_naming_the_workers(gpu_hosts: Hosts, prefect_server):
    prof = ResourceProfile(name="too-big", gpus=2, address=gpu_hosts.address)
    started = time.monotonic()
    errors = _address_flow(prof, n=3)()
    assert time.monotonic() - started < 60
    # one type for all: the tasks after the first fail with its error, never try again
    assert all(isinstance(e, UnsatisfiableProfileError) for e in errors), errors
    for error in errors:
        assert "no worker of" in str(error) and "GPU=1 < 2" in str(error) and "--resources GPU=" in str(error)


def test_a_shared_worker_caps_prefects_client_waits_only_in_gpu_tasks_task_runs(
    gpu_hosts: Hosts, prefect_server
):
    """An address profile's workers run other people's tasks too: gpu-tasks' cap on Prefect's client
    waits applies to its own task runs there, never to the whole process; Prefect's server version
    check stays on there."""

    @task(tags=["profile:shared"])
    def cap_in_force() -> dict:
        import prefect.client.base as base

        from gpu_tasks.compat.prefect import is_ours
        from gpu_tasks.compat.prefect_client import _CAP

        installed = getattr(base.clamped_poisson_interval, "_gpu_tasks_capped", False)
        check = get_current_settings().client.server_version_check_enabled
        return {
            "installed": installed,
            "whole_process": _CAP["whole_process"],
            "ours": is_ours(),
            "check": check,
        }

    prof = ResourceProfile(name="shared", gpus=1, address=gpu_hosts.address)

    @flow(task_runner=ProfileTaskRunner(profiles=[prof]))
    def on_shared():
        return cap_in_force.submit().result()

    # and its Prefect, maybe not the flow's, still checks the server's version (a local worker does not)
    assert on_shared() == {"installed": True, "whole_process": False, "ours": True, "check": True}


def test_gpu_model_selects_workers_by_the_devices_they_publish(gpu_hosts: Hosts, prefect_server):
    ok = ResourceProfile(name="h100", gpus=1, gpu_model="H100", address=gpu_hosts.address)
    results = _address_flow(ok, n=2)()
    assert all(r["devices"] for r in results)
    wrong = ResourceProfile(name="a100", gpus=1, gpu_model="A100", address=gpu_hosts.address)
    [error] = _address_flow(wrong)()
    assert isinstance(error, UnsatisfiableProfileError)
    assert "do not match gpu_model='A100'" in str(error), error


def test_an_unreachable_address_fails_within_the_provision_timeout(prefect_server, monkeypatch):
    monkeypatch.setenv("GPU_TASKS_PROVISION_TIMEOUT", "4")
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prof = ResourceProfile(name="nowhere", gpus=1, address=f"tcp://127.0.0.1:{port}")
    started = time.monotonic()
    [error] = _address_flow(prof)()
    assert time.monotonic() - started < 30
    assert isinstance(error, ClusterError)
    assert "cannot connect to the Dask scheduler at tcp://127.0.0.1" in str(error), error
    assert "'nowhere'" in str(error)


FAILING_SCRIPT = """
import sys
from prefect import flow, task
from gpu_tasks import ProfileTaskRunner, ResourceProfile

SHARED = ResourceProfile(name="shared", gpus=1, address=sys.argv[1])

@task(tags=["profile:shared"])
def never() -> None:
    raise AssertionError("must not run")

@flow(task_runner=ProfileTaskRunner(profiles=[SHARED]))
def failing() -> list:
    errors = []
    for future in [never.submit() for _ in range(2)]:
        try:
            future.result()
        except Exception as exc:
            errors.append(str(exc))
    return errors

print(*failing(), sep="\\n", flush=True)
"""


def test_a_script_whose_client_cannot_be_built_ends_after_its_flow(prefect_server, tmp_path: Path):
    """A tls:// address without security: Dask's Client constructor raises (no ssl_context). The
    script ends after its flow; the half-built client did not hang it at exit (for 240 s)."""
    import socket

    script = tmp_path / "failing.py"
    script.write_text(FAILING_SCRIPT)
    env = {**os.environ, "PREFECT_API_URL": str(get_current_settings().api.url)}
    with socket.socket() as s:  # something accepts connections there
        s.bind(("127.0.0.1", 0))
        s.listen()
        cmd = [sys.executable, str(script), f"tls://127.0.0.1:{s.getsockname()[1]}"]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            out = proc.communicate(timeout=90)[0].decode(errors="replace")
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"the script did not end within 90 s: {proc.communicate()[0].decode()[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    assert "profile 'shared': cannot connect to the Dask scheduler at tls://" in out, out[-3000:]
    assert "TLS expects a `ssl_context`" in out and "within 120s" not in out, out[-3000:]


def _worker_killed_mid_task(hosts: Hosts, tmp_path: Path, retries: int) -> Any:
    """A flow run of one task on ``hosts`` whose worker is killed while the task's first run sleeps
    (later runs return at once); the task run's id and the flow run's."""
    marker = tmp_path / "running"  # the task writes its worker's pid here, once
    prof = ResourceProfile(name="doomed", gpus=1, address=hosts.address)

    @task(tags=["profile:doomed"], retries=retries)
    def long_task() -> int:
        if not Path(str(marker) + ".done").exists():
            Path(str(marker) + ".done").write_text("")
            marker.write_text(str(os.getpid()))
            time.sleep(30)
        return os.getpid()

    @flow(task_runner=ProfileTaskRunner(profiles=[prof]))
    def killed_worker():
        return long_task.submit()

    killer = kill_when_written(marker)
    state = killed_worker(return_state=True)
    killer.join(5)
    return state.result(raise_on_failure=False).state_details.task_run_id, state.state_details.flow_run_id


@pytest.mark.parametrize("retries", [1, 0])
def test_a_worker_killed_mid_task_is_reported_crashed_and_retried_by_the_rules(
    own_gpu_hosts: Hosts, prefect_server, tmp_path: Path, retries: int
):
    task_run_id, flow_run_id = _worker_killed_mid_task(own_gpu_hosts, tmp_path, retries)
    # with a retry the run passes through CRASHED before it completes: wait for the final state
    final = "COMPLETED" if retries else "CRASHED"
    run = server_task_run(task_run_id, lambda r: r["state_type"] == final)
    assert run["flow_run_id"] == str(flow_run_id), run  # the worker's report kept it in its flow run
    # the worker that found the crash told the flow process, which logged it in the flow run's log
    told = run_logs(flow_run_id, "died; its Dask scheduler re-ran it")
    assert len(told) == 1 and ("retrying it" in told[0]) == bool(retries), told
    _, history = api("GET", "/task_run_states/", params={"task_run_id": str(task_run_id)})
    crashed = [h for h in history if h["type"] == "CRASHED"]
    assert crashed and "died; its Dask scheduler re-ran it" in crashed[0]["message"], history
    if retries:
        assert run["state_type"] == "COMPLETED", run
        assert run["run_count"] == 2
    else:
        assert run["state_type"] == "CRASHED", run
        assert "died" in run["state"]["message"]
    # the re-run found the dead attempt's mark on the scheduler, and its own end removed it (the
    # removal is a message from the worker's client, not awaited: a moment after the result)
    deadline = time.monotonic() + 10
    while (marks := started_marks(own_gpu_hosts)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marks == []
    # no process of ours was left on the hosts but the restarted worker
    assert all(p.poll() is None for p in own_gpu_hosts.procs)
    assert psutil.pid_exists(own_gpu_hosts.scheduler.pid)


def test_a_task_its_scheduler_gave_up_on_is_crashed_and_leaves_no_mark_there(
    strict_gpu_hosts: Hosts, prefect_server, tmp_path: Path
):
    """The scheduler gives up at the first worker death (``KilledWorker``): no attempt runs after the
    dead one to find and remove its started mark, so the flow process removes it; the task run ends
    ``Crashed`` by the runner's own rules."""
    task_run_id, _ = _worker_killed_mid_task(strict_gpu_hosts, tmp_path, retries=0)
    run = server_task_run(task_run_id, lambda r: r["state_type"] == "CRASHED")
    assert run["state_type"] == "CRASHED", run
    deadline = time.monotonic() + 10  # the removal is a message from the flow's client, not awaited
    while (marks := started_marks(strict_gpu_hosts)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marks == []


@pytest.mark.parametrize("retries", [0, 1])
def test_a_scheduler_killed_mid_run_is_named_in_every_task_it_took(
    own_gpu_hosts: Hosts, prefect_server, tmp_path: Path, retries: int
):
    """The shared scheduler dies while two tasks run and one waits: each task run is reported as lost
    with its client's connection to that scheduler, not as a lost worker on unknown devices. With a
    retry left, the retry connects again and fails within seconds naming the scheduler's address: it
    went to the client that was still reconnecting, and the flow run waited for good (a new-user pass
    killed it after 4 minutes, 3 of 3 runs)."""
    import signal

    from prefect_api import api

    prof = ResourceProfile(name="orphaned", gpus=1, address=own_gpu_hosts.address)
    scheduler = own_gpu_hosts.scheduler.pid  # (the flow's body travels to the workers: no Popen in it)

    @task(tags=["profile:orphaned"], retries=retries, retry_delay_seconds=0.5)
    def long_task(i: int) -> None:
        (tmp_path / f"began-{i}").write_text("")
        time.sleep(30)

    @flow(task_runner=ProfileTaskRunner(profiles=[prof]))
    def loses_its_scheduler() -> list:
        futures = [long_task.submit(i) for i in range(3)]
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("began-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(scheduler, signal.SIGKILL)
        for f in futures:
            f.wait(timeout=90)  # a liveness bound: the retries end within seconds
        return [(f.state.type.value, f.state.message or "", str(f.task_run_id)) for f in futures]

    for state, message, task_run_id in loses_its_scheduler():
        if retries:
            assert state == "FAILED", (state, message)
            assert f"cannot connect to the Dask scheduler at {own_gpu_hosts.address}" in message, message
            _, history = api("GET", f"/task_run_states/?task_run_id={task_run_id}")
            crashed = [h["message"] for h in history if h["type"] == "CRASHED"]
            assert len(crashed) == 1, [h["type"] for h in history]  # then retried once
            message = crashed[0]
        assert f"Dask scheduler at {own_gpu_hosts.address} was lost" in message, message
        assert "(None)" not in message and "unknown devices" not in message, message
        assert "while running this task" not in message, message


def test_a_task_that_must_wait_is_logged_with_what_it_waits_for(
    gpu_hosts: Hosts, prefect_server, caplog, monkeypatch
):
    import logging

    from gpu_tasks.cluster.remote import RemoteCluster

    monkeypatch.setattr(RemoteCluster, "wait_log_every", 0.5)
    caplog.set_level(logging.INFO, logger="gpu_tasks.runner")
    prof = ResourceProfile(name="patient", gpus=1, address=gpu_hosts.address)
    with gpu_hosts.client() as other:  # another user holds both GPUs for a while
        workers = list(other.scheduler_info(n_workers=-1)["workers"])
        busy = [other.submit(time.sleep, 4, resources={"GPU": 1}, workers=[w], pure=False) for w in workers]
        while not all(other.processing().get(w) for w in workers):
            time.sleep(0.05)
        [result] = _address_flow(prof)()
        other.gather(busy)
    assert result["devices"]
    waits = [r.getMessage() for r in caplog.records if "in the queue of" in r.getMessage()]
    assert waits, [r.getMessage() for r in caplog.records]
    assert "for GPU=1" in waits[0] and "busy with other work" in waits[0]


def test_a_plain_script_on_prefects_ephemeral_api(gpu_hosts: Hosts, tmp_path: Path):
    """No server started, no PREFECT_API_URL: the ephemeral API is on 127.0.0.1, as the scheduler."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "GPU_TASKS_EMULATED"))}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    seed_prefect_home(tmp_path / "prefect-home")
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), gpu_hosts.address, "1", "2", "0.2", str(out)],
        env=env,
        capture_output=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-3000:]
    tasks = json.loads(out.read_text())["tasks"]
    assert len(tasks) == 2 and all(t["devices"] and t["emulated"] for t in tasks)
    # the ephemeral server ended with the script; the hosts are still up
    assert _servers(env["PREFECT_HOME"]) == set()
    assert all(p.poll() is None for p in gpu_hosts.procs)


def _servers(prefect_home: str) -> set[int]:
    """Prefect API server processes on this machine with ``prefect_home`` (the script's own: other
    test processes' servers are not its)."""
    out = set()
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "uvicorn" in cmd or "prefect.server" in cmd:
            try:
                if p.environ().get("PREFECT_HOME") == prefect_home:
                    out.add(p.pid)
            except psutil.Error:
                continue
    return out


def _own_hosts(tmp_path: Path, env: list[dict[str, str]]) -> Hosts:
    from remote_clusters.hosts import start_hosts

    return start_hosts(tmp_path / "hosts", None, n_workers=len(env), worker_env=env)


def test_a_worker_without_gpu_tasks_gets_no_task_and_is_not_broken(prefect_server, tmp_path: Path, caplog):
    import logging

    from remote_clusters.conftest import host_env

    shadow = tmp_path / "shadow" / "gpu_tasks"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("gpu-tasks is not installed on this worker")\n')
    env = host_env()
    env[1]["PYTHONPATH"] = str(shadow.parent)  # this worker cannot import gpu-tasks
    caplog.set_level(logging.WARNING, logger="gpu_tasks.runner")
    hosts = _own_hosts(tmp_path, env)
    try:
        prof = ResourceProfile(name="mixed", gpus=1, address=hosts.address)
        results = _address_flow(prof, n=3, seconds=0.3)()
        assert all(isinstance(r, dict) for r in results), results
        assert {r["devices"][0].rsplit(":", 1)[1] for r in results} == {"0"}  # all on the worker that can
        with hosts.client() as client:
            assert len(client.scheduler_info(n_workers=-1)["workers"]) == 2  # the other one is still up
    finally:
        hosts.stop()
    warned = [r.getMessage() for r in caplog.records if "gets none of its tasks" in r.getMessage()]
    assert warned and "gpu-tasks is not installed on this worker" in warned[0], warned


def test_a_worker_that_sees_every_device_owns_its_first(prefect_server, tmp_path: Path):
    """``dask cuda worker`` shows each worker every device, its own first; GPU=1 means the first."""
    from remote_clusters.conftest import HOST_GPUS

    env = [
        {"CUDA_VISIBLE_DEVICES": "1,0", "GPU_TASKS_EMULATED_GPUS": HOST_GPUS},
        {"CUDA_VISIBLE_DEVICES": "0,1", "GPU_TASKS_EMULATED_GPUS": HOST_GPUS},
    ]
    hosts = _own_hosts(tmp_path, env)
    try:
        prof = ResourceProfile(name="pinned", gpus=1, address=hosts.address)
        results = _address_flow(prof, n=4, seconds=0.5)()
    finally:
        hosts.stop()
    assert all(len(r["devices"]) == 1 for r in results), results
    assert {r["devices"][0].rsplit(":", 1)[1] for r in results} == {"0", "1"}


def test_ctrl_c_cancels_queued_tasks_on_the_shared_cluster(gpu_hosts: Hosts, prefect_server, tmp_path: Path):
    from faults._procs import ctrl_c

    markers, ready = tmp_path / "started", tmp_path / "ready"
    markers.mkdir()
    env = {**os.environ, "PREFECT_API_URL": str(get_current_settings().api.url)}
    script = Path(__file__).with_name("ctrl_c_script.py")
    with (tmp_path / "out").open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(script), gpu_hosts.address, str(markers), str(ready)],
            env=env,
            start_new_session=True,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        while len(list(markers.iterdir())) < 2:  # two tasks run, the third waits for a GPU
            assert proc.poll() is None, (tmp_path / "out").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "out").read_text()[-3000:]
            time.sleep(0.1)
        started = time.time()
        took = ctrl_c(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert took < float("inf"), "the flow process did not exit after the Ctrl-C (killed at 30 s)"
    # the running tasks are interrupted on their workers (their GPUs free at once), the queued
    # one never starts
    with gpu_hosts.client() as client:

        def left() -> list[str]:
            """The run's tasks the scheduler or a worker still has, in any state (a worker keeps a
            cancelled task until its thread returns)."""
            keys = [
                str(k) for k in client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.tasks))
            ]
            keys += [
                str(k)
                for ks in client.run(lambda dask_worker: list(dask_worker.state.tasks)).values()
                for k in ks
            ]
            return [k for k in keys if k.startswith("long_gpu_task-")]  # <task>-<task run>-<attempt>

        deadline = time.monotonic() + 30
        while (any(client.run(executing_keys).values()) or left()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(client.run(executing_keys).values()), client.run(executing_keys)
        freed = time.time()
        assert not left(), left()  # nothing of the run is left that could start or end later
        assert len(client.scheduler_info(n_workers=-1)["workers"]) == 2  # the shared cluster is unharmed
    print(f"shared workers free {freed - started:.2f} s after the Ctrl-C")
    starts = [float((markers / i).read_text()) for i in ("0", "1")]
    assert freed < min(starts) + 12, "the tasks ran to their end"  # the 12 s tasks were interrupted
    assert sorted(p.name for p in markers.iterdir()) == ["0", "1"]  # none ended, the third never began
    runs = flow_run_task_runs(  # as the server records them, from their events a moment later
        ready.read_text(),
        lambda rs: (
            len(rs) == 3  # the queued one's too: it has a task run from its crash report only
            and not {r["state_type"] for r in rs} & {"RUNNING", "PENDING"}
            and sum(r["state_type"] == "CRASHED" for r in rs) >= 2
        ),
    )
    states = [r["state_type"] for r in runs]
    assert runs and not set(states) & {"RUNNING", "PENDING"}, states
    crashed = [r["state"]["message"] for r in runs if r["state_type"] == "CRASHED"]
    ran = [m for m in crashed if "before this task started" not in m]  # the runner's, or the engine's
    assert len(ran) == 2 and all("interrupt" in m for m in ran), crashed
    # the queued one says it never started, and its run count is 0 (it said "while this task ran",
    # run count 1, until 2026-12-07: a new-user pass)
    never = [r for r in runs if "before this task started" in (r["state"]["message"] or "")]
    assert len(never) == 1 and never[0]["run_count"] == 0, [(r["state"], r["run_count"]) for r in runs]
    # the next flow run's tasks run there (a worker interrupted twice once wedged for good)
    results = _address_flow(ResourceProfile(name="next", gpus=1, address=gpu_hosts.address), n=2)()
    assert all(isinstance(r, dict) for r in results), results


# serial: which worker Dask's scheduler gives each queued task (with GPU=1 restrictions, at arrival,
# by its occupancy estimate) decides the order too; under the parallel phase's load both urgent
# tasks once went to one worker and a batch task started first on the other (clean-clone CI at
# bd79a0a), as at 2e5b610. Lane "timing" (the default): the serial phase's timing tests one after
# another, in one test process
@pytest.mark.serial
@pytest.mark.parametrize("urgent_priority", [10, 0])
def test_a_higher_priority_flow_run_goes_first_on_a_shared_scheduler(
    gpu_hosts: Hosts, prefect_server, tmp_path: Path, urgent_priority: int
):
    """Two workers with GPU=1; a priority-0 run queues four tasks, then another run queues two: at
    priority 10 its tasks start when the first two end, ahead of the queued ones; at priority 0 they
    wait their turn behind them (Dask's order of arrival). The first two batch tasks end only once
    all six tasks are at the scheduler (a release file), so the order depends on the priorities
    alone, not on how fast a loaded machine brings the second run to the scheduler."""
    release = tmp_path / "release"
    batch = prioritized_run(gpu_hosts, "batch", 4, 0.5, tmp_path, priority=0, release=str(release))
    # started now, submitting once both workers are busy: its start-up is not on the batch's clock
    go = tmp_path / "go-urgent"
    urgent = prioritized_run(gpu_hosts, "urgent", 2, 0.5, tmp_path, priority=urgent_priority, go=str(go))
    deadline = time.monotonic() + 120
    while len(list((tmp_path / "starts").glob("batch-*.start"))) < 2:  # both workers busy, two queued
        assert batch.poll() is None and time.monotonic() < deadline, batch.communicate()[0][-3000:]
        assert urgent.poll() is None, urgent.communicate()[0][-3000:]
        time.sleep(0.1)
    go.write_text("")
    while tasks_at_scheduler(gpu_hosts) < 6:  # the urgent run's two tasks have arrived too
        assert batch.poll() is None and urgent.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    release.write_text("")
    for proc in (batch, urgent):
        log = proc.communicate(timeout=240)[0].decode(errors="replace")
        assert proc.returncode == 0, log[-3000:]
    batch_starts = sorted(t["start"] for t in json.loads((tmp_path / "batch.json").read_text()))
    urgent_starts = sorted(t["start"] for t in json.loads((tmp_path / "urgent.json").read_text()))
    assert urgent_starts[0] > batch_starts[1], "the urgent run arrived after the first two started"
    if urgent_priority > 0:
        assert urgent_starts[-1] < batch_starts[2], (batch_starts, urgent_starts)
    else:
        assert urgent_starts[0] > batch_starts[2], (batch_starts, urgent_starts)
