"""The embedded Prefect server: :func:`embedded_server` and the process it runs in.

Without ``PREFECT_API_URL``, ``gpu-tasks example run``, the benchmarks and scripts that use
:func:`embedded_server` get a Prefect server on 127.0.0.1 for the duration of a
``with`` block. Its process is kept out of the terminal's Ctrl-C and never outlives
its parent (:func:`gpu_tasks.compat.prefect.server_in_own_session_class`).

``prefect.server`` takes about 2 s to import; it is imported only when a server is
actually started, so ``gpu-tasks example serve`` and the benchmarks that import this module
(and find ``PREFECT_API_URL`` set) need not pay for it.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from gpu_tasks.compat.prefect_server import server_in_own_session_class

logger = logging.getLogger("gpu_tasks.server")
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def count_task_runs(client: Any, task_run_filter: dict[str, Any]) -> int:
    """How many task runs match ``task_run_filter`` (the API's filter JSON), on a sync client: the
    server's ``POST /task_runs/count`` through the client's public ``request`` (its client offers no
    ``count_task_runs``; an error status raises as any of its calls)."""
    return int(client.request("POST", "/task_runs/count", json=task_run_filter).json())


def die_with_parent_hook() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel SIGKILL the child when its parent goes (Linux).

    ``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child ends, not only
    the process: the server is started from the thread that enters ``embedded_server``
    (the CLI's main thread), which outlives the context. Entering it from a short-lived
    thread would kill the server when that thread ends. Returns ``None`` where there is
    no ``prctl`` (macOS, Windows): there only the context's ``finally`` and Prefect's
    ``atexit`` hook stop the server, and a SIGKILL of the parent can orphan it.
    """
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


INTERRUPT_DRAIN_S = 2.0  # per service (events, logs): Ctrl-C must exit well within 10 s
INTERRUPT_RECORD_S = 2.0  # for the server to write the interrupted run's last states
SETTLED_S = 0.5  # a count of recorded task runs that held this long, none unfinished: all recorded
DRAIN_S = 60.0  # per service, when the run ends: a drain returns as soon as its queue is sent
RECORD_S = 120.0  # at most, for the server to record every task run's final state ...
RECORD_STALL_S = 10.0  # ... given up sooner when its counts have not moved for this long


@contextlib.contextmanager
def embedded_server(timeout: int = 120) -> Iterator[str]:
    """Use ``PREFECT_API_URL`` when set; otherwise start a Prefect server on 127.0.0.1 (SQLite, a 60 s
    statement timeout, the run's clients retrying up to 10 times, no telemetry), stopped once it has
    recorded every task run's final state (docs/operations.md, "Network"). It runs in its own session,
    so a terminal's Ctrl-C does not reach it, and dies with the process that started it (Linux;
    :func:`die_with_parent_hook`); on Ctrl-C it gets ``INTERRUPT_RECORD_S`` to record the run's end.
    """
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
    with temporary_settings(
        updates={
            PREFECT_SERVER_DATABASE_TIMEOUT: max(60.0, get_current_settings().server.database.timeout or 0.0),
            # nothing phones home: Prefect's server sends usage telemetry to Prefect by default
            PREFECT_SERVER_ANALYTICS_ENABLED: False,
        }
    ):
        dropped = DroppedEvents()
        server = server_in_own_session_class(die_with_parent_hook(), dropped.line)(port=_free_port())
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
                quick = (INTERRUPT_DRAIN_S, INTERRUPT_RECORD_S)
                drain_s, record_s = quick if interrupted else (DRAIN_S, RECORD_S)
                _drain(timeout=drain_s)
                _wait_until_recorded(timeout=record_s, since=started, stall=RECORD_STALL_S)
    finally:
        server.stop()
        dropped.report()


DROPPED_MESSAGE = b"Subscription queue is full, dropping message"  # Prefect's in-memory messaging
LOAD_DOCS = "docs/operations.md#a-prefect-server-that-holds-the-load"


class DroppedEvents:
    """Reads the embedded server's stderr as it comes (passing it on to this process's stderr) and
    counts the event messages the server dropped: its in-memory messaging holds 10,000 a
    subscription and drops the rest under load, so the UI and the API miss those task runs'
    states. The first drop is logged at once, the count when the server stops."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def line(self, line: bytes) -> None:
        if DROPPED_MESSAGE in line:
            with self._lock:
                self.count += 1
                first = self.count == 1
            if first:
                logger.warning(
                    "the embedded Prefect server is dropping event messages under load (its in-memory "
                    "queue is full): some task runs' states will be missing from the UI and the API. For "
                    "this load run Prefect on PostgreSQL and Redis and point PREFECT_API_URL at it (%s)",
                    LOAD_DOCS,
                )
            return  # counted, not repeated: one per dropped message would flood the terminal
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.buffer.write(line)
            sys.stderr.flush()

    def report(self) -> None:
        if self.count:
            logger.warning(
                "the embedded Prefect server dropped %d event message(s) during this run; task runs whose "
                "states were among them show wrong states in the UI. A server that holds this load: %s",
                self.count,
                LOAD_DOCS,
            )


def _drain(timeout: float = 5) -> None:
    """Send the run's last events and logs while the server is up (at most ``timeout`` s each)."""
    from gpu_tasks.compat.prefect_server import drain_events, drain_logs

    drain_events(timeout)
    drain_logs(timeout)


def _wait_until_recorded(timeout: float, since: datetime.datetime, stall: float | None = None) -> bool:
    """Wait, at most ``timeout`` s, until the server has recorded the final states of the task
    runs of this server's life (``since``: its database may hold older ones that will stay
    "Running" for good, from a process killed long ago). Given up after ``stall`` s in which
    nothing it counts changed (task runs a crashed run left unfinished never finish).

    Task run states reach the server as events and are written by its task-run
    recorder as it gets to them; stopping the server in the middle leaves the last task
    runs "Pending" or "Running" in its database for good, or missing. Done: none of
    them is Pending or Running, and the count of task runs has held for ``SETTLED_S``.
    """
    after = {"after_": since.isoformat()}
    started = {"start_time": after}
    # Running since the server started; Pending in one of its flow runs (no start time yet)
    unfinished: list[dict[str, Any]] = [
        {"task_runs": {**started, "state": {"type": {"any_": ["RUNNING"]}}}},
        {"flow_runs": {"start_time": after}, "task_runs": {"state": {"type": {"any_": ["PENDING"]}}}},
    ]
    return _settled({"task_runs": started}, unfinished, timeout, stall)


def wait_until_flow_run_recorded(
    flow_run_id: Any, timeout: float = RECORD_S, stall: float = RECORD_STALL_S
) -> bool:
    """Wait, at most ``timeout`` s (``stall`` s without progress), until the server has recorded
    every task run of flow run ``flow_run_id`` in a state other than Running, its count held for
    ``SETTLED_S``. For Prefect's ephemeral server, which Prefect stops as the flow process exits:
    the last states worker processes sent as events were lost when its task-run recorder had not
    got to them yet (a task run left "Running" in a clean-clone CI run on a loaded machine)."""
    runs = {"flow_runs": {"id": {"any_": [str(flow_run_id)]}}}
    running = {**runs, "task_runs": {"state": {"type": {"any_": ["RUNNING"]}}}}
    return _settled(runs, [running], timeout, stall)


def _settled(
    everything: dict[str, Any], unfinished: list[dict[str, Any]], timeout: float, stall: float | None
) -> bool:
    """Poll the counts of task runs matching ``everything`` and each of ``unfinished`` until none
    is unfinished and the counts held for ``SETTLED_S``; ``False`` at ``timeout``, after ``stall``
    s without a change, or when the server does not answer."""
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout
    seen: tuple[int, ...] = ()
    moved = time.monotonic()
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            try:
                counts = (count_task_runs(client, everything),) + tuple(
                    count_task_runs(client, f) for f in unfinished
                )
            except Exception:  # the run is over; an unreachable server is not its failure
                return False
            now = time.monotonic()
            if counts != seen:
                seen, moved = counts, now
            if sum(counts[1:]) == 0 and now - moved >= SETTLED_S:
                return True
            if stall is not None and now - moved >= stall:
                return False
            time.sleep(0.1)
    return False
