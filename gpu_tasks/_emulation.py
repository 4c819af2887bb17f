"""Emulated devices when there is no GPU: :func:`ensure_devices`.

Used by ``gpu-tasks run`` / ``serve`` and the benchmarks.
"""

from __future__ import annotations

import os
from typing import Any

from gpu_tasks.devices import discover
from gpu_tasks.settings import get_settings

DEFAULT_EMULATION = "2"
"""``GPU_TASKS_EMULATED_GPUS`` set by :func:`ensure_devices` on a host without a GPU."""


def ensure_devices(announce: Any = print) -> str:
    """Emulate two devices when there is no real GPU and no emulation set; returns the source."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    settings = get_settings()
    if settings.emulated_gpus is None and settings.discovery_command is None:
        inventory = discover(settings)
        if not inventory.devices:
            os.environ["GPU_TASKS_EMULATED_GPUS"] = DEFAULT_EMULATION
            announce(
                f"No GPU found ({inventory.detail}); EMULATING {DEFAULT_EMULATION} devices "
                "(GPU_TASKS_EMULATED_GPUS): the scheduling is real, the compute runs on the CPU "
                "(pandas, XGBoost device=cpu). These are not GPU results."
            )
    return discover().source
