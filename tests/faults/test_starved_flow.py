"""A flow process too busy to answer anyone for a while (issue 31: 100,000 tasks on a loaded
2-core machine) must not cost its tasks: a profile's scheduler runs in a process of its own, so
its workers' heartbeats are answered while the flow process is starved.

Reproduced small: the flow script holds its interpreter lock for :data:`STARVE_S` seconds (a C call
made through ``ctypes.PyDLL``, which keeps the lock, as a long C extension call can) while a
quarter-GPU profile's tasks run, and Dask's worker TTL (5 minutes by default) is scaled down to
3 s. With the scheduler in the flow process (as before), it was starved too, removed the workers
it had not heard from, and every task they held crashed ("1 workers died while trying to run it").
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

from prefect_api import api

from faults._procs import clean_env, kill_marked, wait_gone

STARVE_S = 12
TTL = "3s"

SCRIPT = f"""
import ctypes, json, sys, threading, time
from prefect import flow, task
from prefect.runtime import flow_run
from gpu_tasks import ProfileTaskRunner, ResourceProfile, profile

QUARTER = ResourceProfile(name="quarter", gpus=0.25)
CPU = ResourceProfile(name="cpu", cpus=1)
ticks = []


def ticker():  # how long the flow process went without running Python
    while True:
        ticks.append(time.monotonic())
        time.sleep(0.1)


@task(tags=[profile("quarter")])
def work(i: int) -> int:
    time.sleep(0.5)
    return i


@flow(task_runner=ProfileTaskRunner(profiles=[QUARTER, CPU], default="cpu"))
def starved(n: int) -> tuple[int, str]:
    first = [work.submit(i) for i in range(8)]
    first[0].result()  # the profile's workers run tasks
    threading.Thread(target=ticker, daemon=True).start()
    time.sleep(0.3)
    ctypes.PyDLL(None).sleep({STARVE_S})  # libc sleep, the interpreter lock held throughout
    futures = first + [work.submit(i) for i in range(8, n)]
    return sum(f.result() for f in futures), str(flow_run.id)


total, run_id = starved(24)
gaps = [b - a for a, b in zip(ticks, ticks[1:])]
print(json.dumps({{"total": total, "flow_run": run_id, "longest_gap": max(gaps)}}))
"""


def test_a_starved_flow_process_loses_no_worker_and_no_task(tmp_path: Path, prefect_server):
    import prefect.settings

    marker = uuid.uuid4().hex
    script = tmp_path / "starved.py"
    script.write_text(SCRIPT)
    env = clean_env(
        marker,
        PREFECT_API_URL=str(prefect.settings.PREFECT_API_URL.value()),
        GPU_TASKS_EMULATED_GPUS="2",
        DASK_DISTRIBUTED__SCHEDULER__WORKER_TTL=TTL,
    )
    try:
        out = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
        )
    finally:
        left = wait_gone(marker, 15)[1]
        kill_marked(marker)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # the flow process really was starved, for several worker TTLs
    assert result["longest_gap"] >= STARVE_S - 1, result
    assert result["total"] == sum(range(24)), result
    assert "workers died" not in out.stderr and "Removing worker" not in out.stderr, out.stderr[-4000:]
    assert not left, f"processes outlived the flow: {left}"
    assert _task_states(result["flow_run"], 24) == ["COMPLETED"] * 24


def _task_states(flow_run: str, n: int) -> list[str]:
    """The flow run's task runs' state types as the server records them, once all ``n`` completed
    (their state reports arrive as events) or after 30 s."""
    deadline = time.monotonic() + 30
    while True:
        _, runs = api("POST", "/task_runs/filter", json={"flow_runs": {"id": {"any_": [flow_run]}}})
        assert isinstance(runs, list), runs
        states = sorted(r["state_type"] for r in runs)
        if states == ["COMPLETED"] * n or time.monotonic() > deadline:
            return states
        time.sleep(0.5)


IDLE_SCRIPT = """
import json, os, pathlib, time
from prefect import flow, task
from prefect.runtime import flow_run
from gpu_tasks import ProfileTaskRunner, ResourceProfile, profile

