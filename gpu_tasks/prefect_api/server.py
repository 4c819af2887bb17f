"""The embedded Prefect server that ``gpu-tasks example run``, benchmarks and scripts get without
``PREFECT_API_URL``: out of the terminal's Ctrl-C, never outliving its parent. Only its own process
imports ``prefect.server`` (slow to import)."""

from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger("gpu_tasks.server")
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def count_task_runs(client: Any, task_run_filter: dict[str, Any]) -> int:
    """How many task runs match ``task_run_filter`` (the API's filter JSON): the sync client has no
    ``count_task_runs``, so ``POST /task_runs/count`` through its public ``request``."""
    return int(client.request("POST", "/task_runs/count", json=task_run_filter).json())


def die_with_parent_hook() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel SIGKILL the child when its parent goes (Linux). The signal
    fires when the *thread* that forked the child ends: start it from one that outlives it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved now: nothing is loaded after fork
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl: no signal will come
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


INTERRUPT_DRAIN_S = 2.0  # per service (events, logs): Ctrl-C must exit well within 10 s
INTERRUPT_RECORD_S = 2.0  # for the server to write the interrupted run's last states
SETTLED_S = 0.5  # a count of recorded task runs that held this long, none unfinished: all recorded
# the task-run recorder batches its SQLite writes: one transaction per state falls far behind a map
RECORDER_BATCH = 50
RECORDER_FLUSH_S = 1  # Prefect reads it as whole seconds
DRAIN_S = 60.0  # per service, when the run ends: a drain returns as soon as its queue is sent
RECORD_S = 120.0  # at most, for the server to record every task run's final state ...
RECORD_STALL_S = 10.0  # ... given up sooner when its counts have not moved for this long


@contextlib.contextmanager
def embedded_server(timeout: int = 120) -> Iterator[str]:
    """``PREFECT_API_URL`` when set; otherwise a Prefect server on 127.0.0.1 for the block, stopped once
    it has recorded every task run's final state (briefly on Ctrl-C) (docs/operations.md, "Network")."""
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_CLIENT_MAX_RETRIES,
        PREFECT_SERVER_ANALYTICS_ENABLED,
        PREFECT_SERVER_DATABASE_TIMEOUT,
        get_current_settings,
        temporary_settings,
    )

    current = get_current_settings().api.url
    if current:
        yield str(current)
        return
    recorder = recorder_settings(get_current_settings())
    with temporary_settings(
        updates={
            PREFECT_SERVER_DATABASE_TIMEOUT: max(60.0, get_current_settings().server.database.timeout or 0.0),
            # nothing phones home: Prefect's server sends usage telemetry to Prefect by default
            PREFECT_SERVER_ANALYTICS_ENABLED: False,
            **recorder,
        }
    ):
        settle = settle_s(get_current_settings())
        dropped = DroppedEvents()
        server = EmbeddedServer(die_with_parent_hook(), dropped.line)
        server.start(timeout=timeout)
    started = datetime.datetime.now(datetime.UTC)  # task runs of this server's life start after this
    try:
        with temporary_settings(
            updates={
                PREFECT_API_URL: server.api_url,
                PREFECT_CLIENT_MAX_RETRIES: max(10, get_current_settings().client.max_retries),
            }
        ):
            interrupted = False  # a failed run is worth recording too: it is what the user will look at
            try:
                yield server.api_url
            except BaseException as exc:
                interrupted = not isinstance(exc, Exception)  # Ctrl-C: record it, but briefly
                raise
            finally:
                from gpu_tasks.compat.prefect_server import drain_events, drain_logs

                quick = (INTERRUPT_DRAIN_S, INTERRUPT_RECORD_S)
                drain_s, record_s = quick if interrupted else (DRAIN_S, RECORD_S)
                drain_events(drain_s)  # the run's last events and logs, while the server is up
                drain_logs(drain_s)
                _wait_until_recorded(record_s, started, RECORD_STALL_S, settle)
    finally:
        server.stop()
        dropped.report()


def ephemeral_app() -> Any:
    """The app the server's process serves (uvicorn's ``--factory``): Prefect's REST API as its own
    ephemeral server serves it."""
    from prefect.server.api.server import create_app

    return create_app(ephemeral=True, final=True)


