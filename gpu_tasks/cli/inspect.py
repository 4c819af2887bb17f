"""``gpu-tasks devices``, ``profiles``, ``deployment-info``, ``waiters``: this host and its profiles."""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any

import typer
from dask.utils import format_bytes
from rich.table import Column, Table
from rich.text import Text

from gpu_tasks.cli.common import (
    app,
    console,
    echo_json,
    err_console,
    fail,
    load_inventory,
    load_settings,
    say,
)
from gpu_tasks.devices import lease_files, leases, presence, programs
from gpu_tasks.devices.discovery import EMULATION_MEANS, Device, Inventory
from gpu_tasks.devices.emulation import DEFAULT_EMULATION
from gpu_tasks.errors import ClusterError, GpuTasksError, ProfileError, UnknownProfileError
from gpu_tasks.policy import (
    device_groups,
    matching_devices,
    max_worker_count,
    memory_slots,
    slots_per_worker,
    unsatisfiable_reason,
)
from gpu_tasks.profiles import (
    DEFAULT_PROFILE,
    KIND_FIELDS,
    ResourceProfile,
    load_profiles_file,
    resolve_profiles,
)
from gpu_tasks.settings import GpuTasksSettings

_RUNS_ON = {"local": "this host", "address": "an existing Dask cluster", "cluster_class": "a cluster manager"}


def _warn_lease_dir(settings: GpuTasksSettings) -> None:
    if (unsafe := lease_files.problem(settings.lease_dir)) is not None:
        err_console.print(Text(f"warning: flow runs would fail here: {unsafe}"), soft_wrap=True)


