"""Warm worker processes: started and imported, holding no device until a lease binds one
(:class:`WarmPool`). See docs/runner.md, "Warm workers"."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import importlib
import logging
import multiprocessing
import os
import stat
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection
from typing import Any

import dask

from gpu_tasks.compat.cpython import ForkServerContext, run_exit_handlers, spawn_executable
from gpu_tasks.settings import get_settings
from gpu_tasks.worker import forkserver, prefect_queues
from gpu_tasks.worker import guard as _worker_guard

logger = logging.getLogger(__name__)

# modules whose import may initialise CUDA or grab a device: an unbound process has none
CUDA_MODULES = (
    "cupy",
    "cudf",
    "rmm",
    "numba.cuda",
    "torch",
    "cuda",
    "dask_cuda",
    "cuml",
    "jax",
    "tensorflow",
)
# what a warm process imports before it says it is ready (the engine is most of a cold start)
WARM_IMPORTS = (
    "distributed",
    "distributed.worker",
    "prefect.task_engine",
    "gpu_tasks.worker.engine",
    "gpu_tasks.worker.inherited",
)
# the fork server's last preload: it ends at once when its flow process is gone (imported there only)
FORK_SERVER_EXIT = "gpu_tasks.worker.fork_server_exit"
CLOSE_GRACE_S = 3.0  # a bound process asked to close, before SIGTERM
KILL_GRACE_S = 2.0  # SIGTERM to SIGKILL
MEMORY_POLL_S = 0.5
REFILL_DELAY_S = 2.0  # from taking warm processes to starting their replacements
_WHOLE_ENVIRON = "__gpu_tasks_whole_environ__"  # in a bind's env: it is the whole environment


def provision_timeout_advice(what: str, seconds: float, spawned: bool) -> str:
    """``what`` (``cluster ... did not start``) past the provision timeout of ``seconds``, and the fix;
    ``spawned`` worker processes re-import the flow's script, so they name the ``__main__`` guard."""
    return (
        f"{what} within {seconds:g}s; if this host is slow or busy, raise GPU_TASKS_PROVISION_TIMEOUT "
        f"(now {seconds:g}s)"
        + (
            ". Spawned worker processes re-import the script that started the flow: a flow call not "
            'guarded by `if __name__ == "__main__":` also keeps them from starting'
            if spawned
            else ""
        )
    )


def _child_main(conn: Connection, flow: int) -> None:
    """A warm process: import, say ready, wait for a bind, run one Dask worker or scheduler."""
    _worker_guard.start(os.getppid(), flow=flow)
    for name in WARM_IMPORTS:  # done already in a process forked from the pool's fork server
        importlib.import_module(name)
    try:
        conn.send(("ready", os.getpid(), [m for m in CUDA_MODULES if m in sys.modules]))
        msg = conn.recv()
    except (EOFError, OSError):  # the pool closed
        return
    if msg[0] not in ("bind", "scheduler"):
        return
    if msg[0] == "bind":
        _, scheduler, worker_kwargs, env, config, silence_logs, cuda = msg
    else:
        _, scheduler_kwargs, env, config, silence_logs = msg
    if env.pop(_WHOLE_ENVIRON, None):
        # a fork server's environment is the flow's as it was when the server started
        os.environ.clear()
    os.environ.update(env)
    from gpu_tasks.worker.inherited import dask_config_is_current

    if not dask_config_is_current():
        dask.config.refresh()
    dask.config.set(config)
    if silence_logs:
        logging.getLogger("distributed").setLevel(silence_logs)
    from gpu_tasks.worker import serve

    if msg[0] == "bind":
        run_in_new_loop(serve.serve_worker(conn, scheduler, worker_kwargs, cuda))
        prefect_queues.send_before_exit(conn)
    else:
        run_in_new_loop(serve.serve_scheduler(conn, scheduler_kwargs))
    _exit_now()


