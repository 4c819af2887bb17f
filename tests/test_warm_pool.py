"""Warm worker processes (gpu_tasks.worker.warm): they hold no device until a lease binds one,
a GPU task runs in one, and none outlives its runner, even when the flow process is killed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest
from faults._procs import clean_env, kill_marked
from prefect import flow, task
from prefect.context import FlowRunContext

from gpu_tasks import ProfileTaskRunner, ResourceProfile, current_allocation, profile
from gpu_tasks.devices import leases

pytestmark = pytest.mark.usefixtures("prefect_server", "emulated")


def _environ(pid: int) -> dict[str, str]:
    """The environment ``pid`` was started with."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def _until(check: Any, what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@task
def cpu_step() -> int:
    return os.getpid()


@task(tags=[profile("gpu")])
def where() -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "devices": list(current_allocation().devices),
    }


def _runner() -> ProfileTaskRunner:
    return ProfileTaskRunner(profiles=[ResourceProfile(name="gpu", gpus=1, idle_timeout=30)])


def test_a_warm_process_holds_no_device_until_a_lease_binds_it(lease_dir: Path, no_leaked_processes):
    @flow(task_runner=_runner())
    def f() -> dict[str, Any]:
        runner = FlowRunContext.get().task_runner
        cpu_step.submit().result()  # the runner's first task starts the pool
        ready = lambda: [w for w in runner.warm_workers() if w["ready"]]  # noqa: E731
        warm = _until(lambda: len(ready()) >= 2 and ready(), "2 ready warm processes")
        seen = {
            "warm": [w["pid"] for w in warm],
            "visible": [_environ(w["pid"]).get("CUDA_VISIBLE_DEVICES") for w in warm],
            "state": runner.status()["gpu"]["state"],
            "held": leases.holders(lease_dir, ["0", "1"]),
        }
        seen["task"] = where.submit().result()
        seen["held_by_task"] = runner.status()["gpu"]["devices"]
        seen["after"] = [w["pid"] for w in runner.warm_workers()]
        return seen

    seen = f()
    # warm and unbound: started with no visible device, no profile running, no device leased
    assert seen["visible"] == ["", ""]
    assert seen["state"] == "absent"
    assert seen["held"] == {"0": None, "1": None}
    # the GPU task ran in one of them, bound to the device its lease gave
    task_ = seen["task"]
    assert task_["pid"] in seen["warm"]
    assert task_["visible"] == task_["devices"][0] and task_["devices"] == seen["held_by_task"]
    # a bound process leaves the pool; another takes its place
    assert task_["pid"] not in seen["after"]
    # none of them outlives the flow run (the no_leaked_processes fixture checks the rest)
    for pid in [*seen["warm"], *seen["after"]]:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_no_pool_when_warm_workers_is_zero(monkeypatch, no_leaked_processes):
    monkeypatch.setenv("GPU_TASKS_TUNE_WARM_WORKERS", "0")

    @flow(task_runner=_runner())
    def f() -> tuple[list[Any], dict[str, Any]]:
        runner = FlowRunContext.get().task_runner
        cpu_step.submit().result()
        return runner.warm_workers(), where.submit().result()

    warm, task_ = f()
    assert warm == []
    assert task_["visible"] == task_["devices"][0]  # the nanny path binds the same way


def test_no_pool_and_no_line_without_devices(monkeypatch, no_leaked_processes):
    """No GPU and no emulation: no warm process could ever be bound, so none is started and the log
    does not say "0 warm worker process(es) starting"."""
    import logging

    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "0")  # no devices, also on a host with GPUs
    said: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    runner_log = logging.getLogger("gpu_tasks.runner")
    runner_log.addHandler(handler)

    @flow(task_runner=_runner())
    def f() -> bool:
        cpu_step.submit().result()
        return FlowRunContext.get().task_runner._live.pool is None

    try:
        no_pool = f()
    finally:
        runner_log.removeHandler(handler)
    assert any("gpu-tasks devices:" in line for line in said), said  # the runner's lines were seen
    assert no_pool and not [line for line in said if "warm worker process" in line], said
    assert not [line for line in said if "EMULATING" in line], said  # 0 emulated devices: no emulation


