"""The ``gpu-tasks`` command line: devices, profiles, waiters, leases and quotas; the example pipeline
apart, under ``gpu-tasks example``.

Every command follows the same rules:

* errors that are the user's to fix (a bad ``GPU_TASKS_*`` value, a bad profiles
  file) print one message on stderr and exit with code 2 through :func:`fail`,
  never a traceback;
* ``--json`` prints machine-readable output on stdout and nothing else;
* emulated devices are always called out as such.

To add a command, write a function decorated with ``@app.command(help=...)`` below
the existing ones, read settings with :func:`settings` and devices with
:func:`inventory`, and report user errors with :func:`fail`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, NoReturn

import typer
from dask.utils import format_bytes
from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpu_tasks.devices import leases, programs
from gpu_tasks.devices.discovery import EMULATION_MEANS, Device, Inventory, discover
from gpu_tasks.errors import DeviceDiscoveryError, SettingsError
from gpu_tasks.settings import GpuTasksSettings, get_settings, variable_warnings

EXIT_USAGE = 2

app = typer.Typer(
    name="gpu-tasks",
    help="GPU-aware Prefect task runner: inspect this host's devices, resource profiles and who waits for "
    "devices; set up shared lease directories and team quotas. The example ETL -> train pipeline is under "
    "`gpu-tasks example`.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Consoles resolve sys.stdout / sys.stderr when they print, so test runners that
# swap the streams see the output.
console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)


@app.callback()
def _root() -> None:
    """GPU-aware Prefect task runner: inspect devices and resource profiles."""


# ------------------------------------------------------------------- helpers
def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """Print ``message`` on stderr (no markup, no traceback) and exit with ``code``."""
    err_console.print(Text(f"error: {message}"), soft_wrap=True)
    raise typer.Exit(code=code)


def say(message: str | Text, style: str | None = None) -> None:
    """Print one line on stdout without markup parsing and without hard wrapping."""
    text = message if isinstance(message, Text) else Text(message, style=style or "")
    console.print(text, soft_wrap=True)


def echo_json(data: Any) -> None:
    """Print ``data`` as JSON on stdout (plain, so it always parses)."""
    typer.echo(json.dumps(data, indent=2, default=str))


def load_settings() -> GpuTasksSettings:
    """The ``GPU_TASKS_*`` settings, or exit 2 naming the bad variable."""
    try:
        settings = get_settings()
    except SettingsError as exc:
        fail(str(exc))
    for line in variable_warnings():
        typer.echo(f"warning: {line}", err=True)
    return settings


def load_inventory(settings: GpuTasksSettings) -> Inventory:
    """Discover devices, or exit 2 with the discovery error."""
    try:
        return discover(settings)
    except DeviceDiscoveryError as exc:
        fail(str(exc))


def preflight(command: str, data_dir: Path | None = None) -> None:
    """Exit 2 with one line naming the cause and the fix when Prefect's environment is broken
    (PREFECT_HOME, its database, a full disk, PREFECT_API_URL), before anything starts."""
    from gpu_tasks.errors import EnvironmentProblem
    from gpu_tasks.prefect_api.environment import preflight

    try:
        preflight(command, data_dir)
    except EnvironmentProblem as exc:
        fail(f"gpu-tasks {command}: {exc}")


def size(value: int | None, unset: str = "-") -> str:
    return format_bytes(value) if value else unset


def source_line(inventory: Inventory) -> Text:
    """Where the devices came from, in words."""
    if inventory.source == "emulated":
        return Text(f"EMULATED devices: {EMULATION_MEANS} ({inventory.detail})", style="bold yellow")
    if inventory.source == "command":
        return Text(f"Source: discovery command (GPU_TASKS_DISCOVERY_COMMAND): {inventory.detail}")
    if inventory.source == "nvml":
        return Text(f"Source: NVML ({inventory.detail})")
    return Text(f"Source: none, no GPUs found ({inventory.detail or 'no discovery source'})")


def device_json(
    device: Device, held_by: dict[str, Any] | None = None, others: programs.DeviceUse | None = None
) -> dict[str, Any]:
    out = {**device.model_dump(), "held_by": held_by}
    if others is not None:
        out["other_programs"] = others.as_dict()
    return out


def other_programs(inventory: Inventory, settings: GpuTasksSettings) -> dict[str, programs.DeviceUse]:
    """What programs outside gpu-tasks use on each device now (gpu_tasks.devices.programs)."""
    return programs.sample(inventory.devices, settings.lease_dir)


def other_programs_text(use: programs.DeviceUse, settings: GpuTasksSettings) -> Text:
    """``none``, the programs (bold red when they keep gpu-tasks off the device), or why not sampled."""
    if not use.source:
        return Text(use.note, style="dim")
    text = use.describe()
    if programs.blocked(use, settings.other_programs_memory):
        limit = size(settings.other_programs_memory, "0")
        return Text(
            f"{text}: more than GPU_TASKS_OTHER_PROGRAMS_MEMORY ({limit}), gpu-tasks does not lease it",
            style="bold red",
        )
    return Text(text)


def lease_holders(inventory: Inventory, settings: GpuTasksSettings) -> dict[str, dict[str, Any] | None]:
    """Who leases each device now (GPU_TASKS_LEASE_DIR); ``{"error": ...}`` when unreadable."""
    addresses = [d.address for d in inventory.devices]
    try:
        return leases.holders(settings.lease_dir, addresses)
    except OSError as exc:
        return dict.fromkeys(addresses, {"error": f"cannot read leases in {settings.lease_dir}: {exc}"})


def lease_waiters(settings: GpuTasksSettings) -> list[dict[str, Any]]:
    """The profiles queued for this host's devices (GPU_TASKS_LEASE_DIR), first-ranked first, each
    with its ``effective_priority`` and ``waited_s`` now and ``why`` it waits (as the waiter last wrote
    it, :mod:`gpu_tasks.devices.wait_reasons`; ``None`` before it did); ``[]`` when the queue cannot
    be read."""
    now = time.time()
    try:
        queued = leases.waiters(settings.lease_dir)
    except OSError:
        return []
    return [
        {
            **w,
            "effective_priority": leases.effective_priority(w, now),
            "waited_s": round(max(0.0, now - float(w.get("arrived", now))), 1),
            "why": leases.read_why(settings.lease_dir, str(w.get("file"))),
        }
        for w in queued
    ]


def waiters_table(queued: list[dict[str, Any]]) -> Table:
    table = Table(title="Waiting for devices on this host (first-ranked first)")
    for column in ("Profile", "Flow run", "Pid", "Priority", "Effective", "Waited", "Devices", "Waits for"):
        table.add_column(column, overflow="fold")
    for w in queued:
        table.add_row(
            Text(str(w.get("profile") or "-")),
            Text(str(w.get("flow_run_name") or "-")),
            str(w.get("pid", "?")),
            str(w.get("priority", 0)),
            str(w["effective_priority"]),
            f"{w['waited_s']:.1f}s",
            Text(",".join(w.get("addresses") or ()) or "-"),
            Text(str((w.get("why") or {}).get("text") or "-")),
        )
    return table


def held_by_text(info: dict[str, Any] | None) -> str:
    if info is not None and "error" in info:
        return "unknown"
    return leases.describe(info, with_id=False, hint=False)
