"""Imported last in a warm pool's fork server (and only there): the server ends at once when its
flow process is gone, without the interpreter's teardown of the Prefect and distributed it preloaded.
That teardown took 0.94 s of CPU per ended flow process on an idle machine, 5 to 6 s on a loaded one,
while the server outlived its flow (docs/runner.md, "Warm workers"). It runs no task, so none of the
preloaded modules' exit handlers has work there."""

from __future__ import annotations

import atexit
import os

_SERVER_PID = os.getpid()


def _end_now() -> None:
    # registered last, so run first; a process forked from the server (a warm worker) inherits the
    # handler, and runs its own exit handlers (Prefect's send its logs and events)
    if os.getpid() == _SERVER_PID:
        os._exit(0)


atexit.register(_end_now)
