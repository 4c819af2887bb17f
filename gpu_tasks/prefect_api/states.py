"""Worker deaths and interrupted task runs, turned into Prefect states (docs/runner.md, "Faults"): sent
as events, as the engine sends them, so the recorder keeps them over anything the dead worker sent."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

OOM_MARKERS = (
    "out of memory",
    "out_of_memory",
    "outofmemory",
    "cudaerrormemoryallocation",
    "std::bad_alloc",
    "memoryerror",
    "cuda_error_out_of_memory",
)


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


def api_unreachable(timeout: float = 2.0) -> str | None:
    """Why the Prefect API cannot be reached now, or ``None``. One request, no retries: with Prefect's,
    reporting hundreds of task runs to a server that is gone would hang for hours."""
    import httpx
    from prefect.client.orchestration import get_client

    try:
        url = str(get_client(sync_client=True).api_url).rstrip("/")
    except Exception as exc:
        return f"no Prefect client ({type(exc).__name__}: {exc})"
    try:
        httpx.get(f"{url}/health", timeout=timeout)
    except httpx.TransportError as exc:
        return f"{url} ({type(exc).__name__}: {exc or 'no answer'})"
    return None


@contextlib.contextmanager
def no_client_retries(on: bool = True) -> Iterator[None]:
    """Prefect's client in this thread makes each request once (``on``): a refused connection fails at
    once, not after a minute of retries."""
    if not on:
        yield
        return
    from prefect.context import SettingsContext

    ctx = SettingsContext.get()
    if ctx is None:  # pragma: no cover - Prefect always has a root settings context
        yield
        return
    # as temporary_settings makes them, without validating all of Prefect's settings again (slow)
    settings = ctx.settings
    once = settings.model_copy(update={"client": settings.client.model_copy(update={"max_retries": 0})})
    with SettingsContext(profile=ctx.profile, settings=once):
        yield


def read_task_run(
    task_run_id: uuid.UUID,
    task: Any,
    flow_run_id: uuid.UUID | None,
    tags: set[str],
    wait: float,
    ran: bool = True,
) -> Any:
    """The task run as the server knows it, else as the engine would have made it (``ran``: it ran,
    else it never started: run count 0)."""
    from prefect.states import Running

    from gpu_tasks.prefect_api.api import sync_client

    deadline = time.monotonic() + wait
    try:
        with sync_client() as client:
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
        if ran:  # its Running event may be in flight
            run.run_count = max(int(run.run_count or 0), 1)
        run.tags = sorted(set(run.tags or ()) | tags)  # a worker that died at once sent none of its own
        return run
    return _local_task_run(task_run_id, task, flow_run_id, tags, int(ran), Running() if ran else None)


def _local_task_run(
    task_run_id: uuid.UUID, task: Any, flow_run_id: uuid.UUID | None, tags: set[str], runs: int, state: Any
) -> Any:
    """The task run as the engine would make it, before the server has it."""
    from prefect.client.schemas.objects import TaskRun

    return TaskRun(
        id=task_run_id,
        name=f"{task.name}-{task_run_id.hex[:3]}",
        flow_run_id=flow_run_id,
        task_key=getattr(task, "task_key", task.name),
        dynamic_key=task_run_id.hex,
        tags=sorted(tags),
        run_count=runs,
        state=state,
    )


def pending_task_run(
    task_run_id: uuid.UUID, task: Any, flow_run_id: uuid.UUID | None, tags: set[str], message: str
) -> None:
    """Record a task run that has not started ``Pending`` with ``message`` (why it waits): the server
    knows a task run only once its engine starts on a worker, so a task waiting for devices had no
    page to open in the UI. The engine's own states follow on the same task run."""
    from prefect.states import Pending

    _emit(
        _local_task_run(task_run_id, task, flow_run_id, tags, 0, None),
        None,
        Pending(message=message),
        flow_run_id,
    )


def crash_task_run(
    task_run_id: uuid.UUID,
    task: Any,
    flow_run_id: uuid.UUID | None,
    message: str,
    tags: set[str] | None = None,
    wait: float = 1.5,
    cancelled: bool = False,
    ran: bool = True,
) -> tuple[Any, Any]:
    """Report the task run ``Crashed`` with ``message`` (:func:`report_state`); ``Cancelled`` where
    it stopped because its flow run was cancelled (a user's cancel is no crash)."""
    from prefect.states import Cancelled, Crashed

    state: Any = (Cancelled if cancelled else Crashed)(message=message)
    return report_state(state, task_run_id, task, flow_run_id, tags, wait, ran)


PREEMPTED = "Preempted"  # the name of a preempted task run's Scheduled state


def report_state(
    state: Any,
    task_run_id: uuid.UUID,
    task: Any,
    flow_run_id: uuid.UUID | None,
    tags: set[str] | None,
    wait: float,
    ran: bool = True,
) -> tuple[Any, Any]:
    """Send ``state`` for the task run as Prefect's engine would, best effort, waiting up to ``wait`` s
    for the server to know it (``ran``: whether it ever started). Returns ``(state, task_run)``."""
    state.state_details.task_run_id = task_run_id
    state.state_details.flow_run_id = flow_run_id
    run = None
    try:
        run = read_task_run(task_run_id, task, flow_run_id, set(tags or ()), wait, ran)
        previous = run.state
        run.state = state
        run.state_type, run.state_name = state.type, state.name
        if state.is_final():  # as the engine ends a run: without it the UI showed no end or duration
            run.end_time = state.timestamp
        _emit(run, previous, state, flow_run_id)
    except Exception:
        logger.warning("could not report task run %s as %s", task_run_id, state.name, exc_info=True)
    return state, run


