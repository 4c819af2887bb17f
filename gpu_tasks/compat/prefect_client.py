"""Prefect's client waits between tries of a refused request (``2**n`` s, no upper bound), capped."""

from __future__ import annotations

import inspect
from typing import Any

from gpu_tasks.compat import Use, params
from gpu_tasks.compat.prefect import is_ours

_CAP: dict[str, Any] = {"longest": None, "whole_process": False}  # in force once installed


def cap_client_waits(longest: float, whole_process: bool = False) -> bool:
    """Cap Prefect's client waits between tries at ``longest`` s in gpu-tasks' task runs, or in the
    whole process (a worker's Prefect services run off the task's thread); whether the cap is in force."""
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

    capped._gpu_tasks_capped = True  # type: ignore[attr-defined]
    capped.__wrapped__ = current  # type: ignore[attr-defined]  # Prefect's, for the feature check
    setattr(base, "clamped_poisson_interval", capped)  # noqa: B010 - a name Prefect does not export
    return True


def _check_client_waits() -> str | None:
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
