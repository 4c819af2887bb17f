"""The flow process is SIGKILLed while GPU tasks run: its workers and their children exit by
themselves (gpu_tasks.worker.guard), and the next flow run gets the devices at once."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest
from prefect import flow, task, unmapped
from prefect.context import FlowRunContext

from faults._procs import marked as _marked
from gpu_tasks import ProfileTaskRunner, ResourceProfile, profile
from gpu_tasks.devices import leases
from gpu_tasks.worker.guard import MODULE, preload_options

# a liveness bound, not a speed claim: the time it takes is measured in bench.faults (flow_sigkilled,
# 0.25-0.6 s); a loaded 2-core machine has taken over 5 s
EXIT_BOUND_S = 30

SCRIPT = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from pathlib import Path
    from prefect import flow, task
    from gpu_tasks import ProfileTaskRunner, ResourceProfile, profile

    READY = Path(sys.argv[1])

    @task(tags=[profile("gpu")])
    def gpu_task_with_a_child(i):
        child = subprocess.Popen(["sleep", "300"])
        from prefect.runtime import flow_run
        (READY.parent / "flow_run_id").write_text(str(flow_run.id))
        (READY / f"task-{i}").write_text(f"{os.getpid()} {child.pid}")
        time.sleep(300)

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="gpu", gpus=1)]))
    def doomed():
        futures = gpu_task_with_a_child.map(range(2))
        [f.result() for f in futures]

    if __name__ == "__main__":
        doomed()
    """
)


def _command(p) -> str:
    """A process's command line; "" once it has ended (the warm pool's fork server ends at once
    with its killed flow process, between the listing and this read: a CI run failed so)."""
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def _kill_all(procs: list[psutil.Process]) -> None:
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(procs, timeout=5)


@task(tags=[profile("gpu")])
def visible_device(i: int, folder: str) -> str:
    # a rendezvous: both tasks must hold a device at once (a second worker may start slowly)
    Path(folder, str(i)).write_text("")
    deadline = time.monotonic() + 60
    while len(list(Path(folder).iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    return os.environ.get("CUDA_VISIBLE_DEVICES", "")


def next_run(folder: str) -> tuple[list[str], float]:
    """A flow run after the killed one (its runner built here: test modules do no I/O at import)."""

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="gpu", gpus=1, idle_timeout=0.5)]))
    def next_run(folder: str) -> tuple[list[str], float]:
        futures = visible_device.map(range(2), unmapped(folder))
        devices = [f.result() for f in futures]
        startup = FlowRunContext.get().task_runner.status()["gpu"]["startup"]
        return devices, startup["wait_devices_s"]

    return next_run(folder)


