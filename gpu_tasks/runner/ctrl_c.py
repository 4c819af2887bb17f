"""Ctrl-C on a plain flow script: one line at once, and a second Ctrl-C that ends the process now; a
Ctrl-C while the runner closes its clusters is held until the close is done."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType

from gpu_tasks.worker.guard import end_children

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a command stopped by Ctrl-C
CHILDREN_GRACE_S = 1.0  # a child left (the ephemeral server) gets SIGTERM, then SIGKILL after this

_armed = False


def _plain_script() -> bool:
    """Whether this is a script run from a terminal, not an interactive session nor a deployment's run."""
    main = sys.modules.get("__main__")
    if os.environ.get("PREFECT__FLOW_RUN_ID"):
        return False
    return not (sys.flags.interactive or hasattr(sys, "ps1") or getattr(main, "__file__", None) is None)


def _python_handles_sigint() -> bool:
    """Whether this is the main thread and its SIGINT handler is still Python's own (not the script's):
    the default, or ``asyncio.run``'s (its first Ctrl-C cancels the flow, its second raises
    ``KeyboardInterrupt`` wherever the main thread is: in an async flow, half-way through the close)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    return signal.getsignal(signal.SIGINT) is signal.default_int_handler or _asyncio_runs_main() is not None


def interrupted(exc_type: type[BaseException]) -> bool:
    """Whether a flow that ended with ``exc_type`` was stopped by Ctrl-C: ``KeyboardInterrupt``, or in
    an async flow under ``asyncio.run`` the cancellation its first Ctrl-C makes."""
    if issubclass(exc_type, KeyboardInterrupt):
        return True
    return issubclass(exc_type, asyncio.CancelledError) and _asyncio_runs_main() is not None


def _asyncio_runs_main() -> asyncio.Runner | None:
    """The ``asyncio.Runner`` whose SIGINT handler is set (a partial of its bound method), if any."""
    runner = getattr(getattr(signal.getsignal(signal.SIGINT), "func", None), "__self__", None)
    return runner if isinstance(runner, asyncio.Runner) else None


def on_interrupt(running: int, profiles: list[str]) -> bool:
    """As the runner closes after a ``KeyboardInterrupt``: say what is left and arm the second Ctrl-C.
    Returns whether it was armed (only in a plain script while Python's own handler is set)."""
    global _armed
    if _armed:
        return True
    if not (_python_handles_sigint() and _plain_script()):
        return False
    signal.signal(signal.SIGINT, _second_ctrl_c)
    _armed = True
    if profiles:
        names = ", ".join(repr(n) for n in profiles)
        left = f"closing the workers of profile(s) {names} ({running} task run(s) running)"
    else:
        left = "no workers were started"
    _say(
        f"gpu-tasks: Ctrl-C: {left}; Prefect then records the flow run's end, which takes minutes "
        "when its API stopped with the same Ctrl-C. Press Ctrl-C again to end the process now."
    )
    return True


@contextlib.contextmanager
def held_while_closing() -> Iterator[None]:
    """Within the block, a Ctrl-C is said at once and raised when the block ends; a second one ends
    the process now. Only while Python's own handler is set."""
    if not _python_handles_sigint():
        yield
        return
    held: list[int] = []
    before = signal.getsignal(signal.SIGINT)

    def hold(signum: int, frame: FrameType | None) -> None:
        if held:
            _second_ctrl_c(signum, frame)
        held.append(signum)
        _say(
            "gpu-tasks: Ctrl-C while closing this flow run's workers: they are closed first, then the "
            "Ctrl-C goes on. Press Ctrl-C again to end the process now."
        )

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
    if held:
        raise KeyboardInterrupt


def _second_ctrl_c(signum: int, frame: FrameType | None) -> None:
    _say(
        "gpu-tasks: second Ctrl-C: ending the process now (Prefect's records of this flow run may "
        "stay incomplete)"
    )
    end_children(CHILDREN_GRACE_S)
    os._exit(EXIT_INTERRUPTED)


def _say(line: str) -> None:
    with contextlib.suppress(OSError, ValueError):  # a closed or broken stderr: the exit still happens
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
