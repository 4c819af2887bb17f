"""Processes of a fault scenario: found by an environment marker every descendant inherits,
waited for, interrupted as a terminal would, and killed when something is left.

Shared by ``python -m bench.faults`` and the fault tests (``tests/faults/``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from typing import Any


def marked(marker: str) -> list[Any]:
    """Live (not zombie) processes whose environment carries ``GPU_TASKS_TEST_MARKER=marker``."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        try:
            if (
                proc.status() != psutil.STATUS_ZOMBIE
                and proc.environ().get("GPU_TASKS_TEST_MARKER") == marker
            ):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def wait_gone(marker: str, timeout: float, keep: int | None = None) -> tuple[float, list[str]]:
    """Seconds until no marked process but ``keep`` (a pid) is left (or ``timeout``), and the command
    lines of those left."""
    import psutil

    t0 = time.monotonic()
    while True:
        left = [p for p in marked(marker) if p.pid != keep]
        if not left or time.monotonic() - t0 >= timeout:
            break
        time.sleep(0.05)
    lines = []
    for p in left:
        with contextlib.suppress(psutil.Error):
            lines.append(f"{p.pid}: {' '.join(p.cmdline())[:150]}")
    return time.monotonic() - t0, lines


def kill_marked(marker: str) -> None:
    import psutil

    procs = marked(marker)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(procs, timeout=5)


def terminal_signals() -> None:
    """A ``preexec_fn``: SIGINT and SIGQUIT in the child at their defaults, as a terminal's foreground
    job has them. A background job of a non-interactive shell (``cmd &`` in a script, as a CI or a
    benchmark may be launched) starts with SIGINT ignored, every descendant inherits that, and Python
    keeps an ignored SIGINT ignored: without the reset a scenario's Ctrl-C would never be seen."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def ctrl_c(proc: subprocess.Popen[bytes]) -> float:
    """SIGINT to the whole group, as a terminal's Ctrl-C; seconds until the leader exited (killed at
    30 s: ``inf``). Before that kill the leader gets SIGABRT, so that with ``PYTHONFAULTHANDLER=1`` in
    its environment it writes every thread's Python traceback to its stderr: where it hung."""
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGABRT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return float("inf")
    return time.monotonic() - t0
