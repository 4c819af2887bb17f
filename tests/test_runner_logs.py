"""The runner's own log lines in the flow run's logs on the Prefect server (the UI's run logs).

docs/runner.md promises log lines (the fallback warning, "waits (logged)", idle close "the
decision is logged with its reason") and docs/operations.md quotes the cluster lines. They
are logged with ``gpu_tasks.*`` module loggers, from the runner's threads, and sent to the
flow run's logs by ``gpu_tasks.reporting.logs.RunLogs``: each line once, at its level. Dask's
INFO chatter stays out of the terminal unless GPU_TASKS_TUNE_DASK_LOG_LEVEL asks for it.
"""

from __future__ import annotations

import asyncio
import logging
import re
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from prefect import flow, task
from prefect.context import FlowRunContext

from gpu_tasks import ProfileTaskRunner, ResourceProfile, current_allocation, profile

pytestmark = pytest.mark.usefixtures("no_leaked_processes", "emulated")


@task
def where() -> str | None:
    return current_allocation().profile


def _flow_run_logs(run_id, until: str, seconds: float = 30.0) -> list[tuple[int, str]]:
    """The flow run's logs on the server (level, message), once one containing ``until`` is there."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    async def read() -> list[tuple[int, str]]:
        async with get_client() as client:
            logs = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
            return [(log.level, log.message) for log in logs]

    deadline = time.monotonic() + seconds
    while True:
        logs = asyncio.run(read())
        if any(until in m for _, m in logs) or time.monotonic() > deadline:
            return logs
        time.sleep(0.2)


def test_runner_lines_in_the_flow_run_logs():
    fallback = ResourceProfile(name="a100", gpus=1, gpu_model="A100", fallback="cpu")
    gpu = ResourceProfile(name="gpu", gpus=1, idle_timeout=0.5)

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="cpu", cpus=0.5), fallback, gpu]))
    def f():
        on_cpu = where.with_options(tags=[profile("a100")]).submit().result()
        on_gpu = where.with_options(tags=[profile("gpu")]).submit().result()
        deadline = time.monotonic() + 60
        while FlowRunContext.get().task_runner.status()["gpu"]["state"] != "closed":  # an idle close, logged
            assert time.monotonic() < deadline
            time.sleep(0.05)
        return FlowRunContext.get().flow_run.id, on_cpu, on_gpu

    run_id, on_cpu, on_gpu = f()
    assert (on_cpu, on_gpu) == ("cpu", "gpu")
    logs = _flow_run_logs(run_id, until="profile 'gpu': closed cluster")
    text = "\n".join(m for _, m in logs)

    def recorded(needle: str) -> list[int]:
        """The levels of the flow run's log lines that contain ``needle``."""
        return [level for level, m in logs if needle in m]

    # through Prefect's run logger: the fallback warning
    assert recorded("asks for profile 'a100'") == [logging.WARNING], text
    # through gpu_tasks' module loggers, from the runner's threads: each line once, at its level
    expected = {
        "gpu-tasks is EMULATING devices": logging.WARNING,
        "gpu-tasks devices:": logging.INFO,
        "profile 'gpu': provisioned 1 worker(s)": logging.INFO,
        "profile 'gpu': closed cluster (scaled down: idle": logging.INFO,
        # the emulated fixture's GPU_TASKS_IDLE_TIMEOUT=30 fills the profiles that leave it unset
        "GPU_TASKS_IDLE_TIMEOUT=30 sets idle_timeout of a100, cpu (profiles that": logging.INFO,
    }
    for needle, level in expected.items():
        assert recorded(needle) == [level], f"{needle!r}: {recorded(needle)}\n{text}"
    # Dask's own INFO lines are not the flow run's
    assert not [m for level, m in logs if level < logging.WARNING and "distributed" in m], text


