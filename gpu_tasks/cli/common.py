"""What every ``gpu-tasks`` command shares: the Typer app, its consoles, settings and device loading,
and :func:`fail` (the rules all commands follow: :mod:`gpu_tasks.cli`)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.text import Text

from gpu_tasks.devices.discovery import Inventory, discover
from gpu_tasks.errors import DeviceDiscoveryError, EnvironmentProblem, SettingsError
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

PIPED_WIDTH = 240  # columns of output to no terminal


def _width(stream: Any) -> int | None:
    """A console's width where it writes to no terminal (a pipe, a file): wide enough that tables are
    not cut to rich's 80 columns there. None: rich's own (a terminal's width, or COLUMNS)."""
    if "COLUMNS" in os.environ or getattr(stream, "isatty", lambda: False)():
        return None
    return PIPED_WIDTH


# consoles resolve sys.stdout / sys.stderr when they print: test runners that swap them see the output
console = Console(highlight=False, width=_width(sys.stdout))
err_console = Console(stderr=True, highlight=False, width=_width(sys.stderr))


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
    """Exit 2 naming the cause and the fix when Prefect's environment is broken, before anything starts."""
    from gpu_tasks.prefect_api.environment import preflight

    try:
        preflight(command, data_dir)
    except EnvironmentProblem as exc:
        fail(f"gpu-tasks {command}: {exc}")
