"""Worker deaths and interrupted task runs, turned into Prefect ``Crashed`` states.

Two things Prefect and Dask do not do for us, kept in this one place:

- Dask re-runs a task whose worker died (``distributed.scheduler.allowed-failures``)
  without telling anyone, and after the last attempt the task run is still
  ``Running`` on the Prefect server: the worker that would have reported its end is
  gone. Our clusters allow no silent re-run; the runner sees the death at once, and
  :func:`crash_task_run` reports the task run ``Crashed`` with what died and why.
- A task run that was running in a worker when the flow stopped (Ctrl-C, an error
  in the flow) would stay ``Running`` for the same reason.

Task run states reach Prefect's server as events (the client-side task engine emits
them; the server's task-run recorder keeps the newest by timestamp), so a crash is
reported the same way, later than anything the dead worker managed to send.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from distributed import Nanny

logger = logging.getLogger(__name__)

OOM_MARKERS = (
    "out of memory", "out_of_memory", "outofmemory", "cudaerrormemoryallocation", "std::bad_alloc",
    "memoryerror", "cuda_error_out_of_memory",
)


@dataclass(frozen=True)
class WorkerExit:
    """How a worker process ended."""

    address: str
    pid: int | None
    exitcode: int | None
    memory_kill: bool = False  # Dask's nanny terminated it for exceeding its memory limit
    rss: int | None = None

    def describe(self) -> str:
        """``killed by signal 9 (SIGKILL)``, ``exited with status 3``, or the memory kill."""
        if self.memory_kill:
            mib = f" ({self.rss / 2**20:.0f} MiB resident)" if self.rss else ""
            return f"ran out of memory: it exceeded its Dask memory limit{mib} and was terminated"
        return describe_exitcode(self.exitcode)


def describe_exitcode(exitcode: int | None) -> str:
    """A process exit code in words (negative codes are signals)."""
    if exitcode is None:
        return "died (exit status unknown)"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "unknown signal"
        words = f"was killed by signal {-exitcode} ({name})"
        if -exitcode == signal.SIGKILL:
            words += "; the kernel's out-of-memory killer sends this signal too"
        return words
    return f"exited with status {exitcode}"


_EXITS: dict[str, WorkerExit] = {}
_PIDS: dict[str, int] = {}  # live workers' process ids, by address
_EXITS_LOCK = threading.Lock()


def worker_exit(address: str, wait: float = 2.0) -> WorkerExit | None:
    """How the worker at ``address`` ended, waiting up to ``wait`` s for its nanny to tell."""
    deadline = time.monotonic() + wait
    while True:
        with _EXITS_LOCK:
            found = _EXITS.get(address)
        if found is not None or time.monotonic() >= deadline:
            return found
        time.sleep(0.05)


def _record(address: str | None, **fields: Any) -> None:
    if not address:
        return
    with _EXITS_LOCK:
        if len(_EXITS) > 1000:  # one entry per dead worker: keep the recent ones
            for key in list(_EXITS)[:500]:
                del _EXITS[key]
        old = _EXITS.get(address)
        merged = {**(old.__dict__ if old else {"address": address, "pid": None, "exitcode": None}), **fields}
        _EXITS[address] = WorkerExit(**merged)


class WatchedNanny(Nanny):
    """Dask's nanny, noting how its worker process ended (exit code, memory kill) for crash reports."""

    async def instantiate(self) -> Any:
        status = await super().instantiate()
        pid = getattr(self.process, "pid", None)
        if self.worker_address and pid:
            with _EXITS_LOCK:
                if len(_PIDS) > 1000:
                    _PIDS.clear()
                _PIDS[self.worker_address] = pid
        return status

    def _on_worker_exit_sync(self, exitcode: int) -> None:  # called by the nanny's process watcher
        with _EXITS_LOCK:
            pid = _PIDS.pop(self.worker_address, None) if self.worker_address else None
        _record(self.worker_address, exitcode=exitcode, pid=pid)
        super()._on_worker_exit_sync(exitcode)

    def log_event(self, topic: Any, msg: Any) -> None:
        if topic == "worker-restart-memory" and isinstance(msg, dict):
            _record(msg.get("worker"), memory_kill=True, rss=msg.get("rss"), pid=msg.get("pid"))
        super().log_event(topic, msg)


def looks_like_oom(exc: BaseException | None) -> bool:
    """Whether an exception (or its cause chain) says the process or device ran out of memory."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, MemoryError):
            return True
        text = f"{type(exc).__name__} {exc}".lower().replace(" ", "")
        if any(marker.replace(" ", "") in text for marker in OOM_MARKERS):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def read_task_run(task_run_id: uuid.UUID, task: Any, flow_run_id: uuid.UUID | None, tags: set[str],
              wait: float) -> Any:
    """The task run as the server knows it, else as the engine would have made it."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import TaskRun
    from prefect.states import Running

    deadline = time.monotonic() + wait
    try:
        with get_client(sync_client=True) as client:
            while True:
                try:
                    run = client.read_task_run(task_run_id)
                except Exception:
                    run = None
                if run is not None or time.monotonic() >= deadline:
                    break
                time.sleep(0.2)
    except Exception:
        run = None
    if run is not None:
        run.run_count = max(int(run.run_count or 0), 1)  # it ran (its Running event may be in flight)
        return run
    return TaskRun(
        id=task_run_id, name=f"{task.name}-{task_run_id.hex[:3]}", flow_run_id=flow_run_id,
        task_key=getattr(task, "task_key", task.name), dynamic_key=task_run_id.hex, tags=sorted(tags),
        run_count=1, state=Running(),
    )


def crash_task_run(
    task_run_id: uuid.UUID, task: Any, flow_run_id: uuid.UUID | None, message: str,
    tags: set[str] | None = None, wait: float = 1.5,
) -> tuple[Any, Any]:
    """Report the task run ``Crashed`` with ``message``; returns ``(state, task_run)`` (best effort).

    Args:
        wait: seconds to wait for the server to know the task run (its events may be in flight).
    """
    from prefect.states import Crashed
    from prefect.utilities.engine import emit_task_run_state_change_event

    state = Crashed(message=message)
    state.state_details.task_run_id = task_run_id
    state.state_details.flow_run_id = flow_run_id
    run = None
    try:
        run = read_task_run(task_run_id, task, flow_run_id, set(tags or ()), wait)
        previous = run.state
        run.state = state
        run.state_type, run.state_name = state.type, state.name
        emit_task_run_state_change_event(task_run=run, initial_state=previous, validated_state=state)
    except Exception:
        logger.warning("could not report task run %s as Crashed", task_run_id, exc_info=True)
    return state, run


def await_retry(task_run: Any, flow_run_id: uuid.UUID | None, delay: float = 0.0) -> Any:
    """Move ``task_run`` to ``AwaitingRetry`` (re-run in ``delay`` s) and report it; returns the state."""
    import datetime

    from prefect.states import AwaitingRetry
    from prefect.utilities.engine import emit_task_run_state_change_event

    state = AwaitingRetry(
        scheduled_time=datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=delay))
    state.state_details.task_run_id = task_run.id
    state.state_details.flow_run_id = flow_run_id
    previous, task_run.state = task_run.state, state
    emit_task_run_state_change_event(task_run=task_run, initial_state=previous, validated_state=state)
    return state
