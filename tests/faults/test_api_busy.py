"""A busy Prefect API: the server refuses gpu-tasks' tag-slot requests with 503 for a while (as an
embedded SQLite server under tens of thousands of task runs does, beyond Prefect's own client
retries); the task runs wait it out and complete, and the log says what was waited for. A worker's
refused request is asked again within ``GPU_TASKS_TUNE_API_LONGEST_WAIT``, not after Prefect's
doubling wait."""

from __future__ import annotations

import contextlib
import json
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from faults._procs import clean_env, free_port, run_flow_script, running_server, wait_gone

REFUSALS = 4


def _placement_limit(url: str, name: str = "tag:gpu:0") -> None:
    """A concurrency limit on the gpu:0 tag workers add, or ``name`` (100 slots: it never binds)."""
    import httpx

    made = httpx.post(f"{url}/v2/concurrency_limits/", json={"name": name, "limit": 100}, timeout=30)
    assert made.status_code in (200, 201), made.text


@contextlib.contextmanager
def _busy_server(tmp_path: Path, marker: str, count: Path, refusals: int, **env: str) -> Iterator[str]:
    """busy_api_server.py on a free port of 127.0.0.1 (``refusals`` per side, counted in ``count``);
    its API URL, until the end of the block."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    server_env = clean_env(
        marker,
        PREFECT_HOME=str(tmp_path / f"server-home-{count.name}"),
        PREFECT_UI_ENABLED="false",
        BUSY_API_REFUSALS=str(refusals),
        BUSY_API_COUNT_FILE=str(count),
        **env,
    )
    server = [sys.executable, str(Path(__file__).with_name("busy_api_server.py")), str(port)]
    with running_server(server, server_env, url):
        yield url


SCRIPT = textwrap.dedent(
    """
    from prefect import flow, task
    from gpu_tasks import ProfileTaskRunner, ResourceProfile, profile

    @task(tags=[profile("quarter")])
    def square(x):
        return x * x

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="quarter", gpus=0.25)]))
    def busy_api_flow():
        return sum(f.result() for f in square.map(range(6)))

    if __name__ == "__main__":
        print("RESULT", busy_api_flow())
    """
)


@pytest.mark.timeout(240)
def test_tag_slot_checks_wait_out_503s_and_every_task_completes(tmp_path: Path):
    marker = f"busy-api-{uuid.uuid4().hex[:8]}"
    count = tmp_path / "refused"
    with _busy_server(tmp_path, marker, count, REFUSALS) as url:
        _placement_limit(url)  # so the worker's engine asks for its gpu:0 slot (no limit: it need not)
        _placement_limit(url, "tag:profile:quarter")  # and the flow process for the task's own slot
        out = run_flow_script(
            tmp_path,
            "busy_api_flow.py",
            SCRIPT,
            marker,
            url,
            200,
            PREFECT_CLIENT_MAX_RETRIES="0",  # Prefect's own client gives each 503 up at once
        )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "RESULT 55" in out.stdout, log[-3000:]
    # both sides met the refusals: the flow process's slots for the task's tags, and the engine's
    # check on the worker of the gpu:<id> tags gpu-tasks puts on every task
    counted = json.loads(count.read_text())
    assert (counted["flow"], counted["worker"]) == (REFUSALS, REFUSALS), counted
    assert "the Prefect API is busy (503 Service Unavailable)" in log, log[-3000:]
    assert "ConcurrencySlotAcquisitionError" not in log, log[-3000:]
    assert wait_gone(marker, 20)[1] == [], "processes outlived the flow run"


WORKER_REFUSALS = 6  # Prefect's client waits 2, 4, 8, 16, 32 and 64 s after these, uncapped

ONE_TASK = textwrap.dedent(
    """
    from prefect import flow, task
    from gpu_tasks import ProfileTaskRunner, ResourceProfile, profile

    @task(tags=[profile("gpu")])
    def one():
        return 1

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="gpu", gpus=1)]))
    def refused_worker_flow():
        return one.submit().result()

    if __name__ == "__main__":
        print("RESULT", refused_worker_flow())
    """
)


@pytest.mark.timeout(240)
def test_a_workers_refused_request_is_asked_again_within_the_longest_wait(tmp_path: Path):
    """The worker's first request (the engine's tag-slot check of its placement tags) is refused six
    times in a row, as by a server busy with other flow runs (bench.many_flows measured a device then
    held idle 126 s): with GPU_TASKS_TUNE_API_LONGEST_WAIT=1 each of Prefect's client waits is about a
    second, so the task runs within seconds of the last refusal, not after the 64 s (2**6) Prefect's
    client waits after it uncapped."""
    marker = f"busy-state-{uuid.uuid4().hex[:8]}"
    count = tmp_path / "refused"
    with _busy_server(tmp_path, marker, count, WORKER_REFUSALS, BUSY_API_FAULT="worker") as url:
        _placement_limit(url)
        out = run_flow_script(
            tmp_path,
            "refused_worker_flow.py",
            ONE_TASK,
            marker,
            url,
            200,
            PREFECT_CLIENT_MAX_RETRIES="10",  # as the embedded server gives its clients
            GPU_TASKS_TUNE_API_LONGEST_WAIT="1",
        )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "RESULT 1" in out.stdout, log[-3000:]
    counted = json.loads(count.read_text())
    assert counted["worker"] == WORKER_REFUSALS, counted
    tries = [*counted["refused_at"], counted["accepted_at"]]
    gaps = [b - a for a, b in zip(tries, tries[1:], strict=False)]
    print("waits between tries of the refused request:", [round(g, 2) for g in gaps])
    # each at most 1 s x Prefect's jitter (1.2), plus the request's own time; uncapped the last is ~64 s
    assert max(gaps) < 15, gaps
    assert wait_gone(marker, 20)[1] == [], "processes outlived the flow run"


def test_a_worker_asks_for_no_placement_slot_when_no_limit_exists(tmp_path: Path):
    """No concurrency limit on the gpu:<id> tags: the flow process reads so before the lease, and the
    worker's engine makes no tag-slot request for them while it holds the device (each such request
    is a write a busy SQLite server can refuse for minutes). With a limit on gpu:0 it asks. Nor does
    the flow process ask for the task's own tags, which have no limit: it reads that first."""
    seen = {}
    count = tmp_path / "asked"  # every tag-slot request the server got, by side, counted from its start
    with _busy_server(tmp_path, f"placement-server-{uuid.uuid4().hex[:8]}", count, 0) as url:
        for limited in (False, True):  # one server: the flow run without a limit, then with one
            if limited:
                _placement_limit(url)
            marker = f"placement-{uuid.uuid4().hex[:8]}"
            out = run_flow_script(tmp_path, f"placement_{limited}.py", SCRIPT, marker, url, 200)
            log = out.stdout + out.stderr
            assert out.returncode == 0 and "RESULT 55" in out.stdout, log[-4000:]
            seen[limited] = json.loads(count.read_text())["asked"] if count.exists() else {}
            assert wait_gone(marker, 20)[1] == [], "processes outlived the flow run"
    asked = {side: seen[True].get(side, 0) - seen[False].get(side, 0) for side in ("worker", "flow")}
    assert seen[False].get("worker", 0) == 0 and seen[False].get("flow", 0) == 0, seen
    assert asked["worker"] >= 1 and asked["flow"] == 0, seen
