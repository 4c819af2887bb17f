"""dask-gateway's client internals gpu-tasks touches: a closed ``Gateway`` client's ``_loop_runner``."""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any

from gpu_tasks.compat import NotInstalled, Use, code_names, code_strings


def drop_stopped_loop_runner(manager: Any) -> None:
    """Drop a closed cluster manager's stopped ``_loop_runner``, without which ``Gateway.__del__``
    does not close it again on a stopped loop (an "Exception ignored in Gateway.__del__")."""
    client = getattr(manager, "gateway", None)
    runner = getattr(client, "_loop_runner", None)
    is_started = getattr(runner, "is_started", None)
    if client is not None and callable(is_started) and not is_started():
        with contextlib.suppress(AttributeError):
            del client._loop_runner


def _check_loop_runner() -> str | None:
    if importlib.util.find_spec("dask_gateway") is None:
        raise NotInstalled("dask_gateway")
    Gateway: Any = importlib.import_module("dask_gateway").Gateway

    if "_loop_runner" not in code_names(Gateway.__init__):
        return "dask_gateway.Gateway no longer keeps a _loop_runner"
    # __del__ closes only while the client has its _loop_runner: the condition the drop relies on
    if "_loop_runner" not in code_strings(Gateway.__del__):
        return "Gateway.__del__ no longer closes only with a _loop_runner"
    return None


USES = [
    Use(
        "dask-gateway",
        "dask_gateway.Gateway._loop_runner",
        "private",
        "a closed GatewayCluster's client is collected without closing again on a stopped loop "
        "(an error printed at every close otherwise)",
        _check_loop_runner,
        needs="dask_gateway",  # checked once a process uses dask-gateway, never imported for it
    ),
]
