"""Emulated devices, only where asked for: :func:`ensure_devices`, :func:`no_gpu_hint`.

The rule, the same for a plain script, a Prefect worker's flow run and the example's
``gpu-tasks example run`` / ``serve``: devices are emulated only where ``GPU_TASKS_EMULATED_GPUS``
is set in the environment of the process that runs the flow. ``--emulate`` on the example's
commands sets it for that command (and the flow runs it starts); ``--emulate auto`` only where no
GPU is found. Without it a GPU profile on a host with no GPU fails with
:class:`~gpu_tasks.errors.UnsatisfiableProfileError`, whose message says how to emulate or to fall
back to the CPU (:func:`no_gpu_hint`). What emulation means for a flow is
:data:`gpu_tasks.devices.discovery.EMULATION_MEANS`; the example adds its own note on what its
stages compute with. Used by the example's commands and the benchmarks."""

from __future__ import annotations

import os
from typing import Any

from gpu_tasks.devices.discovery import EMULATION_MEANS, discover, parse_emulated
from gpu_tasks.settings import get_settings

DEFAULT_EMULATION = "2"
"""``GPU_TASKS_EMULATED_GPUS`` set by ``--emulate auto`` on a host without a GPU."""


def no_gpu_hint(command: str | None = None) -> str:
    """What to do about a GPU profile on a host with no GPU (appended to the error); ``command``, a
    CLI command that takes ``--emulate`` (``gpu-tasks example run``), is named beside the setting."""
    option = f"; `{command}` takes --emulate auto" if command else ""
    return (
        f"To run it here on emulated devices (scheduling real, compute on the CPU), set "
        f"GPU_TASKS_EMULATED_GPUS={DEFAULT_EMULATION} in the environment of the process that runs the flow "
        f"(a Prefect worker's environment or the deployment's job_variables env{option}); or set "
        "fallback='cpu' on the profile to run its tasks on the CPU profile"
    )


def ensure_devices(emulate: str | None = "auto", announce: Any = print) -> str:
    """Apply ``--emulate``: ``None`` leaves the environment as it is; ``"auto"`` emulates two
    devices when there is no real GPU and neither emulation nor a discovery command is set; a
    count or ``"NAME:MEMORY,..."`` emulates those devices. Announced; returns the device source."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if emulate is None:
        return discover().source
    if emulate != "auto":
        parse_emulated(emulate)  # a bad spec fails here, naming the option's value
        os.environ["GPU_TASKS_EMULATED_GPUS"] = emulate
        announce(
            f"EMULATING devices {emulate!r} (--emulate, GPU_TASKS_EMULATED_GPUS): {EMULATION_MEANS}. "
            "These are not GPU results."
        )
        return discover().source
    settings = get_settings()
    if settings.emulated_gpus is None and settings.discovery_command is None:
        inventory = discover(settings)
        if not inventory.devices:
            os.environ["GPU_TASKS_EMULATED_GPUS"] = DEFAULT_EMULATION
            announce(
                f"No GPU found ({inventory.detail}); EMULATING {DEFAULT_EMULATION} devices "
                f"(GPU_TASKS_EMULATED_GPUS): {EMULATION_MEANS}. These are not GPU results."
            )
    return discover().source
