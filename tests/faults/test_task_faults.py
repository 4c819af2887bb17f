"""Faults inside tasks: a dying worker process, KeyboardInterrupt/SystemExit raised by a task,
and nested submission on a profile with every slot taken. Real worker processes, real signals,
a real Prefect server; states asserted as the server recorded them."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from prefect import flow, task
from prefect.context import FlowRunContext
from prefect.states import StateType
from prefect_api import api

from faults._procs import server_task_run
from gpu_tasks import ProfileTaskRunner, ResourceProfile, current_allocation, profile
from gpu_tasks.devices import leases
from gpu_tasks.reporting.ledger import ended_ledger

pytestmark = pytest.mark.usefixtures("emulated", "no_leaked_processes")


def _server_states(task_run_id) -> list[str]:
    _, states = api("GET", "/task_run_states/", params={"task_run_id": str(task_run_id)})
    return [s["name"] for s in sorted(states, key=lambda s: s["timestamp"])]


# ---------------------------------------------------------------- a worker process dies mid-task
@task(tags=[profile("gpu")], retries=1)
def dies_once(marker: str) -> list[str]:
    flag = Path(marker)
    if not flag.exists():
        flag.write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would
    return list(current_allocation().devices)


@task(tags=[profile("gpu")])
def always_dies() -> None:
    os._exit(3)


def test_transient_worker_death_is_a_crash_that_prefect_retries_on_a_new_worker(tmp_path: Path):
    runner = ProfileTaskRunner(profiles=[ResourceProfile(name="gpu", gpus=1, max_workers=1, idle_timeout=30)])

    @flow(task_runner=runner)
    def one_death(marker: str):
        future = dies_once.submit(marker)
        return future.task_run_id, future.result(), list(FlowRunContext.get().task_runner.ledger)

    task_run_id, devices, ledger = one_death(str(tmp_path / "died"))
    assert devices in (["0"], ["1"])
    run = server_task_run(task_run_id, lambda r: r["state_type"] == "COMPLETED" and r["run_count"] == 2)
    assert run["state_type"] == "COMPLETED" and run["run_count"] == 2, run
    # the re-run continues the task run, tagged where it ran, as a first run is (it kept the flow's tags)
    assert {"profile:gpu", f"gpu:{devices[0]}", "gpu-tasks:emulated"} <= set(run["tags"]), run["tags"]
    states = _server_states(task_run_id)
    assert "Crashed" in states and "AwaitingRetry" in states and states[-1] == "Completed", states
    crashed_rows = [r for r in ledger if r.reason.startswith("worker crashed")]
    assert len(crashed_rows) == 1 and "signal 9" in crashed_rows[0].reason, ledger
    assert crashed_rows[0].devices  # the dead worker's device went back to the pool
    assert not any(leases.holders(Path(os.environ["GPU_TASKS_LEASE_DIR"]), ["0", "1"]).values())


def test_a_crash_is_retried_only_where_the_tasks_retry_condition_allows(tmp_path: Path):
    """Its retry_condition_fn is asked of a crash retry as Prefect asks it of a failure's: a task whose
    condition said no was retried all the same (a new-user pass, 2 of 2)."""
    asked = tmp_path / "asked"

    def never(task, task_run, state) -> bool:
        with asked.open("a") as f:
            f.write(f"{state.type.value}\n")
        return False

    runner = ProfileTaskRunner(profiles=[ResourceProfile(name="gpu", gpus=1, max_workers=1, idle_timeout=30)])
    declines = dies_once.with_options(retries=2, retry_condition_fn=never)

    @flow(task_runner=runner)
    def one_death(marker: str):
        future = declines.submit(marker)
        future.wait()
        return future.task_run_id, future.state

    task_run_id, state = one_death(str(tmp_path / "died"))
    assert state.type == StateType.CRASHED, state
    assert asked.read_text().split() == ["CRASHED"]
    run = server_task_run(task_run_id, lambda r: r["state_type"] == "CRASHED")
    assert run["run_count"] == 1, run


def test_persistent_worker_death_ends_crashed_with_profile_device_worker_and_exit_status():
    runner = ProfileTaskRunner(profiles=[ResourceProfile(name="gpu", gpus=1, idle_timeout=30)])

    @flow(task_runner=runner)
    def keeps_dying():
        future = always_dies.submit()
        future.wait()
        return future.task_run_id, future.state, list(FlowRunContext.get().task_runner.ledger)

    task_run_id, state, ledger = keeps_dying()
    assert state.type == StateType.CRASHED
    for words in ("profile 'gpu'", "device(s) ", "(emulated)", "pid ", "exited with status 3"):
        assert words in state.message, state.message
    run = server_task_run(task_run_id, lambda r: r["state_type"] == "CRASHED")
    assert run["state_type"] == "CRASHED" and "exited with status 3" in run["state"]["message"], run
    assert run["run_count"] == 1  # Dask did not re-run it behind Prefect's back
    assert [r.reason for r in ledger if r.reason.startswith("worker crashed")]
    # tagged with the device it died on, as a run that ends otherwise: its worker, dead at once, sent
    # no state with them, and the UI's filter by device missed exactly the crashed runs (a new-user pass)
    device = state.message.split("device(s) ")[1].split(" ")[0]
    assert {"profile:gpu", f"gpu:{device}", "gpu-tasks:emulated"} <= set(run["tags"]), run["tags"]


def test_every_task_of_a_dead_worker_is_reported_on_its_device(tmp_path: Path):
    """Four gpus=0.25 tasks share one worker process on device 0; it dies under them: each task run
    ends Crashed, and every report names device 0 (the first report retires the worker, the others
    still name the device it had, not the CPU)."""
    started = tmp_path

    @task(tags=[profile("quarter")])
    def wait_then_die(i: int) -> None:
        (started / str(i)).write_text("")
        while len(list(started.iterdir())) < 4:
            time.sleep(0.05)
        time.sleep(0.2 * i)
        if i == 0:
            os._exit(3)
        time.sleep(60)

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="quarter", gpus=0.25, max_workers=1)]))
    def dies_under_four():
        futures = [wait_then_die.submit(i) for i in range(4)]
        for f in futures:
            f.wait()
        return [f.state for f in futures]

    states = dies_under_four()
    assert [s.type for s in states] == [StateType.CRASHED] * 4, states
    where = {
        re.search(r"on (device\(s\) \S+ \(emulated\)|CPU[^(]*|an unknown device)", s.message or "")
        for s in states
    }
    named = {m.group(1) if m else None for m in where}
    assert len(named) == 1 and next(iter(named), "").startswith("device(s) "), "\n".join(
        s.message or "" for s in states
    )


def test_tasks_lost_with_a_dead_worker_are_retried_per_their_retries(tmp_path: Path):
    """The same death with retries=1: all four task runs run again on a new worker and return their
    results (none fails with the Dask client's cancellation or a closed loop)."""
    started = tmp_path

    @task(tags=[profile("quarter")], retries=1)
    def dies_once(i: int) -> int:
        if (started / "died").exists():
            return i  # the re-run, on the new worker
        (started / str(i)).write_text("")
        while len(list(started.iterdir())) < 4:
            time.sleep(0.05)
        if i == 0:
            time.sleep(0.3)
            (started / "died").write_text("")
            os._exit(3)
        time.sleep(60)
        return -1

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="quarter", gpus=0.25, max_workers=1)]))
    def dies_under_four_with_retries():
        futures = [dies_once.submit(i) for i in range(4)]
        return [f.result() for f in futures], [f.task_run_id for f in futures]

    results, ids = dies_under_four_with_retries()
    assert results == [0, 1, 2, 3]
    for task_run_id in ids:  # each ran twice: crashed with the worker, then completed
        run = server_task_run(task_run_id, lambda r: r["state_type"] == "COMPLETED")
        assert run["run_count"] == 2, run


