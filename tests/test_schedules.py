"""Schedules as users run them: a served gpu-tasks flow left to Prefect's own scheduler.

A real ``prefect server start`` on 127.0.0.1 (its scheduler service on, its loop shortened with
Prefect's own setting) and a serving process that nobody asks for a run: the runs that complete
were created by the server's scheduler (``auto_scheduled``) and picked up by the served runner.
Runs at both ends of the Prefect range (the full suite and scripts/test-compat). Stopping the
serving process with Ctrl-C must print no traceback from gpu-tasks or its warm pool and leave
nothing running.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from faults._procs import seed_prefect_home

from bench.procs import terminal_signals

# serial: after the parallel phase (they wait on Prefect's scheduler, and failed under its load),
# in a test process of their own beside the timing tests (lane "scheduler"; the compat stage runs
# them beside the serial phase too: docs/operations.md, "Tests")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.serial(lane="scheduler"),
    pytest.mark.timeout(600),
]

GPU_TASKS = Path(sys.executable).with_name("gpu-tasks")
PREFECT = Path(sys.executable).with_name("prefect")

FLOW_SCRIPT = textwrap.dedent(
    """
    import sys

    from prefect import flow, task

    from gpu_tasks import ProfileTaskRunner, ResourceProfile, current_allocation, profile
    from gpu_tasks.deployments import deployment_info

    RUNNER = ProfileTaskRunner(
        profiles=[ResourceProfile(name="cpu", cpus=1), ResourceProfile(name="gpu", gpus=1, idle_timeout=0.5)],
        default="cpu",
    )


    @task(tags=[profile("gpu")])
    def on_gpu(x: int) -> dict:
        a = current_allocation()
        return {"x": x, "devices": list(a.devices), "emulated": a.emulated}


    @task
    def on_cpu(x: int) -> int:
        return x + 1


    @flow(name="scheduled-gpu", task_runner=RUNNER)
    def scheduled_gpu() -> dict:
        return on_gpu.submit(on_cpu.submit(1)).result()


    if __name__ == "__main__":
        scheduled_gpu.serve(
            name=sys.argv[1], interval=int(sys.argv[2]), limit=1, **deployment_info(scheduled_gpu).kwargs()
        )
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _base_env() -> dict[str, str]:
    """This process's environment less gpu-tasks' settings (but the test session's lease and
    presence directories) and less Prefect's API settings."""
    keep = ("GPU_TASKS_LEASE_DIR", "GPU_TASKS_PRESENCE_DIR")
    return {
        k: v
        for k, v in os.environ.items()
        if (k in keep or not k.startswith("GPU_TASKS_")) and not k.startswith("PREFECT_API")
    }