@app.command(help="Discover this host's GPUs (emulated, discovery command, or NVML) and list them.")
def devices(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    settings = load_settings()
    from gpu_tasks.prefect_api.environment import local_problems

    for problem in local_problems():  # nothing here needs Prefect: list the devices all the same
        err_console.print(Text(f"warning: a flow run here would stop at once: {problem}"), soft_wrap=True)
    _warn_lease_dir(settings)
    inventory = load_inventory(settings)
    held = lease_holders(inventory, settings)
    unread = sorted({info["error"] for info in held.values() if info is not None and "error" in info})
    for error in unread:  # shown as "unknown"
        err_console.print(Text(f"warning: {error}: who holds the devices is unknown"), soft_wrap=True)
    queued = lease_waiters(settings)
    others = programs.sample(inventory.devices, settings.lease_dir)  # programs outside gpu-tasks
    if as_json:
        data: dict[str, Any] = {
            "source": inventory.source,
            "emulated": inventory.emulated,
            "detail": inventory.detail,
            "devices": [device_json(d, held[d.address], others.get(d.address)) for d in inventory.devices],
            "waiters": queued,
        }
        if inventory.devices:  # how they are wired, as `nvidia-smi topo -m` (gpu_tasks.devices.topology)
            data["topology"] = inventory.wiring.as_json()
        echo_json(data)
        return
    if inventory.devices:
        address = Column("Address", overflow="fold")  # MIG addresses are long UUIDs: keep them whole
        plain = ("Memory total", "Memory free", "Compute capability", "MIG", "Emulated")
        folded = (Column("Held by", overflow="fold"), Column("Other programs", overflow="fold"))
        table = Table(address, Column("Name", no_wrap=True), *plain, *folded, title="Devices")
        for dev in inventory.devices:
            use = others[dev.address]
            table.add_row(
                Text(dev.address),
                Text(dev.name),
                size(dev.memory_total, "unknown"),
                size(use.free if use.free is not None else dev.memory_free, "unknown"),
                dev.compute_capability or "-",
                "yes" if dev.mig else "no",
                "yes" if dev.emulated else "no",
                Text(held_by_text(held[dev.address])),
                other_programs_text(use, settings),
            )
        console.print(table)
        _wiring(inventory)
    elif inventory.emulated:  # GPU_TASKS_EMULATED_GPUS=0
        say(
            f"No devices: {inventory.detail} emulates none and hides this host's GPUs, so GPU profiles "
            "cannot run here. Unset it to use this host's GPUs, or set "
            f"GPU_TASKS_EMULATED_GPUS={DEFAULT_EMULATION} to emulate {DEFAULT_EMULATION} devices."
        )
    else:
        say(
            "No devices: GPU profiles cannot run here. To try flows here anyway, set "
            f"GPU_TASKS_EMULATED_GPUS={DEFAULT_EMULATION} ({EMULATION_MEANS}), or set fallback='cpu' on a "
            "profile to run its tasks on the CPU profile."
        )
    if queued:
        console.print(waiters_table(queued))
    if any(info and info.get("elsewhere") for info in held.values()):
        say(
            "Devices held by other users' flow runs, in lease directories this user does not share: flow "
            f"runs of this user leave them alone; {presence.HINT}.",
            style="yellow",
        )
    say(source_line(inventory))


def _wiring(inventory: Inventory) -> None:
    """How the devices are wired, as ``nvidia-smi topo -m`` shows it (or why that is unknown)."""
    wiring = inventory.wiring
    if len(inventory.devices) < 2 and not wiring.known:
        return
    if not wiring.known:
        say(f"Wiring: {wiring.source}.", style="dim")
        return
    gpus = [Column(f"GPU{address}", overflow="fold") for address in wiring.addresses]
    table = Table("", *gpus, "CPU Affinity", "NUMA Affinity", title=f"Wiring ({wiring.source})")
    for i, address in enumerate(wiring.addresses):
        numa = wiring.numa[i]
        table.add_row(
            f"GPU{address}", *wiring.matrix[i], wiring.cpus[i] or "-", "-" if numa is None else str(numa)
        )
    console.print(table)
    say(
        "NV<n>: n NVLinks; PIX: one PCIe switch; PXB: several PCIe switches; PHB: a PCIe host bridge; "
        "NODE: within one NUMA node; SYS: across NUMA nodes (sockets); ?: unknown",
        style="dim",
    )


def _profile_fit(prof: ResourceProfile, inventory: Inventory, lease_dir: Path) -> dict[str, Any]:
    """Which devices ``prof`` may use on ``inventory``, and why it can never run if so (a remote
    profile's workers are checked when its first task runs). A ``gpu_memory_per_task`` profile's
    tasks at once are per device (``tasks_per_device``), from what other programs leave free now, as
    a worker's are at its lease; ``tasks_per_worker`` is then ``None``."""
    if not prof.is_local:
        return {
            "can_run": None,
            "reason": None,
            "matching_devices": [],
            "workers": prof.max_workers,
            "tasks_per_worker": slots_per_worker(prof) if prof.is_gpu else None,
        }
    reason = unsatisfiable_reason(prof, inventory)
    matching = matching_devices(prof, inventory) if prof.is_gpu else []
    groups = device_groups(prof, matching) if reason is None else []
    fit: dict[str, Any] = {
        "can_run": reason is None,
        "reason": reason,
        "matching_devices": [d.address for d in matching],
        "workers": max_worker_count(prof, len(groups)),
        "tasks_per_worker": slots_per_worker(prof),
    }
    if prof.by_memory:  # it showed 1 for each, though an 80 GiB device runs four of 20 GiB (a new-user pass)
        use = programs.sample(tuple(matching), lease_dir)
        fit["tasks_per_worker"] = None
        fit["tasks_per_device"] = {
            d.address: memory_slots(prof, d, u.free if (u := use.get(d.address)) is not None else None)
            for d in matching
        }
    return fit


def _uses_text(prof: ResourceProfile, place: dict[str, Any]) -> str:
    if prof.address is not None:
        return f"workers of the Dask cluster at {prof.address} (checked when its first task runs)"
    if prof.cluster_class is not None:
        return f"workers that {prof.cluster_class} starts, up to {prof.max_workers}"
    if not prof.is_gpu:
        workers, slots = place["workers"], place["tasks_per_worker"]
        return f"CPU only (no devices): {workers} worker(s), {slots} task(s) at once each"
    if not place["can_run"]:
        fallback = "; falls back to the CPU profile" if prof.fallback == "cpu" else ""
        return f"CANNOT RUN{fallback} (see below)"
    per_worker = f"{prof.gpus:g} of " if prof.gpus > 1 else ""  # a group the runner picks (topology)
    at_once = (
        f"{place['tasks_per_worker']} task(s) each"
        if place["tasks_per_worker"] is not None
        else "task(s) at once by gpu_memory_per_task and the memory free now: "
        + ", ".join(f"{n} on {address}" for address, n in place["tasks_per_device"].items())
    )
    return (
        f"{per_worker}devices {', '.join(place['matching_devices'])}: up to {place['workers']} worker(s), "
        f"{at_once}"
    )


def _profile_row_values(prof: ResourceProfile, idle_default: float) -> list[tuple[str, str]]:
    max_unset = "no cap (one worker per device group)" if prof.is_gpu else "unset (one worker)"
    idle = (
        f"{prof.idle_timeout:g}s"
        if prof.idle_timeout is not None
        else f"{idle_default:g}s (GPU_TASKS_IDLE_TIMEOUT)"
    )
    rows = [
        ("kind", prof.kind),
        ("tag", prof.tag),
        ("cpus", f"{prof.cpus:g}"),
        ("gpus", "a device per worker, shared by memory" if prof.by_memory else f"{prof.gpus:g}"),
        ("memory", size(prof.memory, "Dask default")),
        ("gpu_model", prof.gpu_model or "any"),
        ("gpu_memory_total", size(prof.gpu_memory_total, "any")),
        ("gpu_memory_free", size(prof.gpu_memory_free, "not checked")),
        ("max_workers", str(prof.max_workers) if prof.max_workers is not None else max_unset),
        ("idle_timeout", idle),
        ("fallback", prof.fallback),
        ("gang", "yes" if prof.gang else "no"),
        ("runs on", _RUNS_ON[prof.kind]),
    ] + [  # set only: what a placement here also depends on
        (field, str(value))
        for field, value in (
            ("gpu_memory_per_task", prof.gpu_memory_per_task and size(prof.gpu_memory_per_task, "")),
            ("on_oom", prof.on_oom),
            ("preemptible", "yes" if prof.preemptible else None),
            ("quota", prof.quota),
        )
        if value
    ]
    # a field another kind of profile takes means nothing here (an address profile has no fallback)
    return [(f, value) for f, value in rows if f not in KIND_FIELDS or prof.kind in KIND_FIELDS[f][0]]


@app.command(
    help="Show resource profiles (--file or GPU_TASKS_PROFILES_FILE) and which devices each may use."
)
def profiles(
    file: Annotated[
        Path | None,
        typer.Option("--file", "-f", help="TOML profiles file (default: GPU_TASKS_PROFILES_FILE)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
) -> None:
    settings = load_settings()
    path, origin = (
        (file, "--file") if file is not None else (settings.profiles_file, "GPU_TASKS_PROFILES_FILE")
    )
    try:
        loaded, default = resolve_profiles(path=path, origin=origin)
    except (ProfileError, UnknownProfileError) as exc:
        fail(str(exc))
    inventory = load_inventory(settings)
    placements = {name: _profile_fit(prof, inventory, settings.lease_dir) for name, prof in loaded.items()}
    if as_json:
        echo_json(
            {
                "file": str(path) if path is not None else None,
                "default": default,
                "devices": {
                    "source": inventory.source,
                    "emulated": inventory.emulated,
                    "detail": inventory.detail,
                    "addresses": [d.address for d in inventory.devices],
                },
                "profiles": [
                    {
                        **prof.model_dump(mode="json"),
                        "kind": prof.kind,
                        "tag": prof.tag,
                        "default": name == default,
                        **placements[name],
                    }
                    for name, prof in loaded.items()
                ],
            }
        )
        return
    if path is None:
        say(
            "No profiles file set (--file or GPU_TASKS_PROFILES_FILE): showing the built-in default "
            f"CPU profile {DEFAULT_PROFILE!r}."
        )
    else:
        say(f"Profiles from {path}")
    for name, prof in loaded.items():
        title = f"{name} (default for untagged tasks)" if name == default else name
        table = Table(title=Text(title), show_header=False, title_justify="left")
        table.add_column("field", style="bold")
        table.add_column("value")
        for field, value in _profile_row_values(prof, settings.idle_timeout):
            table.add_row(field, Text(value))
        table.add_row("uses", Text(_uses_text(prof, placements[name])))
        console.print(table)
        reason = placements[name]["reason"]
        if reason is not None:
            say(f"CANNOT RUN {name!r} here: {reason}", style="red")
    say(source_line(inventory))


@app.command(
    "deployment-info",
    help="Description and tags for a deployment of a flow, from its profiles (for prefect.yaml or serve).",
)
def deployment_info_command(
    entrypoint: Annotated[
        str, typer.Argument(help="The flow: path/to/file.py:flow_name or package.module:flow_name.")
    ],
    file: Annotated[
        Path | None,
        typer.Option(
            "--profiles-file",
            "-f",
            help="The deployment's GPU_TASKS_PROFILES_FILE (default: this environment's).",
        ),
    ] = None,
    summary: Annotated[
        str | None, typer.Option(help="First sentence of the description (default: the flow's docstring).")
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print JSON instead of prefect.yaml lines.")
    ] = False,
) -> None:
    from gpu_tasks.deployments import deployment_info

    load_settings()
    if file is not None:
        try:
            load_profiles_file(file, "--profiles-file")
        except GpuTasksError as exc:
            fail(str(exc))
        # the flow's module builds its runner, which reads GPU_TASKS_PROFILES_FILE: the deployment's
        os.environ["GPU_TASKS_PROFILES_FILE"] = str(file.resolve())
    try:
        from prefect.exceptions import ScriptError
        from prefect.flows import load_flow_from_entrypoint

        flow: Any = load_flow_from_entrypoint(entrypoint, use_placeholder_flow=False)
    except Exception as exc:
        if isinstance(exc, ScriptError):  # the script raised as it was imported: that error, not Prefect's
            raised = exc.user_exc
            fail(f"cannot load flow {entrypoint!r}: importing it raised {type(raised).__name__}: {raised}")
        fail(f"cannot load flow {entrypoint!r}: {exc} (use path/to/file.py:flow_name or module:flow_name)")
    try:
        info = deployment_info(flow, profiles_file=file, summary=summary)
    except GpuTasksError as exc:
        fail(str(exc))
    if as_json:
        echo_json({"description": info.description, "tags": info.tags, "gpus": info.gpus})
        return
    typer.echo(f"description: {json.dumps(info.description)}")
    typer.echo(f"tags: [{', '.join(info.tags)}]")


def _scheduler_board(address: str, timeout: float) -> list[dict[str, Any]]:
    """The waiter board of the shared scheduler at ``address``, or exit 2 naming the address."""
    from distributed import Client

    from gpu_tasks.cluster.address import scheduler_unreachable, ucx_missing
    from gpu_tasks.cluster.board import BOARD, effective_priority
    from gpu_tasks.cluster.remote import security_for
    from gpu_tasks.devices.wait_reasons import board_reason

    name = "waiters"
    try:
        shared = ResourceProfile(name=name, address=address)
    except ProfileError as exc:
        fail(str(exc).removeprefix(f"profile {name!r}: "))  # "address must be ...; got '...'"
    assert shared.address is not None
    # at once when nothing listens there (TCP), rather than wait out Dask's connect retries
    if (why := scheduler_unreachable(shared.address, 0, connect_timeout=timeout)) is not None:
        fail(f"address {address!r}: {why}; check the address, and that the scheduler runs and is reachable")
    if (why := ucx_missing(shared.address)) is not None:  # ucx, ucxx
        fail(f"address {address!r}: {why}")
    try:
        security = security_for(shared) if shared.address.startswith("tls://") else None
    except ClusterError as exc:
        fail(str(exc).removeprefix(f"profile {name!r}: "))

    # one deadline for it all: Dask's timeout= bounds the connect, not a handshake that never comes
    async def read() -> Any:
        client = Client(
            shared.address, security=security, timeout=timeout, asynchronous=True, set_as_default=False
        )
        try:
            await asyncio.wait_for(client, timeout)
            return await asyncio.wait_for(client.get_metadata([BOARD], default=None), timeout)
        finally:
            await client.close(timeout=timeout)

    try:
        board = asyncio.run(read()) or {}
    except TimeoutError:
        fail(
            f"address {address!r}: no Dask scheduler answered within {timeout:g} s (--timeout); something "
            "accepts connections there: check that it is a scheduler's address"
        )
    except Exception as exc:
        fail(
            f"address {address!r}: no Dask scheduler answered ({type(exc).__name__}: {exc}); check that it "
            "is a scheduler's address"
        )
    rows = [
        dict(entry, token=token, effective_priority=effective_priority(entry))
        for token, entry in sorted(board.items())
        if isinstance(entry, dict)
    ]
    return [dict(row, why=board_reason(row, rows).as_dict()) for row in rows]


def _board_table(address: str, rows: list[dict[str, Any]]) -> Table:
    columns = ("Profile", "Flow run", "Process", "Priority", "Effective", "Waited", "Queued", "Workers")
    cells = (
        (
            Text(str(row.get("profile"))),
            Text(str(row.get("flow_run_name") or "-")),
            Text(f"{row.get('hostname') or '?'}:{row.get('pid') or '?'}"),
            str(int(row.get("priority") or 0)),
            str(row["effective_priority"]),
            f"{float(row.get('waited_s') or 0):.1f}s",
            str(row.get("queued") or 0),
            Text(", ".join(row.get("workers") or ()) or "-"),
            _why_text(row),
        )
        for row in rows
    )
    return _table(f"Waiters on {address} (as of their last beat)", (*columns, "Waits for"), cells)


@app.command(
    help="List who waits for devices: this host's flow runs queued for its devices (GPU_TASKS_LEASE_DIR's "
    "queue), and with ADDRESS the waiter board of a shared Dask scheduler (address profiles whose tasks "
    "wait there: priority, aging, preemption; docs/distributed.md)."
)
def waiters(
    address: Annotated[
        str | None,
        typer.Argument(help="A shared scheduler, as in an address profile: tcp://host:8786 (optional)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the scheduler.")] = 10.0,
) -> None:
    settings = load_settings()
    if not (math.isfinite(timeout) and timeout > 0):
        fail(f"--timeout must be a number of seconds more than 0, got {timeout:g}")
    _warn_lease_dir(settings)
    here = lease_waiters(settings)
    board = _scheduler_board(address, timeout) if address is not None else []
    if as_json:
        echo_json(
            {"lease_dir": str(settings.lease_dir), "this_host": here, "address": address, "waiters": board}
        )
        return
    if here:
        console.print(waiters_table(here))
    else:
        say(f"No flow run on this host waits for devices (queue in {settings.lease_dir}).")
    if address is None:
        return
    if board:
        console.print(_board_table(address, board))
    else:
        say(f"No waiters on {address}: no task of an address profile has waited past its aging or grace.")


def size(value: int | None, unset: str = "-") -> str:
    return format_bytes(value) if value else unset


def source_line(inventory: Inventory) -> Text:
    """Where the devices came from, in words."""
    if inventory.source == "emulated" and not inventory.devices:
        return Text(f"Source: 0 emulated devices ({inventory.detail}); real GPUs are not looked for")
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
        if others.free is not None:  # the memory free now, from the sample, as the table shows it
            out["memory_free"] = others.free
    return out


def other_programs_text(use: programs.DeviceUse, settings: GpuTasksSettings) -> Text:
    """``none``, the programs (bold red when they keep gpu-tasks off the device), or why not sampled."""
    if not use.source:
        return Text(use.note, style="dim")
    text = use.describe()
    if programs.blocked(use, settings.other_programs_memory):
        limit = settings.other_programs_memory
        rule = (
            f"more than GPU_TASKS_OTHER_PROGRAMS_MEMORY ({size(limit)})"
            if limit
            else "no other program may use it (GPU_TASKS_OTHER_PROGRAMS_MEMORY=0)"
        )
        return Text(f"{text}: {rule}, gpu-tasks does not lease it", style="bold red")
    return Text(text)


def lease_holders(inventory: Inventory, settings: GpuTasksSettings) -> dict[str, dict[str, Any] | None]:
    """Who leases each device now (GPU_TASKS_LEASE_DIR); ``{"error": ...}`` when unreadable."""
    addresses = [d.address for d in inventory.devices]
    try:
        return leases.holders(settings.lease_dir, addresses)
    except OSError as exc:
        return dict.fromkeys(addresses, {"error": f"cannot read leases in {settings.lease_dir}: {exc}"})


def lease_waiters(settings: GpuTasksSettings) -> list[dict[str, Any]]:
    """The profiles queued for this host's devices, first-ranked first; ``[]`` if unreadable."""
    now = time.time()
    try:
        queued = leases.waiters(settings.lease_dir)
    except FileNotFoundError:  # made at the first wait
        return []
    except OSError as exc:  # said, not taken for an empty queue
        err_console.print(
            Text(f"warning: cannot read the queue in {settings.lease_dir}: {exc}: its waiters are not shown"),
            soft_wrap=True,
        )
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
    columns = ("Profile", "Flow run", "Pid", "Priority", "Effective", "Waited", "Devices", "Waits for")
    rows = (
        (
            Text(str(w.get("profile") or "-")),
            Text(str(w.get("flow_run_name") or "-")),
            str(w.get("pid", "?")),
            str(w.get("priority", 0)),
            str(w["effective_priority"]),
            f"{w['waited_s']:.1f}s",
            Text(",".join(w.get("addresses") or ()) or "-"),
            _why_text(w),
        )
        for w in queued
    )
    return _table("Waiting for devices on this host (first-ranked first)", columns, rows)


def _table(title: str, columns: tuple[str, ...], rows: Iterable[tuple[str | Text, ...]]) -> Table:
    table = Table(title=title)
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table


def _why_text(waiter: dict[str, Any]) -> Text:
    return Text(str((waiter.get("why") or {}).get("text") or "-"))


def held_by_text(info: dict[str, Any] | None) -> str:
    if info is not None and "error" in info:
        return "unknown"
    return leases.describe(info, with_id=False, hint=False)