APP_FACTORY = "gpu_tasks.prefect_api.server:ephemeral_app"  # imports gpu_tasks, 0.1 s beside prefect.server
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STARTUP_FAILURE = 3  # uvicorn's exit status when it could not start (the port taken meanwhile)
STARTS = 3  # tries on a new port each, for a port another process took between the pick and the bind
STOP_GRACE_S = 5.0  # after SIGTERM, before SIGKILL (as Prefect's own temporary server)


class EmbeddedServer:
    """Prefect's ``SubprocessASGIServer`` plus what it cannot ask for: a session of its own (Ctrl-C
    would stop it before an interrupted run's final states reach it), a ``preexec_fn``, and its
    stderr read as it comes (so the pipe never fills), each line to ``stderr_line``."""

    def __init__(self, preexec_fn: Callable[[], None] | None, stderr_line: Callable[[bytes], None]) -> None:
        self._preexec_fn, self._stderr_line = preexec_fn, stderr_line
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._last_lines: collections.deque[bytes] = collections.deque(maxlen=20)

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.address}/api"

    def start(self, timeout: float) -> None:
        """Start the server and wait for ``GET /api/health``; ``RuntimeError`` (stopped) when it exits
        or does not answer within ``timeout`` s."""
        import httpx

        deadline = time.monotonic() + timeout
        starts = 1
        atexit.register(self.stop)  # as Prefect's own: a server left running is stopped at exit
        try:
            self._spawn()
            with httpx.Client() as client:
                while True:
                    assert self.process is not None
                    code = self.process.poll()
                    if code == STARTUP_FAILURE and starts < STARTS:
                        starts += 1
                        self._spawn()
                        continue
                    if code is not None:
                        raise RuntimeError(self._failed(f"its process exited with code {code}"))
                    with contextlib.suppress(httpx.TransportError):
                        if client.get(f"{self.api_url}/health", timeout=5).status_code == 200:
                            return
                    if time.monotonic() >= deadline:
                        raise RuntimeError(self._failed(f"it did not answer within {timeout:g} s"))
                    time.sleep(0.1)
        except BaseException:
            self.stop()
            raise

    def _spawn(self) -> None:
        from prefect.settings import get_current_settings

        self._reap()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        logger.info("Starting temporary server on %s", self.address)
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "--app-dir",  # this gpu_tasks, installed or not (as Prefect's: its own parent folder)
                _PACKAGE_PARENT,
                "--factory",
                APP_FACTORY,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--log-level",
                "error",
                "--lifespan",
                "on",
            ],
            env={
                **os.environ,
                "PREFECT_UI_ENABLED": "0",  # as Prefect's own: no UI
                **get_current_settings().to_environment_variables(exclude_unset=True),
            },
            start_new_session=True,
            preexec_fn=self._preexec_fn,
            stderr=subprocess.PIPE,
        )
        self._reader = threading.Thread(
            target=self._read, args=(self.process.stderr,), name="gpu-tasks-server-stderr", daemon=True
        )
        self._reader.start()

    def _read(self, stream: Any) -> None:
        with contextlib.suppress(OSError, ValueError):  # closed with the process
            for line in iter(stream.readline, b""):
                self._last_lines.append(line)  # for the error of a server that did not start
                self._stderr_line(line)

    def _failed(self, why: str) -> str:
        if self._reader is not None and self.process is not None and self.process.poll() is not None:
            self._reader.join(timeout=2)  # its last lines, read to the end of the pipe
        said = b"".join(self._last_lines).decode(errors="replace").strip()
        return f"the embedded Prefect server on {self.address} did not start: {why}" + (
            f"; it wrote:\n{said}" if said else " (nothing on its stderr)"
        )

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after ``STOP_GRACE_S`` s. Safe to call again."""
        atexit.unregister(self.stop)
        if self.process is not None:
            logger.info("Stopping temporary server on %s", self.address)
        self._reap()

    def _reap(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if self._reader is not None:
            self._reader.join(timeout=1)  # its last lines (dropped messages counted) before a report
        if process.stderr is not None:
            with contextlib.suppress(OSError):
                process.stderr.close()


DROPPED_MESSAGE = b"Subscription queue is full, dropping message"  # Prefect's in-memory messaging
LOAD_DOCS = "docs/operations.md#a-prefect-server-that-holds-the-load"


class DroppedEvents:
    """Passes the server's stderr on, counting the event messages its in-memory messaging dropped under
    load: the first drop logged at once, the count when the server stops."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def line(self, line: bytes) -> None:
        if DROPPED_MESSAGE not in line:
            with contextlib.suppress(OSError, ValueError):  # to this process's stderr, as an inherited one
                sys.stderr.buffer.write(line)
                sys.stderr.flush()
            return
        with self._lock:  # counted, not repeated: one per dropped message would flood the terminal
            self.count += 1
            first = self.count == 1
        if first:
            logger.warning(
                "the embedded Prefect server is dropping event messages under load (its in-memory "
                "queue is full): some task runs' states will be missing from the UI and the API. For "
                "this load run Prefect on PostgreSQL and Redis and point PREFECT_API_URL at it (%s)",
                LOAD_DOCS,
            )

    def report(self) -> None:
        if self.count:
            logger.warning(
                "the embedded Prefect server dropped %d event message(s) during this run; task runs whose "
                "states were among them show wrong states in the UI. A server that holds this load: %s",
                self.count,
                LOAD_DOCS,
            )