def run_in_new_loop(main: Any) -> Any:
    """Run coroutine ``main`` in a new event loop of the kind Dask's worker processes use."""
    factory = None
    if dask.config.get("distributed.admin.event-loop", "tornado") == "uvloop":
        factory = importlib.import_module("uvloop").new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


def _exit_now() -> None:
    """End a bound process once its exit handlers have run, skipping the interpreter's teardown."""
    run_exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


class WarmProcess:
    """One pool process, seen from the flow process."""

    def __init__(self, ctx: Any) -> None:
        self.forked = isinstance(ctx, ForkServerContext)
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_child_main, args=(child, os.getpid()), name="gpu-tasks warm worker", daemon=False
        )
        if self.forked:  # the fork server's environment is set once, when the server starts
            ctx.ensure_started(_spawn_environment)
            self.process.start()
        else:
            with _spawn_environment():
                self.process.start()
        child.close()
        _track(self)
        self.ready = False
        self._reading = threading.Lock()  # one reader of its pipe until it is bound

    def bind_environ(self, env: dict[str, str]) -> dict[str, str]:
        """The environment a bind sends: ``env`` over the flow's as it is now (for a forked process)."""
        if not self.forked:
            return {**_pre_spawn_environ(), **env}
        return {**os.environ, **_pre_spawn_environ(), **env, _WHOLE_ENVIRON: "1"}

    @property
    def pid(self) -> int | None:
        pid: int | None = self.process.pid
        return pid

    def wait_ready(self, timeout: float, total: float | None = None) -> None:
        """Wait for the process to finish importing: ``TimeoutError``, or ``RuntimeError`` if it exited
        (the pool and a profile may wait at once). ``total``: the whole wait ``timeout`` is left of."""
        deadline = time.monotonic() + timeout
        total = timeout if total is None else total
        late = provision_timeout_advice(
            f"warm worker process {self.pid} did not finish importing", total, spawned=not self.forked
        )
        if not self._reading.acquire(timeout=max(0.0, timeout)):
            raise TimeoutError(late)
        try:
            if self.ready:
                return
            if not self.conn.poll(max(0.0, deadline - time.monotonic())):
                if not self.process.is_alive():
                    raise RuntimeError(self._died())
                raise TimeoutError(late)
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                raise RuntimeError(self._died()) from None
            if msg[0] != "ready":
                raise RuntimeError(f"warm worker process {self.pid}: unexpected message {msg[0]!r}")
            if msg[2]:  # e.g. the flow script imports cupy: harmless until CUDA initialises, lazily
                logger.debug("warm worker process %s loaded %s before a device was bound", self.pid, msg[2])
            self.ready = True
        finally:
            self._reading.release()

    def ready_now(self) -> bool:
        """Whether it has finished importing, without waiting."""
        if self.ready:
            return True
        if not self._reading.acquire(blocking=False):
            return False  # someone is reading its answer now
        try:
            ready = self.conn.poll(0)
        finally:
            self._reading.release()
        if ready:
            with contextlib.suppress(TimeoutError, RuntimeError):
                self.wait_ready(0)
        return self.ready

    def _died(self) -> str:
        self.process.join(timeout=1)
        from gpu_tasks.worker.exits import describe_exitcode

        died = f"warm worker process {self.pid} {describe_exitcode(self.process.exitcode)} while starting"
        if self.forked:
            return (
                f"{died} (forked from the warm pool's fork server); GPU_TASKS_TUNE_WARM_START=spawn starts "
                "each one in a new interpreter instead"
            )
        return (
            f"{died}. Worker processes are spawned and re-import the script that started the flow: guard "
            'the flow call with `if __name__ == "__main__":`'
        )

    def stop(self) -> None:
        """End the process (unbound: it exits when its pipe closes; bound: after the grace)."""
        with contextlib.suppress(OSError):
            self.conn.close()
        end_process(self.process, CLOSE_GRACE_S)