QUARTER = ResourceProfile(name="quarter", gpus=0.25)
CPU = ResourceProfile(name="cpu", cpus=1)


@task(tags=[profile("quarter")])
def work(i: int) -> tuple[int, int]:
    time.sleep(0.3)
    return i, os.getpid()


@flow(task_runner=ProfileTaskRunner(profiles=[QUARTER, CPU], default="cpu"))
def lost(n: int) -> tuple[int, str]:
    first = [work.submit(i) for i in range(8)]
    pathlib.Path("pids.tmp").write_text(json.dumps(sorted({f.result()[1] for f in first})))
    os.rename("pids.tmp", "pids")
    while not os.path.exists("go"):  # the test freezes the workers past the TTL meanwhile
        time.sleep(0.1)
    futures = [work.submit(i) for i in range(8, n)]
    return sum(f.result()[0] for f in first + futures), str(flow_run.id)


total, run_id = lost(24)
print(json.dumps({"total": total, "flow_run": run_id}))
"""


def test_workers_dropped_by_their_scheduler_while_idle_are_replaced_not_waited_for(
    tmp_path: Path, prefect_server
):
    """Both workers of a profile frozen (SIGSTOP) past Dask's worker TTL while idle: their scheduler
    drops them and they exit. The runner gives their devices back and starts new workers for the
    tasks sent next; before, those tasks waited at a scheduler with no worker, forever."""
    import signal

    import prefect.settings
    import psutil

    marker = uuid.uuid4().hex
    (tmp_path / "lost.py").write_text(IDLE_SCRIPT)
    env = clean_env(
        marker,
        PREFECT_API_URL=str(prefect.settings.PREFECT_API_URL.value()),
        GPU_TASKS_EMULATED_GPUS="2",
        DASK_DISTRIBUTED__SCHEDULER__WORKER_TTL=TTL,
    )
    proc = subprocess.Popen(
        [sys.executable, "lost.py"],
        cwd=tmp_path,
        env=env,
        stdout=(tmp_path / "stdout").open("wb"),
        stderr=(tmp_path / "stderr").open("wb"),
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "pids").exists():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()[
                -3000:
            ]
            time.sleep(0.2)
        workers = [psutil.Process(p) for p in json.loads((tmp_path / "pids").read_text())]
        assert len(workers) == 2, workers
        for w in workers:
            w.send_signal(signal.SIGSTOP)
        # frozen until their scheduler (its log goes to the flow's stderr) has dropped both: past the
        # TTL (at least ten heartbeat intervals, 5 s here) and its next check of it
        deadline = time.monotonic() + 60
        while (tmp_path / "stderr").read_text().count("Worker failed to heartbeat") < 2:
            assert time.monotonic() < deadline, (tmp_path / "stderr").read_text()[-3000:]
            time.sleep(0.2)
        for w in workers:
            w.send_signal(signal.SIGCONT)
        gone, alive = psutil.wait_procs(workers, timeout=30)  # told they were dropped, they exit
        assert not alive, alive
        (tmp_path / "go").touch()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        left = wait_gone(marker, 15)[1]
        kill_marked(marker)
    err = (tmp_path / "stderr").read_text()
    assert proc.returncode == 0, err[-4000:]
    result = json.loads((tmp_path / "stdout").read_text().strip().splitlines()[-1])
    assert result["total"] == sum(range(24)), result
    assert err.count("though the runner did not stop it") == 2, err[-4000:]
    after = err[err.index("though the runner did not stop it") :]
    assert "provisioned" in after or "scaled up" in after, err[-4000:]  # new workers, not a wait
    assert not left, f"processes outlived the flow: {left}"
    assert _task_states(result["flow_run"], 24) == ["COMPLETED"] * 24