def test_a_worker_that_dies_after_every_task_was_handed_out_is_replaced(tmp_path: Path):
    """A quarter-GPU profile on both devices, every task already handed to its cluster (no retries);
    one worker process dies of SIGSEGV. Its device is given back and a new worker takes it for the tasks left:
    no later dispatch comes to grow the cluster again (at 100,000 tasks, one worker went on alone
    for 9 minutes). The tasks started after the death wait until one of them runs on the dead
    worker's device, so without a new worker there they time out and fail the test. Only the tasks
    running on the dead worker (at most its four slots) end Crashed: the ones Dask had only
    queued on it run again (before, they crashed with it: 20-odd of the 48)."""
    seen = tmp_path

    @task(tags=[profile("quarter")])
    def work(i: int) -> str:
        dev = os.environ["CUDA_VISIBLE_DEVICES"]
        died = seen / "died"
        if not died.exists():
            (seen / f"before-{dev}-{i}").touch()
            if i == 0:  # once a task has run on each device: this worker dies
                while len({p.name.split("-")[1] for p in seen.glob("before-*")}) < 2:
                    time.sleep(0.02)
                (seen / "died.tmp").write_text(dev)
                os.replace(seen / "died.tmp", died)
                os.kill(os.getpid(), signal.SIGSEGV)
            time.sleep(0.2)
            return dev
        (seen / f"after-{dev}-{i}").touch()
        deadline = died.stat().st_mtime + 60  # one minute after the death, for all of them
        while not list(seen.glob(f"after-{died.read_text()}-*")) and time.time() < deadline:
            time.sleep(0.02)
        return dev

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="quarter", gpus=0.25)]))
    def one_worker_dies():
        futures = [work.submit(i) for i in range(48)]
        for f in futures:
            f.wait()
        return [f.state for f in futures]

    states = one_worker_dies()
    dead = (seen / "died").read_text()
    after = {p.name.split("-")[1] for p in seen.glob("after-*")}
    assert after == {"0", "1"}, (dead, sorted(p.name for p in seen.iterdir()))
    # the tasks running on the dead worker crashed with it (no retries); those it had only queued ran
    lost = [s for s in states if not s.is_completed()]
    assert lost and all(s.type == StateType.CRASHED and "SIGSEGV" in (s.message or "") for s in lost), lost
    assert all(f"device(s) {dead} (emulated)" in (s.message or "") for s in lost), lost
    # at most its four slots: a task in one crashed with it whether its body had begun (a before-* file)
    # or its run was still in Prefect's engine (a CI run under load: 4 crashed, 1 body begun there)
    begun_there = {p.name.split("-")[2] for p in seen.glob(f"before-{dead}-*")}
    assert begun_there and 1 <= len(lost) <= 4, (len(lost), sorted(begun_there))