class Server:
    """A ``prefect server start`` subprocess on 127.0.0.1 with its own home, on the migrated database a
    home has after its first server start (``seed_prefect_home``: its migrations were 6 s of CPU and
    about 5 s of the scheduler lane's wall)."""

    def __init__(self, home: Path) -> None:
        seed_prefect_home(home)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        env = _base_env()
        env.update(
            PREFECT_HOME=str(home),
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            PREFECT_UI_ENABLED="false",
            # Prefect's own setting: the scheduler service looks for deployments to schedule this often
            PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="2",
        )
        self.log = home / "server.log"
        self.proc = subprocess.Popen(
            [str(PREFECT), "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
            env=env,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 180
        while True:
            assert self.proc.poll() is None, f"prefect server exited: {self.log.read_text()[-3000:]}"
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (
                f"prefect server did not answer: {self.log.read_text()[-3000:]}"
            )
            time.sleep(0.5)

    def api(self, method: str, path: str, **kw: Any) -> Any:
        response = httpx.request(method, f"{self.url}{path}", timeout=30, **kw)
        response.raise_for_status()
        return response.json() if response.content else None

    def stop(self) -> None:
        _stop_group(self.proc, signal.SIGTERM)


def _stop_group(proc: subprocess.Popen[Any], sig: int, timeout: float = 60) -> None:
    """Send ``sig`` to the process group, wait for its leader, then kill what is left."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    _kill_group(proc.pid)


def _group(pgid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid:
                out.append(p)
        except (ProcessLookupError, psutil.Error):
            continue
    return out


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("prefect-home"))
    try:
        yield srv
    finally:
        srv.stop()


def _serve_env(server: Server, data_dir: Path) -> dict[str, str]:
    env = _base_env()
    env.update(
        PREFECT_API_URL=server.url,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        # the served runner asks for scheduled runs this often (Prefect's default: 10 s)
        PREFECT_RUNNER_POLL_FREQUENCY="2",
        # one flow run at a time, as Prefect 3.8's runner reads it (3.9's serve ignores the setting:
        # serve's limit=1 and `gpu-tasks example serve --process-limit 1` say it there); on a loaded 2-core
        # machine overlapping runs each took minutes and too few completed in time
        PREFECT_RUNNER_PROCESS_LIMIT="1",
        GPU_TASKS_EMULATED_GPUS="1",
        GPU_TASKS_DATA_DIR=str(data_dir),
        # each Python process dumps its threads' stacks on SIGABRT: what a hang after Ctrl-C waits on
        PYTHONFAULTHANDLER="1",
    )
    return env


def _completed_scheduled_runs(server: Server, deployment_name: str, want: int, timeout: float) -> list[Any]:
    """Wait until ``want`` runs of the deployment, created by the server's scheduler, completed;
    fail at once on a run that ended otherwise."""
    deadline = time.monotonic() + timeout
    deployment_id = None
    runs: list[Any] = []
    while time.monotonic() < deadline:
        if deployment_id is None:
            found = server.api(
                "POST", "/deployments/filter", json={"deployments": {"name": {"any_": [deployment_name]}}}
            )
            deployment_id = found[0]["id"] if found else None
        if deployment_id is not None:
            runs = server.api(
                "POST",
                "/flow_runs/filter",
                json={
                    "flow_runs": {"deployment_id": {"any_": [deployment_id]}},
                    "sort": "EXPECTED_START_TIME_ASC",
                },
            )
            ended = [r for r in runs if r["state_type"] in ("FAILED", "CRASHED", "CANCELLED")]
            assert not ended, [(r["name"], r["state_type"], r["state"]["message"]) for r in ended]
            done = [r for r in runs if r["state_type"] == "COMPLETED"]
            if len(done) >= want:
                return done
        time.sleep(1)
    pytest.fail(
        f"fewer than {want} scheduled runs of {deployment_name!r} completed in {timeout:.0f} s: "
        f"{[(r['name'], r['state_type'], r['auto_scheduled']) for r in runs]}; the server's log ends: "
        f"{server.log.read_text()[-2000:]}"
    )


def _check_stops_cleanly(proc: subprocess.Popen[str], out: Path) -> None:
    """Ctrl-C in the serving terminal: it exits, prints no traceback of gpu-tasks' (see
    :func:`_tracebacks`), and leaves no process."""
    os.killpg(proc.pid, signal.SIGINT)
    # a bound on a hang, not a speed: Prefect's runner, interrupted as it starts a scheduled run's
    # process, stops that process gracefully (SIGTERM, its cancel protocol, SIGKILL after a grace)
    try:
        proc.wait(timeout=150)
    except subprocess.TimeoutExpired:
        left = [" ".join(p.cmdline())[:150] for p in _group(proc.pid)]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGABRT)  # each one's stacks into the log (PYTHONFAULTHANDLER)
        time.sleep(3)
        _kill_group(proc.pid)
        tail = out.read_text(errors="replace")[-12000:]
        pytest.fail(f"the serving process did not stop within 150 s of Ctrl-C: {left}\n{tail}")
    # what the serving process started ends after it: a flow run it was running closes its clusters
    # and sends its queued events first (GPU_TASKS_TUNE_EVENTS_DRAIN_SECONDS); on a loaded machine the
    # warm pool's fork server outlived a 15 s wait, then ended
    deadline = time.monotonic() + 90
    while _group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.25)
    left = []
    for p in _group(proc.pid):
        with contextlib.suppress(psutil.Error):  # one that ends as it is read is not left
            left.append(" ".join(p.cmdline())[:150])
    _kill_group(proc.pid)
    text = out.read_text()
    assert not left, f"processes left after the serving process stopped: {left}"
    ours = [
        t
        for t in _tracebacks(text)
        if any(w in t for w in ("gpu_tasks", "forkserver", "EOFError"))
        and not (
            t.rstrip().endswith("KeyboardInterrupt")
            # multiprocessing's child, or any interpreter still in its start-up (site.py, a .pth
            # file such as the editable install's finder, named gpu_tasks): the Ctrl-C reached it
            # before it ran anyone's code (seen once in a clean-clone CI run)
            and ("spawn_main" in t or "<frozen site>" in t)
        )
    ]
    assert not ours, "\n\n".join(ours)[-6000:]


def _tracebacks(text: str) -> list[str]:
    """The tracebacks in ``text``, each with its exception line. One of a flow run process that
    Prefect's runner was just spawning when the Ctrl-C came (its ``KeyboardInterrupt`` while
    importing, under ``multiprocessing.spawn``) is Prefect's own; one through gpu-tasks' code, its
    warm pool's fork server, or an ``EOFError`` from it is not."""
    out: list[str] = []
    block: list[str] | None = None
    for line in text.splitlines():
        if "Traceback (most recent call last):" in line:
            block = [line]
        elif block is not None:
            block.append(line)
            if line and not line[0].isspace() and not line.startswith("During handling"):
                out.append("\n".join(block))
                block = None
    if block is not None:
        out.append("\n".join(block))
    return out