BROKEN = textwrap.dedent(
    """
    import os, sys
    from prefect import flow, task
    from gpu_tasks import ProfileTaskRunner, ResourceProfile, profile

    if __name__ == "__mp_main__" and os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        sys.exit(3)  # a warm process re-imports this script: it fails while starting

    @task(tags=[profile("gpu")])
    def one():
        return 1

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="gpu", gpus=1)]))
    def broken():
        return one.submit().result()

    if __name__ == "__main__":
        broken()
    """
)


def test_a_warm_process_that_fails_to_start_fails_the_task_clearly(tmp_path: Path, no_leaked_processes):
    from prefect.settings import get_current_settings

    script = tmp_path / "broken_flow.py"
    script.write_text(BROKEN)
    # spawned warm processes re-import the script (forked ones do not: it cannot fail them this way)
    env = clean_env(uuid.uuid4().hex, GPU_TASKS_EMULATED_GPUS="1", GPU_TASKS_TUNE_WARM_START="spawn")
    env["PREFECT_API_URL"] = str(get_current_settings().api.url)
    done = subprocess.run(
        [sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180
    )
    assert done.returncode != 0
    assert "warm worker process" in done.stderr and "exited with status 3 while starting" in done.stderr
    assert "could not start 1 worker(s)" in done.stderr
    assert 'if __name__ == "__main__":' in done.stderr


KILLED = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    from prefect import flow, task
    from prefect.context import FlowRunContext
    from gpu_tasks import ProfileTaskRunner, ResourceProfile, profile

    OUT = Path(sys.argv[1])

    @task
    def first():
        return 1

    @task(tags=[profile("gpu")])
    def busy():
        (OUT / "bound").write_text(str(os.getpid()))
        time.sleep(300)

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="gpu", gpus=1)]))
    def doomed():
        runner = FlowRunContext.get().task_runner
        first.submit().result()
        fut = busy.submit()
        while not (OUT / "bound").exists():
            time.sleep(0.05)
        while len(runner.warm_workers()) < 1:  # the profile can bind a second (2 devices): one kept
            time.sleep(0.05)
        (OUT / "warm.tmp").write_text(json.dumps([w["pid"] for w in runner.warm_workers()]))
        (OUT / "warm.tmp").rename(OUT / "warm.json")
        fut.result()

    if __name__ == "__main__":
        doomed()
    """
)


def test_warm_processes_exit_with_a_killed_flow_process(tmp_path: Path):
    from prefect.settings import get_current_settings

    marker = uuid.uuid4().hex
    script = tmp_path / "doomed_flow.py"
    script.write_text(KILLED)
    out = tmp_path / "out"
    out.mkdir()
    env = clean_env(marker, GPU_TASKS_EMULATED_GPUS="2")  # two: the pool keeps one beside the bound one
    env["PREFECT_API_URL"] = str(get_current_settings().api.url)
    # a temporary directory of its own (short: the fork server's socket lives there), to see what
    # the killed flow leaves in it: no launcher script
    scratch = Path(tempfile.mkdtemp(prefix="gpu-tasks-killed-"))
    env["TMPDIR"] = str(scratch)
    proc = subprocess.Popen([sys.executable, str(script), str(out)], env=env, cwd=tmp_path)
    try:
        _until(lambda: (out / "warm.json").exists() or proc.poll() is not None, "the pool's pids", 120)
        assert proc.poll() is None, "the flow exited early"
        pids = [*json.loads((out / "warm.json").read_text()), int((out / "bound").read_text())]
        assert all(psutil.pid_exists(p) for p in pids)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in pids if psutil.pid_exists(p)]
        assert not left, f"warm or bound worker processes outlived the SIGKILLed flow by 10 s: {left}"
        # what gpu-tasks wrote there: the one shared launcher script, nothing of the killed process's own
        ours = sorted(r for p in scratch.rglob("*") if "gpu-tasks" in (r := str(p.relative_to(scratch))))
        assert ours[:1] == [f"gpu-tasks-{os.getuid()}"] and len(ours) == 2, ours
        assert ours[1].endswith(".sh") and "/launch-" in ours[1], ours
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        kill_marked(marker)
        shutil.rmtree(scratch, ignore_errors=True)


def test_the_pool_keeps_no_more_idle_processes_than_can_still_be_bound():
    """GPU_TASKS_TUNE_WARM_WORKERS=2 for profiles that can bind one worker at once: one process is started;
    once it is bound none waits idle (nothing could take it); when it ends, a replacement starts."""
    from gpu_tasks.worker.warm import REFILL_DELAY_S, WarmPool, end_process

    pool = WarmPool(2, capacity=1)
    try:
        pool.start()
        assert len(pool.describe()) == 1
        proc = pool.take(60)
        time.sleep(REFILL_DELAY_S + 1)  # past the refill a take schedules
        assert pool.describe() == [] and pool.target() == 0
        end_process(proc.process, 1)
        pool.released(proc)
        idle = _until(lambda: pool.describe(), "a replacement after the bound process ended", 30)
        assert len(idle) == 1 and idle[0]["pid"] != proc.pid
    finally:
        pool.close()


def test_pools_of_one_process_share_its_fork_server_until_its_keep_runs_out(monkeypatch):
    """Flow runs one after another in one process (a served deployment, a test session) fork their
    warm processes from one fork server: the second pool's processes have the first's server as
    parent; with no pool left it is kept GPU_TASKS_TUNE_WARM_SERVER_KEEP_SECONDS, then ends; a pool
    after that starts a new one; with a keep of 0 it ends with its last pool."""
    from bench.overhead import leftovers as bench_leftovers
    from gpu_tasks.worker import forkserver
    from gpu_tasks.worker.warm import WarmPool, end_process

    def fork_server_in_use() -> dict:
        """Pools using this process's fork server and whether it is kept (unused); {} if none."""
        with forkserver._SHARED_LOCK:
            shared = forkserver._SHARED
            return {"pools": shared["users"], "kept": "timer" in shared} if "ctx" in shared else {}

    def server_of(pool: WarmPool) -> psutil.Process:
        proc = pool.take(60)
        server = psutil.Process(proc.pid).parent()
        proc.conn.close()  # never bound: it ends
        end_process(proc.process, 5)
        assert server is not None and "multiprocessing.forkserver" in " ".join(server.cmdline())
        return server

    monkeypatch.setenv("GPU_TASKS_TUNE_WARM_SERVER_KEEP_SECONDS", "2")
    # (one kept by an earlier test of this process is used too, with the keep set here)
    assert not fork_server_in_use().get("pools"), "a pool of another test is open"
    first = WarmPool(1)
    second = WarmPool(1)  # two pools at once (two runners) share it too
    try:
        server = server_of(first)
        assert server_of(second).pid == server.pid
        assert fork_server_in_use() == {"pools": 2, "kept": False}
    finally:
        first.close()
        second.close()
    assert fork_server_in_use() == {"pools": 0, "kept": True}
    # the overhead benchmark waits for an earlier row's processes to end: the kept server is
    # not one (it waited 60 s per row for it, and the real-GPU overhead check ran out of time)
    assert server.pid not in [p.pid for p in bench_leftovers()]
    third = WarmPool(1)  # within the keep: the same server
    try:
        assert server_of(third).pid == server.pid
    finally:
        third.close()
    _until(lambda: not server.is_running() or server.status() == psutil.STATUS_ZOMBIE, "the server ends", 30)
    assert fork_server_in_use() == {}
    monkeypatch.setenv("GPU_TASKS_TUNE_WARM_SERVER_KEEP_SECONDS", "0")
    fourth = WarmPool(1)
    try:
        again = server_of(fourth)
        assert again.pid != server.pid  # a new one
    finally:
        fourth.close()
    assert fork_server_in_use() == {}  # ended with its last pool
    _until(lambda: not again.is_running() or again.status() == psutil.STATUS_ZOMBIE, "the server ends", 30)