def retry_after_crash(
    task: Any,
    task_run: Any,
    flow_run_id: uuid.UUID | None,
    free_runs: int,
    crashes: int,
    message: str,
    log: Any,
) -> float | None:
    """After a crash report: the seconds before ``task`` runs again (its task run ``AwaitingRetry``
    now), or ``None`` when its runs used up its retries (``free_runs`` used none, ``crashes`` this one
    included: :func:`gpu_tasks.policy.crash_retry`)."""
    from gpu_tasks.policy import crash_retry, runs_counted

    retries = int(task.retries or 0)
    runs = int(getattr(task_run, "run_count", 0) or 0)
    delay = (
        None if task_run is None else crash_retry(retries, task.retry_delay_seconds, runs, free_runs, crashes)
    )
    left = f"; no retries left ({retries} allowed)" if retries else ""
    if delay is not None and not _condition_allows(task, task_run, message, log):
        # it was retried whatever the task's retry_condition_fn said (a new-user pass, 2 of 2)
        delay, left = None, "; its retry_condition_fn declined a retry"
    if delay is None:
        log.error("Task run %s crashed: %s%s", getattr(task_run, "name", None) or task.name, message, left)
        return None
    await_retry(task_run, flow_run_id, delay)
    log.warning(
        "Task run %r crashed: %s; retrying it (retry %d of %d) in %gs",
        task_run.name,
        message,
        runs_counted(runs, free_runs, crashes),
        retries,
        delay,
    )
    return delay


def _condition_allows(task: Any, task_run: Any, message: str, log: Any) -> bool:
    """What the task's ``retry_condition_fn`` says of a retry after this crash (as Prefect asks it
    after a failure: task, task run, state); an error in it declines, named in the log."""
    from prefect.states import Crashed

    condition = getattr(task, "retry_condition_fn", None)
    if condition is None:
        return True
    try:
        return bool(condition(task, task_run, Crashed(message=message)))
    except Exception as exc:
        log.warning("Task %r: its retry_condition_fn raised %r; not retrying", task.name, exc)
        return False


def rerun_task(task: Any, task_run: Any, free_runs: int, crashes: int) -> Any:
    """``task`` to run ``task_run`` again (after a crash, a preemption or out of memory), with the
    retries it has left (:func:`gpu_tasks.policy.rerun_retries`)."""
    from gpu_tasks.policy import rerun_retries

    runs = int(getattr(task_run, "run_count", 0) or 0)
    return task.with_options(retries=rerun_retries(int(task.retries or 0), runs, free_runs, crashes))


def await_retry(task_run: Any, flow_run_id: uuid.UUID | None, delay: float = 0.0) -> Any:
    """Move ``task_run`` to ``AwaitingRetry`` (re-run in ``delay`` s) and report it."""
    import datetime

    from prefect.client.schemas.objects import State
    from prefect.states import AwaitingRetry

    state: State[Any] = AwaitingRetry(
        scheduled_time=datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=delay)
    )
    state.state_details.task_run_id = task_run.id
    state.state_details.flow_run_id = flow_run_id
    previous, task_run.state = task_run.state, state
    _emit(task_run, previous, state, flow_run_id)
    return state


def _emit(task_run: Any, previous: Any, state: Any, flow_run_id: uuid.UUID | None) -> None:
    """Prefect's state event for ``task_run``, related to its flow run as the engine's are: Prefect's
    events worker adds the sending run context's. Sent outside it (a shared worker's report of its dead
    predecessor), the event named no flow run, or the one the events worker's thread began in, and the
    server's task-run recorder moved the task run there; the flow run's context is set for it here."""
    from prefect.context import FlowRunContext, TaskRunContext
    from prefect.utilities.engine import emit_task_run_state_change_event

    from gpu_tasks.prefect_api.api import sync_client

    task_run.flow_run_id = flow_run_id or task_run.flow_run_id
    within = getattr(getattr(FlowRunContext.get(), "flow_run", None), "id", None)
    with contextlib.ExitStack() as stack:
        if task_run.flow_run_id and within != task_run.flow_run_id:
            with contextlib.suppress(Exception), sync_client() as client:  # unreadable: sent as before
                flow_run = client.read_flow_run(task_run.flow_run_id)
                stack.enter_context(FlowRunContext.model_construct(flow_run=flow_run))
                stack.enter_context(TaskRunContext.model_construct(task_run=task_run))
        emit_task_run_state_change_event(task_run=task_run, initial_state=previous, validated_state=state)


def crash_topic(flow_run_id: Any) -> str:
    """The Dask event topic on which shared workers tell flow run ``flow_run_id``'s process of crashes."""
    return f"gpu-tasks-crashes-{flow_run_id}"


class ToFlow(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A shared worker's logger for the crashes it finds (:func:`retry_after_crash`): each line also
    goes to the flow process as a Dask event on :func:`crash_topic`, for the flow run's log."""

    def __init__(self, log: logging.Logger, flow_run_id: Any, profile: str | None) -> None:
        super().__init__(log)
        self.topic, self.profile = crash_topic(flow_run_id), profile

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        super().log(level, msg, *args, **kwargs)
        from distributed import get_worker

        try:
            told = {"level": level, "line": str(msg) % args, "profile": self.profile}
            get_worker().log_event(self.topic, told)
        except Exception:  # not on a worker, or it is closing: its own log has the line
            logger.debug("could not tell the flow process of a crash", exc_info=True)
