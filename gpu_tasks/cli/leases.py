"""``gpu-tasks leases setup``: an admin makes one lease directory that several Unix users share."""

from __future__ import annotations

import grp
import os
from pathlib import Path
from typing import Annotated

import typer

from gpu_tasks.cli.common import app, fail, load_inventory, load_settings, say
from gpu_tasks.devices import lease_files, presence

leases_app = typer.Typer(
    help="Device lease directories: set one up for several Unix users on this host "
    "(docs/shared-hosts.md, Several users on one host). Who holds each device now: gpu-tasks devices; "
    "who waits for one: gpu-tasks waiters.",
    no_args_is_help=True,
)
app.add_typer(leases_app, name="leases")


@leases_app.command(
    help="Make DIR a lease directory that the members of GROUP share (run once, as root): DIR and its "
    "queue become root:GROUP with mode 3770 (setgid, sticky, group rwx), each of this host's devices gets "
    "a root-owned read-only lock file, and the host-wide presence directory is made root-owned 1777. "
    "Users then set GPU_TASKS_LEASE_DIR=DIR. Safe to run again (a new device, another group)."
)
def setup(
    directory: Annotated[
        Path, typer.Argument(help="The shared lease directory, e.g. /var/lib/gpu-tasks/leases.")
    ],
    group: Annotated[
        str, typer.Option("--group", "-g", help="Unix group of the users who share the devices.")
    ],
    device: Annotated[
        list[str] | None,
        typer.Option(
            "--device",
            "-d",
            help="A device address to make a lock file for (repeat it); default: every device found here.",
        ),
    ] = None,
    mode: Annotated[
        str,
        typer.Option(help="Octal mode of DIR and its queue: 3770; 3775 lets all users read who holds what."),
    ] = "3770",
) -> None:
    settings = load_settings()
    directory = directory.absolute()  # what every user sets, whatever their working directory
    if os.geteuid() != 0:
        fail(
            "gpu-tasks leases setup must run as root (the lock files must belong to root): "
            f"{lease_files.setup_command(directory, group)}"
        )
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        fail(f"--group {group!r}: no such group here (make it with groupadd {group}, then add the users)")
    try:
        bits = int(mode, 8)
    except ValueError:
        fail(f"--mode {mode!r}: an octal mode such as 3770 or 3775")
    addresses = list(device or [d.address for d in load_inventory(settings).devices])
    if directory.parent.exists() and not directory.parent.is_dir():
        fail(f"{str(directory.parent)!r} is a file, not a directory: choose another DIR")
    if not directory.parent.is_dir():
        fail(f"{str(directory.parent)!r} does not exist: make it first (mode 0755), then run this again")
    try:
        done = lease_files.setup(directory, gid, addresses, bits)
        place = presence.directory(settings.presence_dir)
        if place is not None:
            os.chown(place, 0, 0)
            os.chmod(place, 0o1777)
            done.append(f"{place}: presence directory, owner root, mode 1777")
    except ValueError as exc:  # the mode given
        fail(f"--{exc}")
    except lease_files.LeaseFileError as exc:  # the message names the fix
        fail(f"{exc}")
    except OSError as exc:
        fail(f"could not set up {str(directory)!r}: {exc}", code=1)
    for line in done:
        say(line)
    if not addresses:
        say("No devices found: lock files are made by the first user of each device (0444, theirs).")
    say(f"Every user of group {group} sets GPU_TASKS_LEASE_DIR={directory} for their flow runs.")