SCRIPT = textwrap.dedent(
    """
    import time
    from prefect import flow, task
    from prefect.context import FlowRunContext
    from gpu_tasks import ProfileTaskRunner, ResourceProfile, profile

    @task(tags=[profile("gpu")])
    def work(i):
        return i + 1

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="gpu", gpus=1, idle_timeout=0.5)]))
    def plain():
        first = [f.result() for f in work.map(range(2))]
        runner = FlowRunContext.get().task_runner
        deadline = time.monotonic() + 60
        while runner.status()["gpu"]["state"] != "closed":  # the idle close happens inside the flow run
            assert time.monotonic() < deadline, runner.status()
            time.sleep(0.05)
        return first

    if __name__ == "__main__":
        print("RESULT", plain())
    """
)


@pytest.mark.parametrize(
    ("dask_level", "warm", "extra_loggers"),
    [(None, None, None), ("info", None, None), (None, "0", None), (None, None, "gpu_tasks")],
)
def test_plain_script_run_logs_and_dask_chatter(
    tmp_path: Path, dask_level: str | None, warm: str | None, extra_loggers: str | None
):
    """A plain script on Prefect's default ephemeral API, as a user runs it: the runner's lines are
    in the terminal once and in the flow run's logs once; Dask's INFO lines only when asked for, from
    warm workers and from nanny-started ones (``warm`` 0) alike. With PREFECT_LOGGING_EXTRA_LOGGERS
    naming gpu_tasks, Prefect's own handler dropped the lines of the runner's threads (no flow run
    context there), each with a UserWarning (a new-user pass): they still reach the run once."""
    from faults._procs import clean_env, db_rows, kill_marked, wait_gone

    marker = uuid.uuid4().hex
    (tmp_path / "plain.py").write_text(SCRIPT)
    home = tmp_path / "prefect-home"
    extra = {"GPU_TASKS_TUNE_DASK_LOG_LEVEL": dask_level} if dask_level else {}
    if warm is not None:
        extra["GPU_TASKS_TUNE_WARM_WORKERS"] = warm
    if extra_loggers is not None:
        extra["PREFECT_LOGGING_EXTRA_LOGGERS"] = extra_loggers
    env = clean_env(marker, PREFECT_HOME=str(home), GPU_TASKS_EMULATED_GPUS="1", **extra)
    try:
        proc = subprocess.run(
            [sys.executable, "plain.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "RESULT [1, 2]" in proc.stdout
        _, left = wait_gone(marker, timeout=10)
        assert not left, f"processes outlived the script: {left}"
    finally:
        kill_marked(marker)
    out = proc.stdout + proc.stderr
    assert "without a flow run id" not in out, out[-3000:]
    lines = {
        "gpu-tasks is EMULATING devices": "WARNING",
        "profile 'gpu': provisioned 1 worker(s)": "INFO",
        "profile 'gpu': closed cluster (scaled down: idle": "INFO",
    }
    for needle, level in lines.items():
        shown = [line for line in out.splitlines() if needle in line]
        assert len(shown) == 1 and f"| {level}" in shown[0], (needle, shown, out[-3000:])
    # the emulation warning says what emulation means for this flow, not for the example pipeline
    [emulating] = [line for line in out.splitlines() if "gpu-tasks is EMULATING devices" in line]
    assert "CUDA_VISIBLE_DEVICES and Dask GPU resources" in emulating, emulating
    assert not re.search("pandas|cuDF|XGBoost", emulating), emulating
    # Dask's INFO lines: the flow process's in Prefect's format, the scheduler's and workers'
    # processes' in Python's
    chatter = [
        line
        for line in out.splitlines()
        if re.search(r"\| INFO +\| distributed\.|- distributed\.\S+ - INFO -", line)
    ]
    if dask_level:
        assert chatter, out[-3000:]
    else:
        assert not chatter, chatter
    # the flow run's logs on its (ephemeral) server: each line once, at its level
    db = home / "prefect.db"
    (run_id,) = [r[0] for r in db_rows(db, "select id from flow_run")]
    logs = db_rows(db, "select level, message from log where flow_run_id = ?", run_id)
    for needle, level in lines.items():
        assert [lv for lv, m in logs if needle in m] == [logging.getLevelName(level)], (needle, logs)
