"""Worker preload: a worker process and its children go when the flow process goes, even by SIGKILL
(docs/runner.md, "The flow process is killed" and "A worker process crashes in C code")."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, NoReturn

import psutil

from gpu_tasks.compat import distributed as _dask_private
from gpu_tasks.compat.cpython import replace_os_exit

logger = logging.getLogger(__name__)

MODULE = "gpu_tasks.worker.guard"
POLL_S = 0.5  # how often the watch thread looks at the parent
GRACE_S = 1.0  # SIGTERM to SIGKILL

_state: dict[str, Any] = {}  # pid, parent, flow, watch, exit (the real os._exit) once started
_lock = threading.Lock()


def preload_options(preload: Any = None, preload_argv: Any = None) -> dict[str, Any]:
    """Nanny options ``preload``/``preload_argv`` with this guard added once (``None``: Dask's config)."""
    import dask

    if preload is None:
        preload = dask.config.get("distributed.worker.preload", [])
    if preload_argv is None:
        preload_argv = dask.config.get("distributed.worker.preload-argv", [])
    preload = [preload] if isinstance(preload, str) else list(preload)
    if MODULE in preload:
        return {"preload": preload, "preload_argv": list(preload_argv)}
    return _dask_private.add_preload(preload, preload_argv, MODULE)


def dask_setup(worker: Any) -> None:
    """Dask preload hook: start the guard; pin the worker to its devices' CPUs (every worker path has
    this preload, so this is the one place that applies them)."""
    start(os.getppid())
    from gpu_tasks.worker.affinity import apply_from_env

    apply_from_env()


def dask_teardown(worker: Any) -> None:
    """Dask preload hook: end the processes the worker's tasks left."""
    ended = end_children()
    if ended:
        logger.info("worker %d closing: ended %d child process(es) its tasks left", os.getpid(), ended)


def start(parent: int, flow: int | None = None) -> None:
    """Watch the flow process from a daemon thread, wrap ``os._exit``, ignore SIGINT (once per process).
    ``flow``: the flow's pid when it is not ``parent`` (a fork server outlives the flow process)."""
    with _lock:
        if _state.get("pid") == os.getpid():
            return
        first = _state.get("exit")
        real = replace_os_exit(_exit)
        watch = _flow_watch(flow) if flow is not None and flow != parent else None
        _state.update(pid=os.getpid(), parent=parent, flow=flow or parent, watch=watch, exit=first or real)
    if not faulthandler.is_enabled():
        with contextlib.suppress(Exception):  # a stderr without a file descriptor
            faulthandler.enable(all_threads=True)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _ignore_sigint)
        signal.signal(signal.SIGTERM, _terminate)
    threading.Thread(target=_watch, name="gpu-tasks-worker-guard", daemon=True).start()
    _say(logging.INFO, "worker %d: watching flow process %d; exits with it", os.getpid(), parent)


def _say(level: int, msg: str, *args: Any, exc_info: bool = False) -> None:
    """Log on the way out, whatever the log's stream does: once the flow process is gone, the pipe
    the worker's stderr went to may be closed (Prefect's ``serve`` exits on the same Ctrl-C), and
    Prefect's console handler (rich) then raises ``SystemExit``, which ended the guard's thread
    before the worker did: the orphaned worker lived on until Dask's 30 s connect timeout."""
    with contextlib.suppress(BaseException):
        logger.log(level, msg, *args, exc_info=exc_info)


def end_children(grace: float = GRACE_S) -> int:
    """SIGTERM, then SIGKILL after ``grace`` s, this process's descendants but multiprocessing's
    resource tracker (it exits by itself); how many were asked to end."""
    try:
        procs = [p for p in psutil.Process().children(recursive=True) if not _is_resource_tracker(p)]
    except psutil.Error:
        return 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    if alive:
        _say(
            logging.WARNING,
            "process %d: killed %d child process(es) that ignored SIGTERM for %gs",
            os.getpid(),
            len(alive),
            grace,
        )
        psutil.wait_procs(alive, timeout=grace)
    return len(procs)


def _flow_watch(flow: int) -> Any:
    """A pidfd of ``flow`` (readable once it exits), else its ``psutil.Process`` (a reused pid is not
    taken for it); ``None`` when it is gone already."""
    with contextlib.suppress(OSError, AttributeError):
        return os.pidfd_open(flow)  # Linux only
    try:
        return psutil.Process(flow)
    except psutil.Error:
        return None


def _flow_gone(timeout: float) -> bool:
    """Whether the flow process is gone, waiting up to ``timeout`` s for it to go."""
    watch, parent = _state.get("watch"), _state["parent"]
    if _state["flow"] == parent:
        deadline = time.monotonic() + timeout
        while os.getppid() == parent:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02 if timeout <= 1.0 else POLL_S)
        return True
    if watch is None:
        return True
    if isinstance(watch, int):
        import select

        return bool(select.select([watch], [], [], timeout)[0])
    try:
        watch.wait(timeout)
    except psutil.TimeoutExpired:
        return False
    return True


def _watch() -> None:
    while not _flow_gone(3600.0):
        pass
    _say(
        logging.WARNING,
        "worker %d: flow process %d is gone; ending this worker and its child processes",
        os.getpid(),
        _state["flow"],
    )
    _exit(1)


_ORPHAN_HOOKS: list[Callable[[int], None]] = []


def on_orphaned(hook: Callable[[int], None]) -> None:
    """Call ``hook(flow_pid)`` (which bounds its own time) when this worker exits as its flow died."""
    if hook not in _ORPHAN_HOOKS:
        _ORPHAN_HOOKS.append(hook)


def _exit(status: int) -> NoReturn:
    """``os._exit`` for the worker process: end its child processes, then exit."""
    real = _state["exit"]
    if os.getpid() == _state.get("pid"):  # not in a forked child, which inherits this
        _state["exiting"] = True  # before the lock: a SIGTERM from here on waits for this clean-up
        with _lock:  # a second caller waits for the first one's clean-up
            flow = _state.get("flow")
            # Dask exits its worker (-1) on its pipe's close, a moment before the kernel re-parents it
            if flow is not None and _flow_gone(1.0 if status == -1 else 0.0):
                for hook in list(_ORPHAN_HOOKS):
                    try:
                        hook(flow)
                    except BaseException:  # exiting anyway
                        _say(logging.WARNING, "worker %d: orphan hook failed", os.getpid(), exc_info=True)
            with contextlib.suppress(BaseException):  # exiting anyway
                end_children()
    real(status)
    raise AssertionError("unreachable")  # pragma: no cover


def _terminate(signum: int, frame: FrameType | None) -> None:
    # how an interrupted flow process stops busy workers: Python's default action would orphan children
    if _state.get("exiting") and os.getpid() == _state.get("pid"):
        # already exiting: the handler may run inside that clean-up, in the thread holding _lock,
        # where waiting for it never ended (a forked worker's SIGTERM mid-exit left it hung for good)
        return
    _exit(128 + signum)


def _ignore_sigint(signum: int, frame: FrameType | None) -> None:
    # A handler, not SIG_IGN: processes that tasks exec get the default action back.
    _say(logging.INFO, "worker %d: ignoring SIGINT; the flow process closes its workers", os.getpid())


def _is_resource_tracker(proc: psutil.Process) -> bool:
    try:
        return "resource_tracker" in " ".join(proc.cmdline())
    except psutil.Error:
        return False