@pytest.mark.usefixtures("prefect_server")
@pytest.mark.parametrize("output", ["kept", "closed"])
def test_workers_and_their_children_exit_with_a_killed_flow(tmp_path: Path, monkeypatch, output: str):
    """``closed``: the flow's output went to a pipe whose reader is gone too, as under Prefect's
    ``serve``, which a Ctrl-C ends while it kills the flow process. A worker's line on the way out then
    made Prefect's console handler raise ``SystemExit`` in the worker's guard thread: the workers
    outlived the flow by 30 s (until Dask's connect timeout), the task runs ``Running`` meanwhile."""
    from prefect.settings import get_current_settings

    marker = uuid.uuid4().hex
    script = tmp_path / "doomed_flow.py"
    script.write_text(SCRIPT)
    ready = tmp_path / "ready"
    ready.mkdir()
    env = {
        **os.environ,
        "GPU_TASKS_TEST_MARKER": marker,
        "GPU_TASKS_EMULATED_GPUS": "2",
        "PREFECT_API_URL": str(get_current_settings().api.url),
    }
    piped = subprocess.PIPE if output == "closed" else None
    proc = subprocess.Popen(
        [sys.executable, str(script), str(ready)], env=env, cwd=tmp_path, stdout=piped, stderr=piped
    )
    try:
        deadline = time.monotonic() + 120
        while len(list(ready.iterdir())) < 2:
            assert proc.poll() is None, "the flow exited before its GPU tasks started"
            assert time.monotonic() < deadline, "the GPU tasks never started"
            time.sleep(0.2)
        pids = {int(n) for f in ready.iterdir() for n in f.read_text().split()}
        before = [p for p in _marked(marker) if p.pid != proc.pid]
        assert pids <= {p.pid for p in before}, "expected the workers and their children to carry the marker"
        if output == "closed":  # the reader goes first: nothing the workers write reaches anyone
            for stream in (proc.stdout, proc.stderr):
                stream.close()

        killed = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        while _marked(marker) and time.monotonic() - killed < EXIT_BOUND_S:
            time.sleep(0.05)
        took = time.monotonic() - killed
        survivors = [f"{p.pid} {_command(p)[:100]}" for p in _marked(marker)]
        print(f"kill-to-exit: {took:.2f}s for {len(before)} worker and child processes")
        assert not survivors, f"processes outlived the SIGKILLed flow by {EXIT_BOUND_S}s: {survivors}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        _kill_all(_marked(marker))

    # the workers reported the killed run before they exited: nothing is left Running on the server
    from prefect_api import api

    flow_run_id = (tmp_path / "flow_run_id").read_text()
    deadline = time.monotonic() + 20
    while True:
        _, run = api("GET", f"/flow_runs/{flow_run_id}")
        _, tasks = api("POST", "/task_runs/filter", json={"flow_runs": {"id": {"any_": [flow_run_id]}}})
        states = sorted(t["state_type"] for t in tasks)
        if (
            run["state_type"] == "CRASHED" and states == ["CRASHED", "CRASHED"]
        ) or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert run["state_type"] == "CRASHED" and "died" in run["state"]["message"], run["state"]
    assert states == ["CRASHED", "CRASHED"], [(t["name"], t["state_type"]) for t in tasks]
    assert all("the flow process" in t["state"]["message"] for t in tasks)
    if output == "closed":
        return

    # the kernel dropped the dead flow's leases with its files: both devices are free now
    assert leases.holders(Path(os.environ["GPU_TASKS_LEASE_DIR"]), ["0", "1"]) == {"0": None, "1": None}
    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "2")
    # at once: a lease of another process in the way would fail the run (ClusterError), not wait
    monkeypatch.setenv("GPU_TASKS_LEASE_TIMEOUT", "0")
    t0 = time.monotonic()
    (tmp_path / "meet").mkdir()
    devices, waited = next_run(str(tmp_path / "meet"))
    print(
        f"next flow run: devices {devices}, waited {waited:.3f}s for devices, {time.monotonic() - t0:.1f}s "
        "in all"
    )
    assert sorted(devices) == ["0", "1"]


def test_a_flow_killed_on_prefects_ephemeral_api_is_reported_to_its_server(tmp_path: Path):
    """A plain script on Prefect's default ephemeral API (no server, no PREFECT_API_URL), SIGKILLed
    while GPU tasks run: its workers report the flow run and task runs ``Crashed`` to the flow
    process's ephemeral server (which Prefect leaves running), and start no server of their own.
    They reported with their own settings, which name no server: each worker started a temporary
    server, the reports failed ("No Prefect API URL provided"), the runs stayed ``Running`` and the
    workers lived 12-15 s (found by a new-user pass, Prefect 3.9.1 and 3.8.8)."""
    from faults._procs import clean_env, db_rows, kill_marked, wait_gone

    marker = uuid.uuid4().hex
    (tmp_path / "doomed_flow.py").write_text(SCRIPT)
    ready = tmp_path / "ready"
    ready.mkdir()
    home = tmp_path / "prefect-home"
    env = clean_env(marker, PREFECT_HOME=str(home), GPU_TASKS_EMULATED_GPUS="2")
    log = tmp_path / "out.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "doomed_flow.py", str(ready)], env=env, cwd=tmp_path, stdout=out, stderr=out
        )
    try:
        deadline = time.monotonic() + 180
        while len(list(ready.iterdir())) < 2:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the GPU tasks never started"
            time.sleep(0.2)
        proc.kill()
        proc.wait(timeout=10)
        # Prefect's own ephemeral server outlives its killed flow process (a plain Prefect flow's too)
        server = [p.pid for p in _marked(marker) if "uvicorn" in _command(p)]
        assert len(server) == 1, [_command(p)[:120] for p in _marked(marker)]
        _, left = wait_gone(marker, timeout=EXIT_BOUND_S, keep=server[0])
        assert not left, f"processes outlived the SIGKILLed flow: {left}"
    finally:
        kill_marked(marker)
    output = log.read_text()
    assert output.count("Starting temporary server") == 1, output[-3000:]  # the flow process's alone
    flow_run_id = (tmp_path / "flow_run_id").read_text()
    runs = db_rows(
        home / "prefect.db",
        "select f.state_type, s.message from flow_run f join flow_run_state s on s.id = f.state_id "
        "where f.id = ?",
        flow_run_id,
    )
    tasks = db_rows(home / "prefect.db", "select state_type from task_run where flow_run_id = ?", flow_run_id)
    assert runs and runs[0][0] == "CRASHED" and "died" in runs[0][1], (runs, output[-3000:])
    assert sorted(t[0] for t in tasks) == ["CRASHED", "CRASHED"], tasks


