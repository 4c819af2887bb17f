"""Emulated devices, only where asked for: ``--emulate`` and the error on a host with no GPU. See
docs/operations.md, "Emulated devices"."""

from __future__ import annotations

import os
from typing import Any

from gpu_tasks.devices.discovery import EMULATION_MEANS, discover, parse_emulated
from gpu_tasks.settings import get_settings

DEFAULT_EMULATION = "2"
"""``GPU_TASKS_EMULATED_GPUS`` set by ``--emulate auto`` on a host without a GPU."""


def no_gpu_hint(command: str | None = None) -> str:
    """What to do about a GPU profile on a host with no GPU; ``command``: one that takes ``--emulate``."""
    option = f"; `{command}` takes --emulate auto" if command else ""
    return (
        f"To run it here on emulated devices (scheduling real, compute on the CPU), set "
        f"GPU_TASKS_EMULATED_GPUS={DEFAULT_EMULATION} in the environment of the process that runs the flow "
        f"(a Prefect worker's environment or the deployment's job_variables env{option}); or set "
        "fallback='cpu' on the profile to run its tasks on the CPU profile"
    )


def ensure_devices(emulate: str | None = "auto", announce: Any = print) -> None:
    """Apply ``--emulate`` (``None``: nothing; ``"auto"``: two devices if none is found or set; else that
    spec) and announce it."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if emulate not in (None, "auto"):
        parse_emulated(emulate)  # a bad spec fails here, naming the option's value
        os.environ["GPU_TASKS_EMULATED_GPUS"] = emulate
        announce(
            f"EMULATING devices {emulate!r} (--emulate, GPU_TASKS_EMULATED_GPUS): {EMULATION_MEANS}. "
            "These are not GPU results."
        )
    elif emulate == "auto":
        settings = get_settings()
        if settings.emulated_gpus is None and settings.discovery_command is None:
            inventory = discover(settings)
            if not inventory.devices:
                os.environ["GPU_TASKS_EMULATED_GPUS"] = DEFAULT_EMULATION
                announce(
                    f"No GPU found ({inventory.detail}); EMULATING {DEFAULT_EMULATION} devices "
                    f"(GPU_TASKS_EMULATED_GPUS): {EMULATION_MEANS}. These are not GPU results."
                )
