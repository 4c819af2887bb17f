"""Settings from ``GPU_TASKS_<NAME>`` (user) and ``GPU_TASKS_TUNE_<NAME>`` (tuning; the old name still
read, with a warning) environment variables; ``_GPU_TASKS_*`` are the runner's own, never reported."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

from gpu_tasks.errors import SettingsError

PREFIX = "GPU_TASKS_"
TUNE_PREFIX = "GPU_TASKS_TUNE_"
INTERNAL_PREFIX = "_GPU_TASKS_"  # set by the runner for its own worker processes, never by users


def default_presence_dir() -> Path:
    """Host-wide directory where flow runs of every user say which devices they hold: in ``/tmp``, not
    the temporary directory ``TMPDIR`` names, which is per user where pam_tmpdir or a batch job sets
    it (two users' tasks then ran on one device unseen: a new-user pass)."""
    host_tmp = Path("/tmp")
    return (host_tmp if os.name == "posix" and host_tmp.is_dir() else Path(tempfile.gettempdir())) / (
        "gpu-tasks-presence"
    )


def _doc(shown: str | None = None, takes: str | None = None, see: str | None = None) -> dict[str, Any]:
    """What docs/profiles.md's settings tables show beyond the field."""
    return {k: v for k, v in {"shown": shown, "takes": takes, "see": see}.items() if v is not None}


def _tune(
    name: str, default: Any, description: str, *, see: str, takes: str | None = None, **rules: Any
) -> Any:
    """A tuning knob: read from ``GPU_TASKS_TUNE_<NAME>``, else from its old name."""
    var = name.upper()
    return Field(
        default,
        description=description,
        validation_alias=AliasChoices(TUNE_PREFIX + var, PREFIX + var),
        json_schema_extra={"tuning": True, **_doc(takes=takes, see=see)},
        **rules,
    )


class GpuTasksSettings(BaseSettings):
    """Process-wide settings: field ``<f>`` is ``GPU_TASKS_<F>`` (user setting) or ``GPU_TASKS_TUNE_<F>``."""

    # frozen: get_settings hands the same object to every caller until a variable changes
    # no setting means "forever" by inf: a float one that was given inf or nan failed later, in a wait
    # (GPU_TASKS_PROVISION_TIMEOUT=inf: every worker start, OverflowError)
    model_config = SettingsConfigDict(
        env_prefix=PREFIX, extra="ignore", populate_by_name=True, frozen=True, allow_inf_nan=False
    )

    # ---- user settings (docs/profiles.md, first table)
    profiles_file: Path | None = Field(
        default=None,
        description="TOML file of `[profiles.<name>]` tables; its profiles replace the code's of the same "
        "name.",
        json_schema_extra=_doc(takes="path (empty: unset)", see="#profiles-from-a-toml-file"),
    )
    idle_timeout: float = Field(
        default=60.0,
        ge=0,
        description="Seconds a profile's cluster may sit idle before it is closed.",
        json_schema_extra=_doc(see="#where-a-profiles-values-come-from"),
    )
    emulated_gpus: str | None = Field(
        default=None,
        description='Emulate devices: a count ("4") or "NAME:MEMORY,..." ("H100:80GiB,L4:24GiB"), '
        'optionally wired ("8*H100:80GiB/nvswitch").',
        json_schema_extra=_doc(
            takes="a count, or [N*]NAME[:MEMORY][@PID:MEMORY] items; then optionally /SHAPE", see="#devices"
        ),
    )
    discovery_command: str | None = Field(
        default=None,
        description='Command (run without a shell) printing `{"name": "gpu", "addresses": [...]}`, '
        "used instead of NVML.",
        json_schema_extra=_doc(takes="command line", see="#devices"),
    )
    provision_timeout: float = Field(
        default=120.0, gt=0, description="Seconds to wait for a profile's workers to start."
    )
    dashboard: bool = Field(default=False, description="Start a Dask dashboard (127.0.0.1) per cluster.")
    lease_dir: Path = Field(
        default_factory=lambda: Path(tempfile.gettempdir()) / f"gpu-tasks-leases-{os.getuid()}",
        description="Directory of per-device lease files; flow runs that share it never put workers on "
        "the same device at once. For several Unix users: one made by `gpu-tasks leases setup`.",
        json_schema_extra=_doc(
            shown="<tmp>/gpu-tasks-leases-<uid>",
            takes="path",
            see="shared-hosts.md#several-users-on-one-host",
        ),
    )
    presence_dir: Path = Field(
        default_factory=default_presence_dir,
        description="Host-wide directory (sticky, world-writable) in which flow runs of every user mark "
        "the devices they lease, so no run uses a device another user's run leases.",
        json_schema_extra=_doc(
            shown="/tmp/gpu-tasks-presence",
            takes="path",
            see="shared-hosts.md#the-per-user-default-other-users-are-seen-not-queued-with",
        ),
    )
    lease_timeout: float = Field(
        default=600.0,
        ge=0,
        description="Seconds a profile waits for devices that other flow runs (or programs outside "
        "gpu-tasks) hold before failing.",
        json_schema_extra=_doc(see="leases.md"),
    )
    other_programs_memory: int = Field(
        default=2**30,
        ge=0,
        description="Device memory that programs outside gpu-tasks may use on a device before gpu-tasks "
        "stops leasing it, sampled before each lease. 0: any use keeps the device from gpu-tasks.",
        json_schema_extra=_doc(
            shown="1GiB",
            takes="a size (512MiB, 2GiB) or bytes, >= 0",
            see="shared-hosts.md#programs-outside-gpu-tasks",
        ),
    )
    priority: int | None = Field(
        default=None,
        description="Priority this flow run's GPU profiles wait for devices at, replacing each profile's "
        "own (set it per deployment or flow run in the job variable env).",
        json_schema_extra=_doc(see="leases.md#priority-per-flow-run"),
    )
    tls_ca_file: Path | None = Field(
        default=None,
        description="CA certificate (PEM) for tls:// scheduler addresses of profiles that set no security.",
        json_schema_extra=_doc(takes="path", see="distributed.md#tls"),
    )
    tls_cert: Path | None = Field(
        default=None,
        description="Client certificate (PEM) for tls:// addresses.",
        json_schema_extra=_doc(takes="path", see="distributed.md#tls"),
    )
    tls_key: Path | None = Field(
        default=None,
        description="Client private key (PEM) for tls:// addresses.",
        json_schema_extra=_doc(takes="path", see="distributed.md#tls"),
    )

    # ---- tuning knobs, GPU_TASKS_TUNE_* (docs/profiles.md, second table)
    warm_workers: int = _tune(
        "warm_workers",
        2,
        "Worker processes kept started and imported, holding no device, that a lease binds so a first "
        "task does not wait for a process to start. 0: none.",
        see="runner.md#warm-workers",
        ge=0,
    )
    warm_start: Literal["forkserver", "spawn"] = _tune(
        "warm_start",
        "forkserver",
        "How warm worker processes start on Linux: forked from a server that imported distributed and "
        "Prefect once, or spawned (a new interpreter each, which re-imports the flow script).",
        see="runner.md#warm-workers",
    )
    warm_server_keep_seconds: float = _tune(
        "warm_server_keep_seconds",
        60.0,
        "Seconds the fork server is kept after the process's last warm pool closes, for the next flow "
        "run in the same process. 0: it ends with its last pool.",
        see="runner.md#warm-workers",
        ge=0,
    )
    events_backlog_limit: int = _tune(
        "events_backlog_limit",
        50000,
        "A task run waits to start while more Prefect events than this wait to be sent from its "
        "process, so a slow server cannot grow its memory without bound. 0: never wait.",
        see="operations.md#a-prefect-server-that-holds-the-load",
        ge=0,
    )
    events_drain_seconds: float = _tune(
        "events_drain_seconds",
        30.0,
        "Seconds a closing worker process may take to send the Prefect events and logs it still "
        "queues; events still queued after it are lost (and counted in a warning).",
        see="operations.md#a-prefect-server-that-holds-the-load",
        ge=0,
    )
    tag_limit_cache_seconds: float = _tune(
        "tag_limit_cache_seconds",
        60.0,
        "Seconds gpu-tasks' task runs trust Prefect's 'no concurrency limit for these tags' answer; a "
        "tag limit created mid-run applies within this time. 0: Prefect's own (5).",
        see="runner.md#tagged-task-runs-and-prefects-tag-limit-checks",
        ge=0,
    )
    api_busy_timeout: float = _tune(
        "api_busy_timeout",
        600.0,
        "Seconds gpu-tasks waits out a busy or unreachable Prefect API on tag-slot requests, asking "
        "again with a warning, before the task run fails with the API's error.",
        see="operations.md#a-prefect-server-that-holds-the-load",
        ge=0,
    )
    api_longest_wait: float = _tune(
        "api_longest_wait",
        30.0,
        "The longest wait, in seconds, between two tries of a request a busy Prefect API refused, in "
        "gpu-tasks' task runs (Prefect's client's own waits included).",
        see="operations.md#a-prefect-server-that-holds-the-load",
        gt=0,
    )
    preemption_grace: float = _tune(
        "preemption_grace",
        30.0,
        "Seconds a waiter of higher priority waits for devices preemptible profiles hold before their "
        "workers are stopped and their tasks re-queued.",
        see="leases.md#preemption",
        ge=0,
    )
    priority_aging: float = _tune(
        "priority_aging",
        60.0,
        "Seconds of waiting for devices per +1 of a waiter's effective priority, so a low-priority "
        "waiter is not starved. 0: no aging.",
        see="leases.md#fairness-and-aging",
        ge=0,
    )
    fair_share_half_life: float = _tune(
        "fair_share_half_life",
        3600.0,
        "Half-life, in seconds, of each team's (quota's) recorded device use: among device waiters of "
        "equal priority, the team that used the least goes first. 0: off (arrival order).",
        see="leases.md#fair-share",
        ge=0,
    )
    quota_lease_seconds: float = _tune(
        "quota_lease_seconds",
        60.0,
        "Lease of the Prefect global-concurrency slots a profile with a quota holds (renewed every third "
        "of it): a killed flow run's slots free this long after. At least 60 (Prefect's minimum).",
        see="leases.md#quotas",
        ge=60,
    )
    dask_log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = _tune(
        "dask_log_level",
        "WARNING",
        "Level of Dask's distributed loggers in the flow process while a runner is entered and in the "
        "worker processes gpu-tasks starts. INFO shows Dask's start and stop lines.",
        takes="DEBUG, INFO, WARNING, ERROR or CRITICAL (any case)",
        see="operations.md#seeing-what-ran-where",
    )
    gpu_sample_seconds: float = _tune(
        "gpu_sample_seconds",
        1.0,
        "How often the flow process samples, with NVML, the real devices its local profiles hold, for "
        "the ledger's measured use and the right-size advice. 0: never.",
        see="shared-hosts.md#measured-use",
        ge=0,
    )
    alert_held_busy: float = _tune(
        "alert_held_busy",
        2.0,
        "A flow run whose devices were held more than this many times as long as they were busy gets "
        "the alert `held-busy-over-<N>` on its summary event. 0: never.",
        see="operations.md#events-and-the-gpu-waste-automation",
        ge=0,
    )
    alert_min_held_seconds: float = _tune(
        "alert_min_held_seconds",
        60.0,
        "The held/busy alert needs at least this many device-seconds held in the run, so a short run's "
        "start-up does not raise it.",
        see="operations.md#events-and-the-gpu-waste-automation",
        ge=0,
    )
    alert_device_wait_seconds: float = _tune(
        "alert_device_wait_seconds",
        60.0,
        "A flow run in which a profile's cluster waited longer than this for its devices gets the alert "
        "`device-wait-over-<N>` on its summary event. 0: never.",
        see="operations.md#events-and-the-gpu-waste-automation",
        ge=0,
    )

    @field_validator("other_programs_memory", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        try:
            return size_bytes(value.strip())
        except ValueError:
            raise ValueError(
                "must be a size such as 1GiB, 512MiB or a number of bytes; 0 lets no other program use a "
                f"device gpu-tasks leases; got {value!r}"
            ) from None

    @field_validator("profiles_file", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        # GPU_TASKS_PROFILES_FILE="" is an unset variable, not Path("."): the current directory
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("dask_log_level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value


def size_bytes(text: str) -> int:
    """``text`` (``"16GiB"``, ``"0"``) in bytes as ``parse_bytes`` reads it, but requiring a number
    (``parse_bytes`` reads ``""`` as 1 byte and ``"GiB"`` as 1 GiB); ValueError if it is no size."""
    from dask.utils import parse_bytes

    if not any(ch.isdigit() for ch in text):
        raise ValueError(f"no number in size {text!r}")
    try:
        return int(parse_bytes(text))
    except (ValueError, TypeError, OverflowError) as exc:
        raise ValueError(f"not a size: {text!r}") from exc


def _extra(field: FieldInfo) -> dict[str, Any]:
    return field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}


def is_tuning(field: str) -> bool:
    """Whether the setting ``field`` is a tuning knob (``GPU_TASKS_TUNE_*``) rather than a user setting."""
    return bool(_extra(GpuTasksSettings.model_fields[field]).get("tuning"))


def variable(field: str) -> str:
    """The environment variable of the setting ``field``: ``GPU_TASKS_[TUNE_]<FIELD>``."""
    return (TUNE_PREFIX if is_tuning(field) else PREFIX) + field.upper()


def old_names() -> dict[str, str]:
    """Old variable names that still work, each with the name that replaced it."""
    return {PREFIX + f.upper(): variable(f) for f in GpuTasksSettings.model_fields if is_tuning(f)}


# ``GPU_TASKS_*`` variables that are no setting (never warned about): the pipeline's, scripts' and bench's
NOT_SETTINGS = frozenset({"DATA_DIR", "EXTRAS", "HOME", "COMMIT"})
SCRIPT_PREFIXES = ("TEST_", "BENCH_", "COMPAT_")

# the settings last read, with the variables they were read from
_READ: tuple[tuple[tuple[str, str], ...], GpuTasksSettings] | None = None


def get_settings() -> GpuTasksSettings:
    """The settings as the environment gives them now, read again only when a ``GPU_TASKS_*``
    variable changed (a read validates every field).

    Raises:
        SettingsError: one line per invalid variable, naming it, its value and what it takes.
    """
    global _READ
    from pydantic import ValidationError

    # pydantic-settings matches the prefix in any case; the temporary directory gives two defaults
    key = (
        ("", tempfile.gettempdir()),
        *sorted((k, v) for k, v in os.environ.items() if k[: len(PREFIX)].upper() == PREFIX),
    )
    read = _READ  # one read of the global: another thread may replace it
    if read is not None and read[0] == key:
        return read[1]
    try:
        settings = GpuTasksSettings()
    except ValidationError as exc:
        raise SettingsError(describe_invalid(exc)) from None
    _READ = (key, settings)
    return settings


def _field_of(loc: str) -> str | None:
    """The field a validation error's location names: the field itself, or one of its variables."""
    if loc in GpuTasksSettings.model_fields:
        return loc
    for field in GpuTasksSettings.model_fields:
        if loc.upper() in (variable(field), PREFIX + field.upper()):
            return field
    return None


def describe_invalid(exc: Any) -> str:
    """A ValidationError of :class:`GpuTasksSettings` as one line per variable set (an old name too):
    its value and what the setting takes."""
    lines = []
    for err in exc.errors():
        loc = "_".join(str(p) for p in err["loc"])
        field = _field_of(loc)
        var, what, renamed = PREFIX + loc.upper(), None, ""
        if field is not None:
            var, what = variable(field), GpuTasksSettings.model_fields[field].description
            old = PREFIX + field.upper()
            if is_tuning(field) and var not in os.environ and old in os.environ:
                var, renamed = old, f" (old name of {variable(field)})"
        msg = str(err["msg"]).removeprefix("Value error, ")
        lines.append(
            f"invalid setting {var}={os.environ.get(var, err.get('input'))!r}{renamed}: {msg}"
            + (f" ({what})" if what else "")
        )
    return "\n".join(lines)


def variable_warnings(environ: dict[str, str] | None = None) -> list[str]:
    """One line per ``GPU_TASKS_*`` variable to change: an old name, or one that is no setting (a typo
    would change nothing silently), with the closest setting."""
    import difflib

    env = os.environ if environ is None else environ
    known = sorted(variable(f) for f in GpuTasksSettings.model_fields)
    renamed = old_names()
    out = []
    for var in sorted(env):
        if not var.startswith(PREFIX) or var in known or var.removeprefix(PREFIX) in NOT_SETTINGS:
            continue
        if var.removeprefix(PREFIX).startswith(SCRIPT_PREFIXES):
            continue
        if var in renamed:
            new = renamed[var]
            out.append(
                f"{var} is ignored: {new}, its new name, is set too; remove {var}"
                if new in env
                else f"{var} is an old name: rename it {new} (the old name still works for now)"
            )
            continue
        close = difflib.get_close_matches(var, known, n=1, cutoff=0.75)
        hint = f"; did you mean {close[0]}?" if close else "; docs/profiles.md lists the settings"
        out.append(f"{var} is not a gpu-tasks setting and changes nothing{hint}")
    return out


def resolve(value: Any, field: str, settings: GpuTasksSettings | None = None) -> Any:
    """Return ``value`` unless it is ``None``, else the setting ``field``."""
    if value is not None:
        return value
    return getattr(settings or get_settings(), field)