def test_tasks_interrupted_by_a_dead_worker_are_booked_on_its_row_not_its_replacement(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """One device, a quarter-GPU profile, 12 tasks and no retries: the worker dies 0.5 s after its four
    slots began. Its four tasks count on the dead worker's row (busy until the death, ``interrupted``);
    the replacement's row has the eight that ran there, none interrupted (before, the dead worker's
    row had no task and the replacement's all twelve, four of them "interrupted")."""
    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "H100:80GiB")
    began = tmp_path / "began"
    began.mkdir()
    died = tmp_path / "died"

    @task(tags=[profile("quarter")])
    def work(i: int) -> int:
        if died.exists():  # queued on the dead worker: runs on its replacement
            time.sleep(1.5)
            return i
        (began / str(i)).touch()
        while len(list(began.iterdir())) < 4:
            time.sleep(0.02)
        if i == min(int(p.name) for p in began.iterdir()):  # one of the four kills their worker
            time.sleep(0.5)
            died.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
        return -1

    @flow(
        task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="quarter", gpus=0.25, idle_timeout=30)])
    )
    def dies_under_four_of_twelve():
        futures = [work.submit(i) for i in range(12)]
        for f in futures:
            f.wait()
        return [f.state for f in futures], FlowRunContext.get().flow_run.id

    states, flow_run_id = dies_under_four_of_twelve()
    ledger = ended_ledger(flow_run_id) or []  # the final ledger, with the row its exit wrote
    crashed = [s for s in states if s.type == StateType.CRASHED]
    assert len(crashed) == 4 and all("SIGKILL" in (s.message or "") for s in crashed), states
    assert sum(s.is_completed() for s in states) == 8, states
    rows = {r.reason.split(":")[0]: r for r in ledger}
    assert len(ledger) == 2 and set(rows) == {"worker crashed", "flow run ended"}, ledger
    dead, replacement = rows["worker crashed"], rows["flow run ended"]
    assert (dead.tasks, dead.interrupted) == (4, 4), dead
    assert 0.4 <= dead.busy_seconds <= dead.held_seconds, dead
    assert [span.tasks for span in dead.spans] == [4], dead.spans
    assert abs(sum(s.busy_seconds for s in dead.spans) - dead.busy_seconds) < 1e-6, dead
    assert all(dead.provisioned_at <= s <= e <= dead.closed_at for s, e in dead.spans[0].busy), dead
    assert (replacement.tasks, replacement.interrupted) == (8, 0), replacement
    assert replacement.busy_seconds <= replacement.held_seconds, replacement


# ---------------------------------------------------------------- BaseException raised by a task
@pytest.mark.parametrize("kind", ["threads", "processes", "gpu"])
def test_keyboard_interrupt_and_system_exit_in_a_task_end_crashed_and_wait_returns(kind: str):
    prof = {
        "threads": ResourceProfile(name="p", cpus=1),
        "processes": ResourceProfile(name="p", cpus=1, processes=True),
        "gpu": ResourceProfile(name="p", gpus=1, max_workers=1),
    }[kind]

    @task(tags=[profile("p")])
    def interrupts(exc_name: str) -> None:
        raise {"KeyboardInterrupt": KeyboardInterrupt, "SystemExit": SystemExit}[exc_name]()

    @task(tags=[profile("p")])
    def fine() -> int:
        return 7

    @flow(task_runner=ProfileTaskRunner(profiles=[prof]))
    def interrupted_tasks():
        out = {}
        for name in ("KeyboardInterrupt", "SystemExit"):
            future = interrupts.submit(name)
            future.wait()  # returns: the task's exception does not escape into the flow
            out[name] = (future.task_run_id, future.state)
        return out, fine.submit().result()  # the worker (or thread pool) still runs tasks

    states, after = interrupted_tasks()
    assert after == 7
    for name, (task_run_id, state) in states.items():
        assert state.type == StateType.CRASHED, (name, state)
        run = server_task_run(task_run_id, lambda r: r["state_type"] == "CRASHED")
        assert run["state_type"] == "CRASHED" and run["run_count"] == 1, (name, run)