def test_a_warm_process_survives_a_ctrl_c_while_it_imports():
    """A terminal Ctrl-C reaches the warm processes too: one still importing ignores it (it starts
    with SIGINT ignored), prints no traceback, and becomes ready."""
    import multiprocessing

    from gpu_tasks.worker.warm import WarmProcess

    proc = WarmProcess(multiprocessing.get_context("spawn"))
    try:
        assert psutil.Process(proc.process.pid).is_running()
        time.sleep(0.1)  # past the launcher's first line (`trap '' INT`, a millisecond after exec)
        for _ in range(3):  # three times while it imports
            os.kill(proc.process.pid, signal.SIGINT)
            time.sleep(0.2)
        proc.wait_ready(60)
        os.kill(proc.process.pid, signal.SIGINT)  # ready: its worker guard ignores it
        time.sleep(0.5)
        assert proc.process.is_alive() and proc.process.exitcode is None
    finally:
        proc.process.kill()
        proc.process.join(10)


def test_starting_a_warm_process_leaves_the_flow_processs_environment_alone(tmp_path):
    """The child's environment (the nanny's variables, no device, SIGINT ignored) comes from a
    launcher script: the flow process's os.environ is the same throughout, so a CPU task running in
    the flow process meanwhile never sees CUDA_VISIBLE_DEVICES="" (as it did when os.environ was
    swapped for the spawn)."""
    from multiprocessing import spawn

    from gpu_tasks.worker.warm import _pre_spawn_environ, _spawn_environment

    before, executable = dict(os.environ), spawn.get_executable()
    with _spawn_environment():
        inside = dict(os.environ)
        launcher = spawn.get_executable()
    assert inside == before == dict(os.environ) and spawn.get_executable() == executable
    assert launcher != executable
    probe = (
        "import json, os, signal; "
        "print(json.dumps([dict(os.environ), signal.getsignal(signal.SIGINT) == signal.SIG_IGN]))"
    )
    out = subprocess.run([launcher, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    env, ignored = json.loads(out.stdout)
    assert ignored and env["CUDA_VISIBLE_DEVICES"] == ""
    assert {k: env.get(k) for k in _pre_spawn_environ()} == _pre_spawn_environ()
    # one script per interpreter and environment, in a directory of this user's alone, reused
    with _spawn_environment():
        assert spawn.get_executable() == launcher
    folder = os.stat(os.path.dirname(launcher))
    assert folder.st_uid == os.getuid() and folder.st_mode & 0o777 == 0o700


@pytest.mark.parametrize("start", ["forkserver", "spawn"])
def test_a_start_past_the_provision_timeout_says_to_raise_it(monkeypatch, start):
    """The fix is the setting, with its value; the __main__ guard is named only where worker processes
    are spawned (they re-import the flow's script), and no Dask log is promised."""
    from gpu_tasks.cluster.within import within

    monkeypatch.setenv("GPU_TASKS_TUNE_WARM_START", start)
    monkeypatch.delenv("GPU_TASKS_TUNE_WARM_WORKERS", raising=False)  # the default: a warm pool
    gate = threading.Event()
    try:
        with pytest.raises(TimeoutError) as info:
            within(0.05, gate.wait, "cluster of profile 'gpu'")
    finally:
        gate.set()
    message = str(info.value)
    assert message.startswith("cluster of profile 'gpu' did not start within 0.05s; if this host is slow or")
    assert "raise GPU_TASKS_PROVISION_TIMEOUT (now 0.05s)" in message and "Dask log" not in message
    assert ('__name__ == "__main__"' in message) == (start == "spawn"), message


def test_a_warm_process_past_the_provision_timeout_names_the_timeout_and_the_fix(monkeypatch):
    from gpu_tasks.worker.warm import WarmPool

    monkeypatch.setenv("GPU_TASKS_TUNE_WARM_START", "spawn")  # a new interpreter: seconds of imports
    pool = WarmPool(1)
    try:
        with pytest.raises(TimeoutError) as info:
            pool.wait_ready(1, 0.05)
    finally:
        pool.close()
    message = str(info.value)
    assert "did not finish importing within 0.05s" in message, message  # the whole wait, not what was left
    assert "raise GPU_TASKS_PROVISION_TIMEOUT (now 0.05s)" in message and '__name__ == "__main__"' in message


def test_a_pool_started_in_the_background_is_ready_when_waited_for_and_leaves_no_thread():
    """The runner starts its pool from a thread of its own (a new fork server's imports hold up no
    task that needs no warm process): waiting for it gives ready processes, and its close leaves no
    starter thread and no process behind."""
    from gpu_tasks.worker.warm import WarmPool

    pool = WarmPool(1)
    try:
        pool.start_in_background()
        pool.wait_ready(1, 60)
        idle = pool.describe()
        assert len(idle) == 1 and idle[0]["ready"]
    finally:
        pool.close()
    assert not [t for t in threading.enumerate() if t.name == "gpu-tasks-warm-start"]
    assert not psutil.pid_exists(idle[0]["pid"])  # close() waited for it to end


def test_the_fork_servers_imports_load_what_each_worker_paid_for_and_start_no_thread():
    """What a warm process's fork server imports (WARM_IMPORTS) includes Prefect's collections (its
    ``prefect.collections`` entry points: prefect-redis here), which each worker loaded at its first
    task before, and the package versions a Dask worker registers with (read from each package's
    metadata at every bind before); a bound process re-reads Dask's config only where its ``DASK_*``
    environment changed. The server is left with one thread: what it forks is safe to fork."""
    from importlib.metadata import entry_points

    from gpu_tasks.worker.warm import WARM_IMPORTS

    names = sorted(ep.value.split(":")[0] for ep in entry_points(group="prefect.collections"))
    assert names, "no Prefect collection installed here: nothing to check"
    code = textwrap.dedent(
        f"""
        import importlib, importlib.metadata, json, os, sys, threading
        for name in {list(WARM_IMPORTS)!r}:
            importlib.import_module(name)
        threads = threading.active_count()

        def unreadable(*args, **kwargs):
            raise RuntimeError("package metadata read after the fork server's imports")

        importlib.metadata.Distribution.from_name = unreadable  # what a bind would read: known already
        from distributed.versions import get_versions
        from gpu_tasks.worker.inherited import dask_config_is_current

        packages = get_versions()["packages"]
        current = dask_config_is_current()
        os.environ["DASK_DISTRIBUTED__WORKER__DAEMON"] = "False"
        print(json.dumps({{"loaded": [n for n in {names!r} if n in sys.modules], "threads": threads,
                          "versions": [packages[p] is not None for p in ("dask", "distributed")],
                          "current": [current, dask_config_is_current()]}}))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "DASK_DISTRIBUTED__WORKER__DAEMON"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"loaded": names, "threads": 1, "versions": [True, True], "current": [True, False]}, seen


def test_a_refill_whose_fork_server_ended_prints_no_traceback(monkeypatch, caplog):
    """Ctrl-C on a served flow can end the fork server while a refill is due: the refill logs one
    line (DEBUG once the pool closed) instead of a thread's EOFError traceback."""
    import logging

    from gpu_tasks.worker.warm import WarmPool, end_process

    monkeypatch.setenv("GPU_TASKS_TUNE_WARM_SERVER_KEEP_SECONDS", "0")
    hooked: list[Any] = []
    monkeypatch.setattr(threading, "excepthook", hooked.append)
    pool = WarmPool(1)
    try:
        proc = pool.take(60)
        server = psutil.Process(proc.pid).parent()
        assert server is not None and "multiprocessing.forkserver" in " ".join(server.cmdline())
        proc.conn.close()
        end_process(proc.process, 5)
        server.kill()
        server.wait(10)
        with pytest.raises((EOFError, OSError)):  # what the timer thread met
            pool.ensure(2)
        with caplog.at_level(logging.DEBUG, logger="gpu_tasks.worker.warm"):
            pool._refill()
        lines = [r for r in caplog.records if "no refill, its fork server ended" in r.getMessage()]
        assert [r.levelno for r in lines] == [logging.WARNING] and not lines[0].exc_info
    finally:
        pool.close()
    assert not hooked


def test_processes_forked_from_a_running_fork_server_leave_the_flows_environment_alone(monkeypatch):
    """A refill or a take forks from the running fork server: the flow process's own environment
    (which a CPU task or a cache hit running in the flow process reads) is not swapped meanwhile;
    only the server's start set it, once. The processes still start with no device."""
    from gpu_tasks.worker.warm import WarmPool, end_process

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    pool = WarmPool(1)
    try:
        first = pool.take(60)  # the fork server has started
        seen: set[str | None] = set()
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                seen.add(os.environ.get("CUDA_VISIBLE_DEVICES"))

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            pool.ensure(3)  # three processes forked while the sampler reads the environment
            more = pool.take(60)
        finally:
            stop.set()
            sampler.join()
        assert seen == {"7"}, seen
        assert _environ(more.pid).get("CUDA_VISIBLE_DEVICES") == ""  # an unbound process sees no device
        for proc in (first, more):
            proc.conn.close()
            end_process(proc.process, 5)
    finally:
        pool.close()


def test_a_temporary_directory_too_deep_for_the_fork_servers_socket_spawns_warm_workers(
    tmp_path: Path, monkeypatch, caplog
):
    """The fork server listens on a Unix socket under TMPDIR; under a TMPDIR that makes its path
    longer than Linux allows, every worker start failed ("OSError: AF_UNIX path too long", seen
    with the deep per-test directory of a pytest run). The pool spawns its processes instead
    (the path WARM_START=spawn tests run), saying once why and the fix."""
    import tempfile

    from gpu_tasks.compat.cpython import ForkServerContext
    from gpu_tasks.worker import forkserver, warm

    deep = tmp_path / ("d" * 60) / ("e" * 40)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again, as a new process would
    monkeypatch.setenv("TMPDIR", str(deep))
    monkeypatch.setattr(warm, "_SAID", set())
    with caplog.at_level("WARNING", logger="gpu_tasks.worker.warm"):
        first, second = warm._context(), warm._context()
    assert not isinstance(first, ForkServerContext) and first.get_start_method() == "spawn"
    assert second.get_start_method() == "spawn"
    said = [
        r.getMessage() for r in caplog.records if "too deep for the warm pool's fork server" in r.getMessage()
    ]
    assert len(said) == 1 and str(deep) in said[0] and "TMPDIR=/tmp" in said[0], said
    monkeypatch.setenv("TMPDIR", "/tmp")
    monkeypatch.setattr(tempfile, "tempdir", None)
    ctx = warm._context()
    try:
        assert isinstance(ctx, ForkServerContext)
    finally:
        forkserver.release(ctx)


def test_a_launcher_directory_others_can_write_is_not_used_and_is_named(tmp_path, monkeypatch, caplog):
    """The launcher scripts live in $TMPDIR/gpu-tasks-<uid>, mode 0700: one that others can write (or
    that another user made first) is never run from; the warning names it and the fix, once."""
    import logging
    import tempfile

    from gpu_tasks.worker.warm import _launcher, _pre_spawn_environ

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    shared = tmp_path / f"gpu-tasks-{os.getuid()}"
    shared.mkdir()
    shared.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="gpu_tasks.worker.warm"):
        assert _launcher(_pre_spawn_environ()) is None
        assert _launcher(_pre_spawn_environ()) is None
    said = [r.getMessage() for r in caplog.records if str(shared) in r.getMessage()]
    assert len(said) == 1 and "drwxrwxrwx" in said[0] and "TMPDIR" in said[0], said
    assert list(shared.iterdir()) == []
    shared.chmod(0o700)
    path = _launcher(_pre_spawn_environ())
    assert path is not None and Path(path).parent == shared and os.access(path, os.X_OK)


def test_a_pipe_closed_after_dask_closed_the_server_starts_no_second_close():
    """On Ctrl-C a warm scheduler is closed by its cluster, and the flow process's pipe to it closes
    too. A close started for the pipe once the server closed was left pending as its loop ended:
    'Task was destroyed but it is pending! ... Scheduler.close()' on the user's terminal."""
    import asyncio
    import multiprocessing

    from distributed import Scheduler

    from gpu_tasks.worker import serve

    ours, flows = multiprocessing.Pipe()
    closes: list[str] = []

    async def main() -> None:
        scheduler = Scheduler(host="127.0.0.1", port=0, dashboard=False)
        await scheduler

        async def close() -> None:
            closes.append("pipe")
            await scheduler.close()

        serving = asyncio.ensure_future(serve._serve(ours, scheduler, close))
        assert (await asyncio.to_thread(flows.recv))[0] == "up"
        await scheduler.close()  # as its cluster asks on Ctrl-C
        await serving
        flows.close()  # then the flow process's end of the pipe
        _until(
            lambda: not [t for t in threading.enumerate() if t.name == "gpu-tasks-warm-close"],
            "the pipe's watcher to see it closed",
            timeout=10,
        )
        for _ in range(5):
            await asyncio.sleep(0.01)  # what it posted to the loop runs

    asyncio.run(main())
    assert closes == []


def test_the_fork_server_ends_with_its_flow_process_without_running_exit_handlers(tmp_path: Path):
    """When its flow process is gone the pool's fork server ends at once: before, it ran the exit
    handlers and the interpreter's teardown of the Prefect and distributed it preloaded (0.94 s of
    CPU per ended flow process; 5 to 6 s on a loaded machine, where a Ctrl-C test found it alive 5 s
    after its flow). Seen here as an exit handler of the server's, registered first (at its start,
    by a ``sitecustomize`` on its path), that must not run; the flow process's own still does."""
    site = tmp_path / "site"
    site.mkdir()
    ran = tmp_path / "exit-handlers"
    (site / "sitecustomize.py").write_text(
        textwrap.dedent(
            f"""
            import atexit, os

            atexit.register(lambda: open({str(ran)!r}, "a").write(f"{{os.getpid()}}\\n"))
            """
        )
    )
    code = textwrap.dedent(
        """
        import contextlib, os, time
        from gpu_tasks.worker import warm

        ctx = warm._context()
        ctx.ensure_started(contextlib.nullcontext)
        p = ctx.Process(target=time.sleep, args=(0,))  # the server answers once its preloads are in
        p.start()
        p.join()
        print(ctx.server._forkserver_pid, os.getpid(), flush=True)
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), *sys.path]))
    env.pop("GPU_TASKS_TUNE_WARM_START", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    server, flow_process = (int(p) for p in out.stdout.split())
    gone = lambda: not psutil.pid_exists(server) or psutil.Process(server).status() == "zombie"  # noqa: E731
    _until(gone, "the fork server's end", 60)
    ended = ran.read_text().split()
    assert str(flow_process) in ended, "the flow process's own exit handlers ran"
    assert str(server) not in ended, "the fork server ran its exit handlers (the interpreter's teardown)"
