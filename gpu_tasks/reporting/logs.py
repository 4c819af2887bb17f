"""Where the runner's own lines go: the terminal, and (:class:`RunLogs`) the flow run's logs on the
server, since Prefect sends only its own loggers' records; Dask's loggers are quietened meanwhile."""

from __future__ import annotations

import contextvars
import logging
import sys
import threading
import uuid
from typing import Any

logger = logging.getLogger("gpu_tasks.runner")

_ROOT = "gpu_tasks"
_DASK = ("distributed", "distributed.worker", "distributed.scheduler", "distributed.nanny")


def flow_logger() -> logging.Logger | logging.LoggerAdapter[logging.Logger]:
    """The flow run's Prefect logger, else the runner's (its lines reach the run via :class:`RunLogs`)."""
    from prefect.logging import get_run_logger

    try:
        return get_run_logger()
    except Exception:
        return logger


_TASK_RUN_LOGS = "gpu_tasks.task_runs"  # lines for a task run's logs on the server only (no console)


def task_run_log(
    task_run_id: uuid.UUID, flow_run_id: uuid.UUID | None, task_name: str, flow_run_name: str | None = None
) -> logging.LoggerAdapter[logging.Logger]:
    """A logger whose lines reach task run ``task_run_id``'s logs on the server, also before it
    started; send from the flow run's context. API only: a pipe nobody reads must not block it."""
    from prefect.logging.handlers import APILogHandler

    lg = logging.getLogger(_TASK_RUN_LOGS)
    with RunLogs._lock:
        if not any(isinstance(h, APILogHandler) for h in lg.handlers):
            lg.addHandler(APILogHandler())
            lg.setLevel(logging.INFO)
            lg.propagate = False
    return logging.LoggerAdapter(
        lg,
        {
            "task_run_id": str(task_run_id),
            "flow_run_id": str(flow_run_id) if flow_run_id is not None else None,
            "task_run_name": task_name,
            "task_name": task_name,
            "flow_run_name": flow_run_name or "<unknown>",
        },
    )


def _attributable(record: logging.LogRecord) -> bool:
    """Whether Prefect's own API handler can name the record's flow run (its thread's run context)."""
    from prefect.context import FlowRunContext, TaskRunContext

    return (
        getattr(record, "flow_run_id", None) is not None
        or FlowRunContext.get() is not None
        or TaskRunContext.get() is not None
    )


class _PrefectCanSend(logging.Filter):
    """On Prefect's API handler of the ``gpu_tasks`` logger (``PREFECT_LOGGING_EXTRA_LOGGERS``): the
    records of the runner's threads carry no run context, and Prefect dropped them with a
    ``UserWarning``; they are left to :class:`RunLogs`, which names their flow run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _attributable(record)


class RunLogs(logging.Handler):
    """Sends ``gpu_tasks.*`` records to the Prefect API as the flow run's logs (one per process). A record
    goes to its thread's flow run, else to the only entered one (runner threads carry no context)."""

    _lock = threading.Lock()
    _instance: RunLogs | None = None

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.runs: dict[uuid.UUID, tuple[contextvars.Context, int]] = {}
        self.saved_levels: dict[str, int] | None = None
        self.dask_level = "WARNING"
        self.api: Any = None

    @classmethod
    def enter(cls, flow_run_id: uuid.UUID | None, dask_level: str) -> None:
        """A runner of ``flow_run_id`` starts (call from inside the flow run's context)."""
        with cls._lock:
            me = cls._instance
            if me is None:
                from prefect.logging.handlers import APILogHandler

                me = cls._instance = cls()
                me.api = APILogHandler()
                logging.getLogger(_ROOT).addHandler(me)
            for handler in logging.getLogger(_ROOT).handlers:  # PREFECT_LOGGING_EXTRA_LOGGERS names us
                if isinstance(handler, me.api.__class__) and not any(
                    isinstance(f, _PrefectCanSend) for f in handler.filters
                ):
                    handler.addFilter(_PrefectCanSend())
            if me.saved_levels is None:
                me.saved_levels = {}
                me.dask_level = dask_level
                if logging.getLogger(_ROOT).level == logging.NOTSET:
                    # Prefect's root logger is at WARNING; a level set by the user stays
                    me.saved_levels[_ROOT] = logging.NOTSET
                    logging.getLogger(_ROOT).setLevel(logging.INFO)
                if "distributed" in sys.modules:
                    me._quiet_dask()
            if flow_run_id is not None:
                ctx, count = me.runs.get(flow_run_id, (contextvars.copy_context(), 0))
                me.runs[flow_run_id] = (ctx, count + 1)

    @classmethod
    def dask_imported(cls) -> None:
        """Dask is about to start a cluster in this process: importing ``distributed`` sets its
        loggers from Dask's config (INFO), so its levels are set again now."""
        import distributed  # noqa: F401  (its config module sets Dask's logging config on first import)

        with cls._lock:
            if cls._instance is not None and cls._instance.saved_levels is not None:
                cls._instance._quiet_dask()

    def _quiet_dask(self) -> None:
        assert self.saved_levels is not None
        for name in _DASK:
            lg = logging.getLogger(name)
            self.saved_levels.setdefault(name, lg.level)
            lg.setLevel(self.dask_level)

    @classmethod
    def leave(cls, flow_run_id: uuid.UUID | None) -> None:
        """That runner has closed; the last one out restores Dask's log levels."""
        with cls._lock:
            me = cls._instance
            if me is None:
                return
            if flow_run_id is not None and flow_run_id in me.runs:
                ctx, count = me.runs[flow_run_id]
                if count > 1:
                    me.runs[flow_run_id] = (ctx, count - 1)
                else:
                    del me.runs[flow_run_id]
            if not me.runs and me.saved_levels is not None:
                for name, level in me.saved_levels.items():
                    logging.getLogger(name).setLevel(level)
                me.saved_levels = None

    def emit(self, record: logging.LogRecord) -> None:
        from prefect.context import FlowRunContext

        prefects = [h for h in logging.getLogger(_ROOT).handlers if isinstance(h, self.api.__class__)]
        if prefects and _attributable(record):
            return  # PREFECT_LOGGING_EXTRA_LOGGERS names gpu_tasks: Prefect sends this one already
        current = FlowRunContext.get()
        run_id = current.flow_run.id if current is not None and current.flow_run is not None else None
        # no lock: enter() takes it before logging's own, which may be held here; a dict copy is atomic
        runs = dict(self.runs)
        if run_id is not None:
            entry = runs.get(run_id)
        elif len(runs) == 1:
            run_id, entry = next(iter(runs.items()))
        else:
            return
        if entry is None:
            return  # a flow run whose runner is not gpu-tasks' (or has closed)
        record.flow_run_id = run_id
        try:
            entry[0].copy().run(self.api.emit, record)
        except Exception:
            self.handleError(record)