# ---------------------------------------------------------------- nested submission, one slot
@pytest.mark.parametrize("kind", ["threads", "processes", "gpu"])
def test_nested_submission_with_every_slot_taken_does_not_deadlock(kind: str):
    prof = {
        "threads": ResourceProfile(name="p", cpus=os.cpu_count() or 1),  # one slot
        "processes": ResourceProfile(name="p", cpus=os.cpu_count() or 1, processes=True),
        "gpu": ResourceProfile(name="p", gpus=1, max_workers=1),  # one whole device, one slot
    }[kind]

    @task(tags=[profile("p")])
    def leaf(x: int) -> int:
        return x + 1

    @task(tags=[profile("p")])
    def middle(x: int) -> int:
        return sum(f.result() for f in [leaf.submit(x), leaf.submit(x + 10)])

    @task(tags=[profile("p")])
    def top(x: int) -> tuple[int, list[str]]:
        return middle.submit(x).result() * 10, list(current_allocation().devices)

    @flow(task_runner=ProfileTaskRunner(profiles=[prof]))
    def nested():
        return top.submit(1).result(timeout=120)

    value, devices = nested()
    assert value == ((1 + 1) + (11 + 1)) * 10
    assert (len(devices) == 1) == (kind == "gpu")


def test_nested_task_of_another_profile_in_a_worker_process_fails_with_the_fix():
    @task(tags=[profile("cpu")])
    def elsewhere() -> int:
        return 1

    @task(tags=[profile("gpu")])
    def parent() -> int:
        return elsewhere.submit().result()

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="gpu", gpus=1, max_workers=1)]))
    def mixed():
        future = parent.submit()
        future.wait()
        return future.state.is_failed(), future.state.message  # (a returned Failed state would fail the flow)

    failed, message = mixed()
    assert failed
    assert "nested tasks run on their parent's profile" in message and "profile('gpu')" in message


# ---------------------------------------------------------------- reports from outside the flow run
@pytest.mark.parametrize("sent_from", ["no run", "another flow run"])
def test_a_crash_reported_outside_its_flow_run_keeps_the_task_run_in_it(sent_from: str):
    """A shared worker reports the attempt of its dead predecessor ``Crashed`` outside any Prefect run
    context (gpu_tasks.worker.engine._after_lost_worker), where Prefect's events worker may hold the
    context of another flow run (the one it began in): the event names the task run's own flow run, so
    the server's recorder keeps the task run under it (it cleared ``flow_run_id``, or moved it)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Running

    from gpu_tasks.prefect_api.states import crash_task_run

    @task
    def lost() -> None: ...

    @flow
    def parent() -> None: ...

    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run(parent)
        task_run = client.create_task_run(lost, flow_run.id, dynamic_key="0", state=Running())

    def report() -> None:
        crash_task_run(task_run.id, lost, flow_run.id, "its worker died", wait=5.0)

    flow(report)() if sent_from == "another flow run" else report()
    run = server_task_run(task_run.id, lambda r: r["state_type"] == "CRASHED")
    assert run["state_type"] == "CRASHED" and run["flow_run_id"] == str(flow_run.id), run


@task(tags=[profile("gpu")])
def sleeps_long(marker: str) -> None:
    Path(marker).write_text("")
    time.sleep(60)


def test_a_task_still_queued_when_the_flow_run_stopped_is_reported_as_not_started(tmp_path: Path):
    """Three tasks on two devices; the flow raises once two run: the third, only queued on a worker,
    is reported stopped before it started, not as running there."""
    ids: list = []

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="gpu", gpus=1, max_workers=2)]))
    def stops_early() -> None:
        ids.extend(sleeps_long.submit(str(tmp_path / f"began-{i}")).task_run_id for i in range(3))
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("began-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        raise RuntimeError("the flow gives up")

    with pytest.raises(RuntimeError, match="gives up"):
        stops_early()
    runs = [server_task_run(i, lambda r: r["state_type"] == "CRASHED") for i in ids]
    messages = sorted(r["state"]["message"] for r in runs)
    assert [("before this task started" in m, "while this task ran" in m) for m in messages] == [
        (True, False),
        (False, True),
        (False, True),
    ], messages