def _gpu_task_runs(server: Server, flow_run_ids: list[str], per_run: int, timeout: float = 60) -> list[Any]:
    """The GPU-profile task runs of the flow runs, once each has ``per_run`` of them Completed (the
    server stores task runs from their events, after the flow run's own state)."""
    gpu = {"profile:gpu", "profile:gpu-etl", "profile:gpu-train"}
    deadline = time.monotonic() + timeout
    while True:
        runs = [
            t
            for t in server.api(
                "POST", "/task_runs/filter", json={"flow_runs": {"id": {"any_": flow_run_ids}}}
            )
            if gpu & set(t["tags"])
        ]
        done = [t for t in runs if t["state_type"] == "COMPLETED"]
        if len(done) >= per_run * len(flow_run_ids) or time.monotonic() > deadline:
            return runs
        time.sleep(0.5)


def _serve_and_check(server: Server, tmp_path: Path, name: str, command: list[str], gpu_per_run: int) -> None:
    """Run ``command`` (a serving process) until two runs the scheduler created completed, each with
    ``gpu_per_run`` GPU task runs Completed; then Ctrl-C it (:func:`_check_stops_cleanly`)."""
    out = tmp_path / "serve.log"
    proc = subprocess.Popen(
        command,
        env=_serve_env(server, tmp_path),
        cwd=tmp_path,
        stdout=out.open("w"),
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        # a terminal's foreground job: Ctrl-C's SIGINT not ignored, whatever the test runner's parent
        # set (a background job of a non-interactive shell, as a CI launcher may be, ignores it, and
        # Python keeps an ignored SIGINT ignored: the serving process then never saw the Ctrl-C)
        preexec_fn=terminal_signals,
    )
    try:
        done = _completed_scheduled_runs(server, name, want=2, timeout=300)
        assert all(r["auto_scheduled"] for r in done), done
        gpu = _gpu_task_runs(server, [r["id"] for r in done], per_run=gpu_per_run)
        assert len(gpu) >= 2 * gpu_per_run and all(t["state_type"] == "COMPLETED" for t in gpu), gpu
        _check_stops_cleanly(proc, out)
    finally:
        _kill_group(proc.pid)


def test_a_served_flow_with_an_interval_gets_scheduled_runs_that_complete(server: Server, tmp_path: Path):
    script = tmp_path / "scheduled_flow.py"
    script.write_text(FLOW_SCRIPT)
    name = f"interval-{os.getpid()}"
    _serve_and_check(server, tmp_path, name, [sys.executable, str(script), name, "10"], gpu_per_run=1)


def test_gpu_tasks_serve_with_a_cron_gets_scheduled_runs_that_complete(server: Server, tmp_path: Path):
    name = f"cron-{os.getpid()}"
    # six fields: croniter reads the sixth as seconds (every 15 s), so two runs come within a minute
    cron = ["--cron", "* * * * * */15", "--limit", "15000", "--rounds", "3", "--process-limit", "1"]
    _serve_and_check(
        server, tmp_path, name, [str(GPU_TASKS), "example", "serve", "--name", name, *cron], gpu_per_run=2
    )
