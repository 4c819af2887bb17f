"""CPython names gpu-tasks uses beyond the documented way: exit handlers, ``os._exit``,
``signal.signal``, multiprocessing's spawn executable and a fork server of its own."""

from __future__ import annotations

import atexit
import contextlib
import importlib
import itertools
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gpu_tasks.compat import Use, callables, called_in

logger = logging.getLogger(__name__)


def run_exit_handlers() -> None:
    """Run the interpreter's exit handlers now: a bound warm process then ends with ``os._exit``."""
    atexit._run_exitfuncs()


def replace_os_exit(replacement: Callable[[int], Any]) -> Callable[[int], Any]:
    """Make ``os._exit`` call ``replacement`` in this process; returns the one it replaced."""
    real = os._exit
    os._exit = replacement  # type: ignore[assignment]
    return real


@contextmanager
def signal_handlers_kept() -> Iterator[None]:
    """Within the block, ``signal.signal`` leaves handlers as they are: ``dask_jobqueue.runner`` sets
    a SIGINT handler on import (``ValueError`` off the main thread, Prefect's Ctrl-C lost on it)."""
    with _SIGNAL_SWAP:  # one swap at a time: two threads' nested swaps could keep `keep` for good
        real = signal.signal

        def keep(signum: Any, handler: Any) -> Any:
            logger.debug("gpu-tasks: kept the handler of signal %s while importing a cluster class", signum)
            return signal.getsignal(signum)

        signal.signal = keep  # type: ignore[assignment]
        try:
            yield
        finally:
            signal.signal = real


_SIGNAL_SWAP = threading.RLock()


class ForkServerContext:
    """A multiprocessing context whose processes fork from a fork server of its owner's (a warm pool):
    multiprocessing's own is shared by the whole process, preloads included, and never ends."""

    def __init__(self, preload: list[str]) -> None:
        import multiprocessing
        from multiprocessing import forkserver

        self.server = forkserver.ForkServer()
        self.server.set_forkserver_preload(list(preload))
        with _SERVERS_LOCK:
            self.key = next(_SERVER_KEYS)
            _SERVERS[self.key] = self.server
        self.Pipe = multiprocessing.Pipe
        self._started = False
        self._start_lock = threading.Lock()

    def ensure_started(self, around: Callable[[], contextlib.AbstractContextManager[Any]]) -> None:
        """Start the server now (once) inside ``around()``: the environment and executable it
        starts with are its children's."""
        with self._start_lock:
            if self._started:
                return
            with around():
                self.server.ensure_running()
            self._started = True

    def Process(self, **kwargs: Any) -> Any:
        """A process (not started) that forks from this context's server when started."""
        if _ForkedProcess is None:
            raise RuntimeError("this platform's multiprocessing has no fork server")
        return _ForkedProcess(_server_key=self.key, **kwargs)

    def close(self) -> None:
        """Let the server end once no process forked from it is left; a daemon thread reaps it."""
        with _SERVERS_LOCK:
            _SERVERS.pop(self.key, None)
        threading.Thread(
            target=_stop_server, args=(self.server,), name="gpu-tasks-fork-server-stop", daemon=True
        ).start()


def _stop_server(server: Any) -> None:
    with contextlib.suppress(ChildProcessError):  # reaped already (a wait for any child elsewhere)
        server._stop()


_SERVERS: dict[int, Any] = {}  # ForkServerContext.key -> its ForkServer
_SERVERS_LOCK = threading.Lock()
_SERVER_KEYS = itertools.count(1)


try:  # typed as Any: typeshed has no stubs for these modules' internals
    _mp_context: Any = importlib.import_module("multiprocessing.context")
    _mp_forkserver: Any = importlib.import_module("multiprocessing.forkserver")
    _mp_popen_forkserver: Any = importlib.import_module("multiprocessing.popen_forkserver")
except ImportError:  # pragma: no cover - no fork server (Windows)
    _ForkedProcess: Any = None