_ALL: weakref.WeakSet[WarmProcess] = weakref.WeakSet()
_ALL_LOCK = threading.Lock()
_ALL_REGISTERED: list[bool] = []


def _track(proc: WarmProcess) -> None:
    """Remember ``proc`` for :func:`_end_all`, registered after multiprocessing's exit handler so
    that it runs before that one joins its children."""
    with _ALL_LOCK:
        if not _ALL_REGISTERED:
            atexit.register(_end_all)
            _ALL_REGISTERED.append(True)
        _ALL.add(proc)


def _end_all() -> None:  # pragma: no cover - interpreter exit
    """At interpreter exit: end every warm process still running (bound or not)."""
    with _ALL_LOCK:
        procs = [p for p in _ALL if p.process.is_alive()]
    for proc in procs:
        with contextlib.suppress(OSError):
            proc.conn.close()
        proc.process.terminate()
    for proc in procs:
        end_process(proc.process, KILL_GRACE_S)


def end_closed(warm: WarmProcess, grace: float) -> None:
    """:func:`end_process` for a bound process asked to close; one that says it is sending its
    queued Prefect events gets ``GPU_TASKS_TUNE_EVENTS_DRAIN_SECONDS`` more first."""
    warm.process.join(timeout=grace)
    bound = get_settings().events_drain_seconds
    if bound and warm.process.is_alive() and prefect_queues.says_draining(warm.conn):
        warm.process.join(timeout=bound + KILL_GRACE_S)
    end_process(warm.process, 0.0)


def end_process(process: Any, grace: float) -> None:
    """Wait ``grace`` s for ``process`` to exit, then SIGTERM, then SIGKILL."""
    process.join(timeout=grace)
    if process.is_alive():
        process.terminate()  # its guard ends the processes its tasks started
        process.join(timeout=KILL_GRACE_S)
    if process.is_alive():
        process.kill()
        process.join(timeout=KILL_GRACE_S)