def test_preload_options_add_the_guard_once_and_keep_other_preloads():
    assert preload_options([], []) == {"preload": [MODULE], "preload_argv": []}
    # dask-cuda's shape: its own preload and one flat argv that every preload gets
    flat = preload_options(["dask_cuda.initialize"], ["--create-cuda-context"])
    assert flat == {"preload": ["dask_cuda.initialize", MODULE], "preload_argv": ["--create-cuda-context"]}
    nested = preload_options(["a"], [["--x"]])
    assert nested == {"preload": ["a", MODULE], "preload_argv": [["--x"], []]}
    assert preload_options(nested["preload"], nested["preload_argv"]) == nested


GUARDED = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from gpu_tasks.worker import guard as _worker_guard

    _worker_guard.start(os.getppid())
    child = subprocess.Popen(["sleep", "300"])
    print(os.getpid(), child.pid, flush=True)
    time.sleep(300)
    """
)


def test_guard_without_dask_exits_with_its_parent_and_ignores_sigint():
    """The watch thread alone (no Dask parent pipe): parent SIGKILLed -> guarded process and child gone."""
    marker = uuid.uuid4().hex
    env = {**os.environ, "GPU_TASKS_TEST_MARKER": marker}
    # an intermediate parent that starts the guarded process, then sleeps
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {GUARDED!r}]); "
            "time.sleep(300)",
        ],
        env=env,
    )
    try:
        deadline = time.monotonic() + 30
        while len(_marked(marker)) < 3:  # parent, guarded, sleep
            assert time.monotonic() < deadline, "the guarded process never started its child"
            time.sleep(0.1)
        guarded = next(p for p in _marked(marker) if p.ppid() == parent.pid)
        guarded.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert guarded.is_running() and guarded.status() != psutil.STATUS_ZOMBIE, (
            "SIGINT ended the guarded process"
        )

        killed = time.monotonic()
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        while _marked(marker) and time.monotonic() - killed < EXIT_BOUND_S:
            time.sleep(0.05)
        took = time.monotonic() - killed
        print(f"guard alone, kill-to-exit: {took:.2f}s")
        assert not _marked(marker), f"the guarded process or its child outlived its parent by {EXIT_BOUND_S}s"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=10)
        _kill_all(_marked(marker))


def test_a_sigterm_during_the_guards_own_exit_neither_hangs_nor_orphans_its_child():
    """A worker ending its children on its way out (the guard's ``os._exit``) gets a SIGTERM (a Prefect
    worker's shutdown signals the process group): it still exits, its child ended. Before, the signal's
    handler waited for the clean-up it interrupted, in the same thread: the process hung for good."""
    marker = uuid.uuid4().hex
    script = (
        "import os, signal, subprocess, sys, threading, time\n"
        "from gpu_tasks.worker import guard\n"
        "guard.start(os.getppid())\n"
        # a child that ignores SIGTERM: the clean-up waits its grace (1 s) before SIGKILL
        "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)'])\n"
        "time.sleep(1.0)\n"
        "threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()\n"
        "os._exit(3)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], env={**os.environ, "GPU_TASKS_TEST_MARKER": marker}
    )
    try:
        assert proc.wait(timeout=30) == 3, "the process did not exit with its own status"
        deadline = time.monotonic() + 10
        while _marked(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _marked(marker), "the guarded process's child outlived it"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        _kill_all(_marked(marker))


def test_a_guarded_worker_that_segfaults_prints_where_it_was():
    """A 100,000-task run lost a worker to SIGSEGV with nothing but the signal to go on: the guard
    turns faulthandler on, so the dying worker prints its threads' Python tracebacks to its stderr."""
    script = textwrap.dedent(
        """
        import os, signal
        from gpu_tasks.worker import guard as _worker_guard

        def task_body_that_crashes():
            os.kill(os.getpid(), signal.SIGSEGV)

        _worker_guard.start(os.getppid())
        task_body_that_crashes()
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == -signal.SIGSEGV, (out.returncode, out.stderr[-2000:])
    assert "Fatal Python error: Segmentation fault" in out.stderr, out.stderr[-2000:]
    assert "task_body_that_crashes" in out.stderr, out.stderr[-2000:]
