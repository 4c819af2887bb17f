"""Prefect's client waits between tries of a refused request (``2**n`` s, no upper bound), capped in
gpu-tasks' processes; why: :mod:`gpu_tasks.compat.api_busy`.
"""

from __future__ import annotations

import inspect
from typing import Any

from gpu_tasks.compat import Use, params
from gpu_tasks.compat.prefect import is_ours

_CAP: dict[str, Any] = {"longest": None, "whole_process": False}  # in force once installed


def cap_client_waits(longest: float, whole_process: bool = False) -> bool:
    """Cap each of Prefect's client waits between tries of a refused request at ``longest`` s (with
    Prefect's jitter) in gpu-tasks' task runs, or in every request of the process with
    ``whole_process`` (a worker process, whose Prefect services run off the task's thread).

    Returns whether the cap is in force (``False`` on a Prefect whose client waits otherwise).
    """
    import prefect.client.base as base

    _CAP["longest"] = longest
    _CAP["whole_process"] = _CAP["whole_process"] or whole_process
    current = getattr(base, "clamped_poisson_interval", None)
    if getattr(current, "_gpu_tasks_capped", False):
        return True  # installed already: the new values above apply
    if not callable(current) or _check_client_waits() is not None:
        return False

    def capped(average_interval: float, clamping_factor: float = 0.3) -> float:
        if _CAP["whole_process"] or is_ours():
            average_interval = min(average_interval, float(_CAP["longest"]))
        return float(current(average_interval, clamping_factor))

    capped._gpu_tasks_capped = True  # type: ignore[attr-defined]  # installed once per process
    capped.__wrapped__ = current  # type: ignore[attr-defined]  # Prefect's, for the feature check
    setattr(base, "clamped_poisson_interval", capped)  # noqa: B010 - a name Prefect does not export
    return True


def _check_client_waits() -> str | None:
    """Prefect's clients still wait ``clamped_poisson_interval(2**n, jitter)`` between tries."""
    import prefect.client.base as base

    fn = getattr(base, "clamped_poisson_interval", None)
    problem = params(getattr(fn, "__wrapped__", fn), "average_interval", "clamping_factor")
    if problem:
        return f"prefect.client.base.clamped_poisson_interval: {problem}"
    for client in ("PrefectHttpxAsyncClient", "PrefectHttpxSyncClient"):
        source = inspect.getsource(getattr(getattr(base, client), "_send_with_retry"))  # noqa: B009
        if "clamped_poisson_interval(" not in source or "2**try_count" not in source:
            return f"{client}._send_with_retry no longer waits clamped_poisson_interval(2**try_count, ...)"
    return None


USES = [
    Use(
        "prefect",
        "prefect.client.base.clamped_poisson_interval",
        "patched",
        "each wait of Prefect's client between tries of a refused request capped at "
        "GPU_TASKS_TUNE_API_LONGEST_WAIT in gpu-tasks' task runs (2**n s otherwise: a device held idle)",
        _check_client_waits,
    ),
]