class WarmPool:
    """Up to ``size`` unbound, imported worker processes, replaced as they are taken; never more idle
    than could still be bound (``capacity``: the most the flow's profiles can have bound at once)."""

    def __init__(self, size: int, capacity: int | None = None) -> None:
        self.size = size
        self.capacity = capacity
        self._ctx = _context()  # a shared fork server is given back by close()
        self._idle: list[WarmProcess] = []
        self._bound: list[WarmProcess] = []
        self._timers: list[threading.Timer] = []  # refills scheduled (cancelled by close)
        self._lock = threading.Lock()
        self._closed = False
        self._starter: threading.Thread | None = None

    def target(self) -> int:
        """How many idle processes to keep now: ``size``, less the places bound processes fill."""
        with self._lock:
            self._bound = [p for p in self._bound if p.process.is_alive()]
            if self.capacity is None:
                return self.size
            return max(0, min(self.size, self.capacity - len(self._bound)))

    def start(self) -> None:
        """Start processes until the target is idle (they import in the background)."""
        self.ensure(self.target())

    def start_in_background(self) -> None:
        """:meth:`start` from a thread of its own: the first task waits for a new fork server's
        imports only when it needs a warm process."""

        def launch() -> None:
            t0 = time.monotonic()
            try:
                self.start()
            except Exception:  # a profile that needs a process starts one itself, and raises
                logger.warning("gpu-tasks warm pool: starting its processes failed", exc_info=True)
                return
            logger.debug(
                "gpu-tasks warm pool: %d process(es) launched in %.2f s", self.target(), time.monotonic() - t0
            )

        thread = threading.Thread(target=launch, name="gpu-tasks-warm-start", daemon=True)
        with self._lock:
            self._starter = thread
        thread.start()

    def released(self, proc: WarmProcess) -> None:
        """A bound process ended: its place is free again; a replacement starts shortly."""
        with self._lock:
            if proc in self._bound:
                self._bound.remove(proc)
        self._refill_later()

    def ensure(self, n: int) -> None:
        """At least ``n`` idle processes, started now if needed."""
        with self._lock:
            if self._closed:
                return
            self._prune()
            missing = n - len(self._idle)
            if missing > 0:
                self._idle.extend(WarmProcess(self._ctx) for _ in range(missing))

    def wait_ready(self, n: int, timeout: float) -> None:
        """Block until ``n`` idle processes are ready, starting more when fewer exist; one that fails
        while starting is replaced, and the error raised when more than ``n`` fail."""
        deadline = time.monotonic() + timeout
        failed = 0
        while True:
            self.ensure(n)
            with self._lock:
                waiting = [p for p in self._idle[:n] if not p.ready]
            if not waiting:
                return
            for proc in waiting:
                try:
                    proc.wait_ready(max(0.0, deadline - time.monotonic()), total=timeout)
                except RuntimeError:
                    failed += 1
                    self._discard(proc)
                    if failed > n:
                        raise
                    logger.warning("gpu-tasks warm pool: a process failed while starting", exc_info=True)

    def take(self, timeout: float) -> WarmProcess:
        """An idle process (the readiest first), or a new one; a replacement starts shortly."""
        with self._lock:
            self._prune()
            idle = list(self._idle)
        found = next((p for p in idle if p.ready_now()), None) or (idle[0] if idle else None)
        with self._lock:
            if found is None or found not in self._idle:  # another profile took it meanwhile
                found = None
            else:
                self._idle.remove(found)
        proc = found or WarmProcess(self._ctx)
        with self._lock:
            self._bound.append(proc)
        self._refill_later()
        proc.wait_ready(timeout)
        return proc

    def own(self, timeout: float) -> WarmProcess:
        """A new ready process outside the pool's count and capacity (a profile's scheduler)."""
        proc = WarmProcess(self._ctx)
        proc.wait_ready(timeout)
        return proc

    def _refill_later(self) -> None:
        # after a delay: the first tasks of the workers just bound need the CPU more
        timer = threading.Timer(REFILL_DELAY_S, self._refill)
        timer.daemon = True
        with self._lock:
            if self._closed:
                return
            self._timers = [t for t in self._timers if t.is_alive()] + [timer]
        timer.start()

    def _refill(self) -> None:
        """The refill timer's work; a fork server that ended under it (stopping) is no error."""
        try:
            self.ensure(self.target())
        except (EOFError, OSError) as exc:  # its pipe closed mid-request, or it was reaped
            with self._lock:
                closed = self._closed
            level = logging.DEBUG if closed or sys.is_finalizing() else logging.WARNING
            why = f"{type(exc).__name__}: {exc}"
            logger.log(level, "gpu-tasks warm pool: no refill, its fork server ended (%s)", why)
        except Exception:
            logger.warning("gpu-tasks warm pool: refilling failed; processes start on demand", exc_info=True)

    def describe(self) -> list[dict[str, Any]]:
        """The idle processes: ``pid`` and whether each is ``ready`` (done importing)."""
        with self._lock:
            idle = list(self._idle)
        return [{"pid": p.pid, "ready": p.ready_now()} for p in idle if p.process.is_alive()]

    def close(self) -> None:
        """End every idle process; later calls to ``ensure`` start nothing."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            timers, self._timers = self._timers, []
            starter = self._starter
        for timer in timers:  # no timer thread outlives the close
            timer.cancel()
            timer.join(timeout=1.0)
        if starter is not None:
            starter.join(timeout=1.0)
        for proc in idle:
            with contextlib.suppress(OSError):
                proc.conn.close()
        for proc in idle:
            end_process(proc.process, CLOSE_GRACE_S)
        if isinstance(self._ctx, ForkServerContext):
            forkserver.release(self._ctx)

    def _prune(self) -> None:
        for proc in [p for p in self._idle if not p.process.is_alive()]:
            self._idle.remove(proc)

    def _discard(self, proc: WarmProcess) -> None:
        with self._lock:
            if proc in self._idle:
                self._idle.remove(proc)
        proc.stop()


def _context() -> Any:
    """Forked from this process's fork server (Linux, ``GPU_TASKS_TUNE_WARM_START=forkserver``) or spawned."""
    if sys.platform.startswith("linux") and get_settings().warm_start == "forkserver":
        if (why := _socket_path_too_long()) is None:
            return forkserver.acquire([*WARM_IMPORTS, FORK_SERVER_EXIT])
        _warn_once(why)
    return multiprocessing.get_context("spawn")