else:

    class _ForkedPopen(_mp_popen_forkserver.Popen):  # type: ignore[misc]
        def _launch(self, process_obj: Any) -> None:
            # popen_forkserver.Popen._launch (CPython 3.11-3.13) with the process's own server
            import io

            spawn: Any = importlib.import_module("multiprocessing.spawn")
            util: Any = importlib.import_module("multiprocessing.util")

            with _SERVERS_LOCK:
                server = _SERVERS[process_obj.server_key]
            prep_data = spawn.get_preparation_data(process_obj._name)
            # the main module is not imported again in the child (what it runs comes pickled by
            # value), so a script without a __main__ guard still works
            prep_data.pop("init_main_from_path", None)
            prep_data.pop("init_main_from_name", None)
            buf = io.BytesIO()
            _mp_context.set_spawning_popen(self)
            try:
                _mp_context.reduction.dump(prep_data, buf)
                _mp_context.reduction.dump(process_obj, buf)
            finally:
                _mp_context.set_spawning_popen(None)
            self.sentinel, w = server.connect_to_new_process(self._fds)
            _parent_w = os.dup(w)
            self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))
            with open(w, "wb", closefd=True) as f:
                f.write(buf.getbuffer())
            self.pid = _mp_forkserver.read_signed(self.sentinel)

    class ForkedProcess(_mp_context.ForkServerProcess):  # type: ignore[misc]
        """``ForkServerProcess`` that forks from the server of its ``server_key``."""

        def __init__(self, *args: Any, _server_key: int, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.server_key = _server_key

        @staticmethod
        def _Popen(process_obj: Any) -> Any:
            return _ForkedPopen(process_obj)

    _ForkedProcess = ForkedProcess


_SPAWN_LOCK = threading.Lock()


@contextmanager
def spawn_executable(path: str) -> Iterator[None]:
    """multiprocessing starts its spawned interpreters with ``path`` meanwhile."""
    from multiprocessing import spawn

    with _SPAWN_LOCK:
        old = spawn.get_executable()
        spawn.set_executable(path)
        try:
            yield
        finally:
            spawn.set_executable(old)


def _check_spawn_executable() -> str | None:
    from multiprocessing import forkserver, spawn

    # where the swapped executable is read
    return (
        callables(spawn, "multiprocessing.spawn", "get_executable", "set_executable")
        or called_in(forkserver.ForkServer.ensure_running, "get_executable")
        or called_in(spawn.get_command_line, "get_executable")
    )


def _check_signal() -> str | None:
    import importlib.util

    for name in ("signal", "getsignal"):
        if not callable(getattr(signal, name, None)):
            return f"signal.{name} is not callable"
    # the module the swap is for sets a handler when imported (read: importing it would take this
    # process's Ctrl-C)
    spec = importlib.util.find_spec("dask_jobqueue")
    runner = Path(spec.origin).parent / "runner.py" if spec is not None and spec.origin else None
    if runner is None or not runner.is_file():
        return None
    return called_in("dask_jobqueue.runner", "signal", source=runner.read_text(encoding="utf-8"))


def _check_forkserver() -> str | None:
    import inspect
    from multiprocessing import forkserver

    popen_forkserver: Any = importlib.import_module("multiprocessing.popen_forkserver")
    names = ("connect_to_new_process", "ensure_running", "set_forkserver_preload", "_stop")
    problem = callables(forkserver.ForkServer(), "multiprocessing.forkserver.ForkServer", *names)
    if problem:
        return problem
    source = inspect.getsource(popen_forkserver.Popen._launch)
    for needed in ("forkserver.connect_to_new_process(self._fds)", "set_spawning_popen(self)", "read_signed"):
        if needed not in source:
            return f"popen_forkserver.Popen._launch no longer has {needed!r}"
    return None


USES = [
    Use(
        "cpython",
        "atexit._run_exitfuncs",
        "private",
        "a bound warm process runs its exit handlers (Prefect's send logs and events), then exits at once",
        lambda: callables(atexit, "atexit", "_run_exitfuncs"),
    ),
    Use(
        "cpython",
        "os._exit",
        "patched",
        "a worker process ends its task's child processes whoever ends it with os._exit",
        lambda: callables(os, "os", "_exit"),
    ),
    Use(
        "cpython",
        "signal.signal",
        "patched",
        "swapped while a cluster manager's module imports, so it cannot take over Ctrl-C",
        _check_signal,
    ),
    Use(
        "cpython",
        "multiprocessing.spawn.get_executable, set_executable",
        "patched",
        "a warm process starts through a launcher that ignores SIGINT from its first instruction "
        "(a Ctrl-C on the terminal would kill it while it imports)",
        _check_spawn_executable,
    ),
    Use(
        "cpython",
        "multiprocessing.forkserver.ForkServer",
        "private",
        "warm worker processes fork from a fork server of the pool's own, which imported Prefect and "
        "distributed once (popen_forkserver.Popen._launch repeated with that server)",
        _check_forkserver,
    ),
]
