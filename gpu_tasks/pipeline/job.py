"""``gpu-tasks run``: the ETL -> train pipeline on an embedded Prefect server.

Without ``PREFECT_API_URL`` a Prefect server is started for the run on 127.0.0.1
(and stopped after it). Without real GPUs, two devices are emulated, and the
output says so.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

from gpu_tasks.devices import discover
from gpu_tasks.settings import get_settings

DEFAULT_EMULATION = "2"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


INTERRUPT_DRAIN_S = 2.0  # per service (events, logs): Ctrl-C must exit well within 10 s
INTERRUPT_RECORD_S = 2.0  # for the server to write the interrupted run's last states


@contextlib.contextmanager
def embedded_server(timeout: int = 120) -> Iterator[str]:
    """Use ``PREFECT_API_URL`` when set; otherwise start a Prefect server on 127.0.0.1.

    The server started here uses SQLite. Thousands of short tasks keep its single
    writer busy: the task-run recorder and tag-concurrency checks wait on each other,
    and with Prefect's defaults (10 s statement timeout, 5 client retries) a busy
    moment turns into ``503 Service Unavailable`` and a failed task. So the server
    gets a 60 s statement timeout and this run's clients (workers included: they
    inherit the run's settings) retry up to 10 times. A server you run yourself
    (``PREFECT_API_URL``) keeps its own settings.

    When the run ends, the server is stopped once it has recorded every task run's
    final state (up to 15 s). The server runs in its own session, so a terminal's
    Ctrl-C does not reach it; on Ctrl-C (``KeyboardInterrupt``) the queued events and
    logs are sent and the server gets ``INTERRUPT_RECORD_S`` to record them before it
    is stopped, so the interrupted flow run ends ``Crashed`` in its database and the
    command still exits within seconds. The server dies with the process that started
    it, even when that process is killed (Linux; see :mod:`gpu_tasks._server_process`).
    """
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_CLIENT_MAX_RETRIES,
        PREFECT_SERVER_DATABASE_TIMEOUT,
        get_current_settings,
        temporary_settings,
    )

    current = get_current_settings().api.url
    if current:
        yield str(current)
        return
    from gpu_tasks._server_process import EmbeddedServer

    with temporary_settings(updates={PREFECT_SERVER_DATABASE_TIMEOUT: max(
            60.0, get_current_settings().server.database.timeout or 0.0)}):
        server = EmbeddedServer(port=_free_port())
        server.start(timeout=timeout)
    try:
        with temporary_settings(updates={
            PREFECT_API_URL: server.api_url,
            PREFECT_CLIENT_MAX_RETRIES: max(10, get_current_settings().client.max_retries),
        }):
            interrupted = False  # a failed run is worth recording too: it is what the user will look at
            try:
                yield server.api_url
            except BaseException as exc:
                interrupted = not isinstance(exc, Exception)  # Ctrl-C: record it, but briefly
                raise
            finally:
                drain_s, record_s = (INTERRUPT_DRAIN_S, INTERRUPT_RECORD_S) if interrupted else (5.0, 15.0)
                _drain(timeout=drain_s)
                _wait_until_recorded(timeout=record_s)
    finally:
        server.stop()


def _drain(timeout: float = 5) -> None:
    """Send the run's last events and logs while the server is up (at most ``timeout`` s each)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    EventsWorker.drain_all(timeout=timeout)
    APILogWorker.drain_all(timeout=timeout)


def _wait_until_recorded(timeout: float) -> bool:
    """Wait, at most ``timeout`` s, until the server has recorded the task runs' final states.

    Task run states reach the server as events and are written by its task-run
    recorder in batches; stopping the server in the middle leaves the last task runs
    "Running" in its database for good. Done: no task run is Running and the number
    of task runs has stopped changing.
    """
    from prefect.client.orchestration import get_client

    running = {"task_runs": {"state": {"type": {"any_": ["RUNNING"]}}}}
    deadline = time.monotonic() + timeout
    last = -1
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            try:
                busy = client._client.post("/task_runs/count", json=running).json()
                total = client._client.post("/task_runs/count", json={}).json()
            except Exception:  # the run is over; an unreachable server is not its failure
                return False
            if busy == 0 and total == last:
                return True
            last = total
            time.sleep(0.2)
    return False


def ensure_devices(announce: Any = print) -> str:
    """Emulate two devices when there is no real GPU and no emulation set; returns the source."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    settings = get_settings()
    if settings.emulated_gpus is None and settings.discovery_command is None:
        inventory = discover(settings)
        if not inventory.devices:
            os.environ["GPU_TASKS_EMULATED_GPUS"] = DEFAULT_EMULATION
            announce(
                f"No GPU found ({inventory.detail}); EMULATING {DEFAULT_EMULATION} devices "
                "(GPU_TASKS_EMULATED_GPUS): the scheduling is real, the compute runs on the CPU "
                "(pandas, XGBoost device=cpu). These are not GPU results."
            )
    return discover().source


def run_pipeline(scale: int = 1, num_rounds: int = 60, seed: int = 0, limit: int | None = None,
                 data_dir: str | None = None, announce: Any = print) -> dict[str, Any]:
    """Run the pipeline flow once and return its summary (plus wall time and server URL)."""
    from gpu_tasks.pipeline import etl_train

    source = ensure_devices(announce)
    with embedded_server() as url:
        t0 = time.monotonic()
        out = etl_train(scale=scale, num_rounds=num_rounds, seed=seed, limit=limit, data_dir=data_dir)
        out["seconds"] = round(time.monotonic() - t0, 2)
    out["prefect_api_url"] = url
    out["device_source"] = source
    return out