_SAID: set[str] = set()


def _warn_once(why: str) -> None:
    if why not in _SAID:
        _SAID.add(why)
        logger.warning("gpu-tasks: %s", why)


AF_UNIX_PATH_MAX = 107  # Linux: 108 bytes with the terminating NUL


def _socket_path_too_long() -> str | None:
    """Why a fork server cannot start here, if so: a deep ``TMPDIR`` makes its socket path too long."""
    import tempfile

    path = os.path.join(tempfile.gettempdir(), "pymp-" + "x" * 8, "listener-" + "x" * 8)
    if len(os.fsencode(path)) <= AF_UNIX_PATH_MAX:
        return None
    return (
        f"the temporary directory {tempfile.gettempdir()!r} is too deep for the warm pool's fork server "
        f"(its socket path would be {len(os.fsencode(path))} bytes, Linux allows {AF_UNIX_PATH_MAX}): "
        "warm workers are spawned instead, each importing Prefect and Dask itself (slower). Fix: set "
        "TMPDIR to a shorter directory, e.g. TMPDIR=/tmp"
    )


def _pre_spawn_environ() -> dict[str, str]:
    """What Dask's nanny sets before it spawns a worker (``distributed.nanny.pre-spawn-environ``,
    read as the nanny reads it), and no device."""
    cfg = dask.config.get("distributed.nanny.pre-spawn-environ", {}) or {}
    env = {str(k): os.environ.get(str(k), str(v)) for k, v in cfg.items() if v is not None}
    if env.get("PYTHONHASHSEED") in (None, "0"):
        env["PYTHONHASHSEED"] = "6640"  # as the nanny: the same hashing in every worker
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.setdefault("PREFECT_SERVER_EPHEMERAL_ENABLED", "false")
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    return env


def _launcher(env: dict[str, str]) -> str | None:
    """A shared shell script, named by its content, that runs this Python with ``env`` and SIGINT
    ignored; ``None`` without /bin/sh or a private ``$TMPDIR/gpu-tasks-<uid>``."""
    if not os.path.exists("/bin/sh"):
        return None
    import hashlib
    import shlex
    import tempfile

    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(env.items()) if k.isidentifier())
    text = f"#!/bin/sh\ntrap '' INT\n{exports}exec {shlex.quote(sys.executable)} \"$@\"\n"
    folder = os.path.join(tempfile.gettempdir(), f"gpu-tasks-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, 0o700)
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        why = (
            f"{folder} is not a directory of this user's alone (owner {info.st_uid}, mode "
            f"{stat.filemode(info.st_mode)}): warm processes start without their launcher (this process's "
            "environment until bound, and a Ctrl-C reaches them while they import); remove it, or set TMPDIR"
        )
        _warn_once(why)
        return None  # never run a script from a directory others can write
    path = os.path.join(folder, f"launch-{hashlib.sha256(text.encode()).hexdigest()[:20]}.sh")
    if not os.path.exists(path):
        fd, part = tempfile.mkstemp(dir=folder, suffix=".part")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(part, 0o700)
        os.replace(part, path)  # whole or not at all, for a flow process starting beside this one
    return path


@contextlib.contextmanager
def _spawn_environment() -> Any:
    """A new interpreter starts through :func:`_launcher`; this process's ``os.environ`` never changes."""
    launcher = _launcher(_pre_spawn_environ())
    if launcher is None:
        yield
        return
    with spawn_executable(launcher):
        yield