def recorder_settings(settings: Any) -> dict[Any, Any]:
    """The task-run recorder's batch settings, except those the user set."""
    from prefect.settings import (
        PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE,
        PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL,
    )

    own = settings.server.services.task_run_recorder
    ours = {
        "batch_size": (PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE, RECORDER_BATCH),
        "flush_interval": (PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL, RECORDER_FLUSH_S),
    }
    return {setting: value for name, (setting, value) in ours.items() if name not in own.model_fields_set}


def settle_s(settings: Any) -> float:
    """How long a count of recorded task runs must hold: past a flush, when the recorder batches (a
    batch not yet written moves no count)."""
    recorder = settings.server.services.task_run_recorder
    return SETTLED_S if recorder.batch_size <= 1 else max(SETTLED_S, float(recorder.flush_interval) + 0.5)


def _wait_until_recorded(
    timeout: float, since: datetime.datetime, stall: float | None = None, settle: float = SETTLED_S
) -> bool:
    """Wait until the recorder has written the final states of the task runs since ``since``: stopped
    before, the server leaves them "Pending" or "Running" for good."""
    after = {"after_": since.isoformat()}
    started = {"start_time": after}
    # Running since the server started; Pending in one of its flow runs (no start time yet)
    unfinished: list[dict[str, Any]] = [
        {"task_runs": {**started, "state": {"type": {"any_": ["RUNNING"]}}}},
        {"flow_runs": {"start_time": after}, "task_runs": {"state": {"type": {"any_": ["PENDING"]}}}},
    ]
    return _settled({"task_runs": started}, unfinished, timeout, stall, settle)


def wait_until_flow_run_recorded(
    flow_run_id: Any, timeout: float = RECORD_S, stall: float = RECORD_STALL_S
) -> bool:
    """Wait until no task run of ``flow_run_id`` is recorded Running: Prefect's ephemeral server stops
    with the flow process, before its recorder got to the last states workers sent."""
    runs = {"flow_runs": {"id": {"any_": [str(flow_run_id)]}}}
    running = {**runs, "task_runs": {"state": {"type": {"any_": ["RUNNING"]}}}}
    from prefect.settings import get_current_settings

    return _settled(runs, [running], timeout, stall, settle_s(get_current_settings()))


def _settled(
    everything: dict[str, Any],
    unfinished: list[dict[str, Any]],
    timeout: float,
    stall: float | None,
    settle: float,
) -> bool:
    """Poll the counts until none is ``unfinished`` and they held ``settle`` s; ``False`` at ``timeout``,
    after ``stall`` s without a change, or when the server does not answer."""
    from gpu_tasks.prefect_api.api import sync_client

    deadline = time.monotonic() + timeout
    seen: tuple[int, ...] = ()
    moved = time.monotonic()
    with sync_client() as client:
        while time.monotonic() < deadline:
            try:
                counts = tuple(count_task_runs(client, f) for f in [everything, *unfinished])
            except Exception:  # the run is over; an unreachable server is not its failure
                return False
            now = time.monotonic()
            if counts != seen:
                seen, moved = counts, now
            if sum(counts[1:]) == 0 and now - moved >= settle:
                return True
            if stall is not None and now - moved >= stall:
                return False
            time.sleep(0.1)
    return False
