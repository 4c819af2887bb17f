"""Settings, read from ``GPU_TASKS_*`` environment variables (pydantic-settings).

Arguments across gpu-tasks default to ``None`` and are resolved here: the explicit
argument, then the setting, then the built-in default (:func:`resolve`).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gpu_tasks.errors import SettingsError


def default_lease_dir() -> Path:
    """Per-user lease directory under the system temp dir (``/tmp/gpu-tasks-leases-<uid>``)."""
    return Path(tempfile.gettempdir()) / f"gpu-tasks-leases-{os.getuid()}"


def default_presence_dir() -> Path:
    """Host-wide directory where flow runs of every user say which devices they hold."""
    return Path(tempfile.gettempdir()) / "gpu-tasks-presence"


class GpuTasksSettings(BaseSettings):
    """Process-wide settings. Every field maps to ``GPU_TASKS_<FIELD>``.

    Other ``GPU_TASKS_*`` variables are ignored here: the example pipeline reads its own
    (``GPU_TASKS_DATA_DIR``, :mod:`gpu_tasks.pipeline.settings`), the runner its workers'.
    """

    model_config = SettingsConfigDict(env_prefix="GPU_TASKS_", extra="ignore")

    profiles_file: Path | None = Field(default=None, description="TOML file with [profiles.<name>] tables.")
    idle_timeout: float = Field(
        default=60.0, ge=0, description="Seconds a profile's cluster may sit idle before it is closed."
    )
    emulated_gpus: str | None = Field(
        default=None,
        description='Emulate devices: a count ("4") or "NAME:MEMORY,..." ("H100:80GiB,L4:24GiB").',
    )
    discovery_command: str | None = Field(
        default=None,
        description='Spark-style discovery command printing {"name": "gpu", "addresses": [...]}.',
    )
    provision_timeout: float = Field(
        default=120.0, gt=0, description="Seconds to wait for a profile's workers to start."
    )
    dashboard: bool = Field(default=False, description="Start a Dask dashboard (127.0.0.1) per cluster.")
    lease_dir: Path = Field(
        default_factory=default_lease_dir,
        description="Directory of per-device lease files; flow runs on this host that share it never put "
        "workers on the same device at once. The default is per user (created 0700). For several Unix "
        "users, an admin makes one shared directory once (`gpu-tasks leases setup DIR --group GROUP`: "
        "setgid, sticky, root-owned read-only lock files) and every user sets it here; a group- or "
        "world-writable directory without the sticky bit is refused (docs/shared-hosts.md).",
    )
    presence_dir: Path = Field(
        default_factory=default_presence_dir,
        description="Host-wide directory (sticky, world-writable; created 1777 when missing) in which flow "
        "runs of every user say which devices they lease, so a run never uses a device another user's "
        "flow run leases through another lease directory (docs/shared-hosts.md).",
    )
    tag_limit_cache_seconds: float = Field(
        default=60.0,
        ge=0,
        description="Seconds gpu-tasks' own task runs trust Prefect's 'no concurrency limit for these tags' "
        "answer (Prefect's own, which other task runners keep: 5). Longer keeps thousands of tagged tasks "
        "from queueing behind a busy server; "
        "a tag limit created mid-run applies within this time. 0 keeps Prefect's.",
    )
    tls_ca_file: Path | None = Field(
        default=None, description="CA certificate (PEM) for tls:// scheduler addresses of address profiles."
    )
    tls_cert: Path | None = Field(default=None, description="Client certificate (PEM) for tls:// addresses.")
    tls_key: Path | None = Field(default=None, description="Client private key (PEM) for tls:// addresses.")
    warm_workers: int = Field(
        default=2,
        ge=0,
        description="Worker processes kept started and imported, holding no device, for profiles whose "
        "workers this host starts (gpu_tasks.worker.warm); a lease binds one, so a first task starts without "
        "waiting for a process to spawn and import Prefect; never more than the flow's profiles can still "
        "bind. 0: no pool, a process is spawned per worker after its lease.",
    )
    events_backlog_limit: int = Field(
        default=20000,
        ge=0,
        description="A task run waits to start while more than this many Prefect events of its process "
        "wait to be sent to the server (each holds its task run's engine, about 15 KiB): a server slower "
        "than the flow's tasks otherwise lets the process's memory grow without bound. "
        "0: never wait (gpu_tasks.prefect_api.backlog).",
    )
    events_drain_seconds: float = Field(
        default=30.0,
        ge=0,
        description="How long a closing worker process may take to send the Prefect events and run logs "
        "it still queues (its task runs' states among them) before it exits; the runner waits that long "
        "past its close grace before ending it. Events still queued after it are lost, and the worker "
        "says how many (gpu_tasks.worker.prefect_queues).",
    )
    warm_server_keep_seconds: float = Field(
        default=60.0,
        ge=0,
        description="How long the flow process's warm-pool fork server (GPU_TASKS_WARM_START=forkserver) "
        "is kept after its last pool closes, so that flow runs one after another in one process "
        "(a served deployment, a test session) fork from it instead of each starting one (about 1.9 s of "
        "CPU). "
        "0: it ends with its last pool. It holds no device and no worker; it ends with the process.",
    )
    warm_start: Literal["forkserver", "spawn"] = Field(
        default="forkserver",
        description="How warm worker processes start (Linux): 'forkserver' forks each from a server "
        "process of the pool's own that imported distributed and Prefect's task engine once (about "
        "0.05 s of CPU a process instead of 1.5 s; the flow script is not re-imported in workers); "
        "'spawn' starts a new interpreter per process that imports them itself (and re-imports the flow "
        'script: guard its flow call with `if __name__ == "__main__":`). Other platforms always spawn.',
    )
    lease_timeout: float = Field(
        default=600.0,
        ge=0,
        description="Seconds a profile waits for devices that another process (flow run) leases before "
        "failing.",
    )
    other_programs_memory: int = Field(
        default=2**30,
        ge=0,
        description="Device memory (bytes, or a size such as 1GiB or 512MiB) that programs outside gpu-tasks "
        "may use on a device before gpu-tasks stops leasing it; sampled right before each lease "
        "(docs/shared-hosts.md). 0: any use by another program keeps the device from gpu-tasks.",
    )
    api_busy_timeout: float = Field(
        default=600.0,
        ge=0,
        description="Seconds gpu-tasks waits out a busy or unreachable Prefect API (503, 429, timeouts, "
        "dropped connections) on a tag-slot check or tag slots it takes for a task, asking again with a "
        "warning in the log, before the task run fails with the API's error (gpu_tasks.compat.api_busy).",
    )
    api_longest_wait: float = Field(
        default=30.0,
        gt=0,
        description="The longest wait, in seconds, between two tries of a request a busy Prefect API "
        "refused, in the task runs gpu-tasks runs: gpu-tasks' own waits and Prefect's client's (which "
        "doubles each time, without a bound otherwise), so a worker holding a device asks again within "
        "that long after the API recovers (gpu_tasks.compat.api_busy).",
    )
    preemption_grace: float = Field(
        default=30.0,
        ge=0,
        description="Seconds a waiter of higher priority waits for devices that preemptible profiles hold "
        "before their workers are stopped and their tasks re-queued (docs/leases.md, Preemption).",
    )
    priority: int | None = Field(
        default=None,
        description="Priority this flow run's GPU profiles wait for devices at, replacing each profile's "
        "own priority (set per deployment or flow run with the job variable env). Unset: the profiles'.",
    )
    priority_aging: float = Field(
        default=60.0,
        ge=0,
        description="Seconds of waiting for devices per +1 of a waiter's effective priority, so a "
        "low-priority waiter is not starved by a stream of higher-priority ones. 0: no aging.",
    )
    quota_lease_seconds: float = Field(
        default=60.0,
        ge=60,
        description="Lease of the Prefect global-concurrency slots a profile with a quota holds (renewed "
        "every third of it while held): a flow run killed without giving them back frees them this long "
        "after. At least 60 (Prefect's minimum).",
    )
    dask_log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = Field(
        default="WARNING",
        description="Level of Dask's distributed loggers in the flow process while a runner is entered and "
        "in the worker processes gpu-tasks starts. INFO shows Dask's scheduler and worker start/stop lines.",
    )

    gpu_sample_seconds: float = Field(
        default=1.0,
        ge=0,
        description="How often the flow process samples, with NVML, the real devices its local profiles hold "
        "(SM utilization, memory used, per-process memory) for the ledger and the right-size advice "
        "(gpu_tasks.devices.measure). 0: never. Emulated devices are never sampled.",
    )
    alert_held_busy: float = Field(
        default=2.0,
        ge=0,
        description="A flow run whose devices were held more than this many times as long as they were "
        "busy (held/busy; 2 is under 50% busy) gets the alert held-busy-over-<N> on its "
        "gpu-tasks.flow-run.summary event (gpu_tasks.reporting.alerts). 0: never.",
    )
    alert_device_wait_seconds: float = Field(
        default=60.0,
        ge=0,
        description="A flow run in which a profile's cluster waited longer than this for its devices gets "
        "the alert device-wait-over-<N> on its gpu-tasks.flow-run.summary event. 0: never.",
    )
    alert_min_held_seconds: float = Field(
        default=60.0,
        ge=0,
        description="The held/busy alert needs at least this many device-seconds held in the run, so a "
        "short run's start-up does not raise it.",
    )

    @field_validator("other_programs_memory", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        from dask.utils import parse_bytes

        text = value.strip()
        try:
            if not text or not any(ch.isdigit() for ch in text):
                raise ValueError(text)
            return int(parse_bytes(text))
        except (ValueError, OverflowError):
            raise ValueError(
                "must be a size such as 1GiB, 512MiB or a number of bytes; 0 lets no other program use a "
                f"device gpu-tasks leases; got {value!r}"
            ) from None

    @field_validator("dask_log_level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value


# ``GPU_TASKS_*`` variables that are no setting of this class: the example pipeline's, and those the
# runner sets for its own worker processes (never set by users)
NOT_SETTINGS = frozenset(
    {
        "DATA_DIR",
        "WORKER_PROFILE",
        "WORKER_DEVICES",
        "WORKER_EMULATED",
        "WORKER_GPU_MEMORY_LIMIT",
        "WORKER_GPU_MEMORY_PER_TASK",
        "PLACEMENT_TAGS_FREE_AT",
        "EXTRAS",  # scripts/setup
        "HOME",  # infra/prefect.yaml
        "COMMIT",  # the benchmarks' record of the code they measured
    }
)
SCRIPT_PREFIXES = (
    "TEST_",
    "BENCH_",
    "COMPAT_",
)  # the project's own scripts: scripts/test, bench/, test-compat
PREFIX = "GPU_TASKS_"


def get_settings() -> GpuTasksSettings:
    """Read the settings from the environment now (cheap; not cached so tests can change env).

    Raises:
        SettingsError: one line per invalid variable, naming it, its value and what it takes.
    """
    from pydantic import ValidationError

    try:
        return GpuTasksSettings()
    except ValidationError as exc:
        raise SettingsError(describe_invalid(exc)) from None


def describe_invalid(exc: Any) -> str:
    """``exc`` (pydantic's ValidationError of :class:`GpuTasksSettings`) as lines naming each variable."""
    lines = []
    for err in exc.errors():
        field = "_".join(str(p) for p in err["loc"])
        var = PREFIX + field.upper()
        what = (
            GpuTasksSettings.model_fields[field].description
            if field in GpuTasksSettings.model_fields
            else None
        )
        msg = str(err["msg"]).removeprefix("Value error, ")
        lines.append(
            f"invalid setting {var}={os.environ.get(var, err.get('input'))!r}: {msg}"
            + (f" ({what})" if what else "")
        )
    return "\n".join(lines)


def unknown_variables(environ: dict[str, str] | None = None) -> list[str]:
    """One line per ``GPU_TASKS_*`` variable that is no gpu-tasks setting (a typo changes nothing
    silently otherwise), with the closest known setting when one is close."""
    import difflib

    env = os.environ if environ is None else environ
    known = {PREFIX + f.upper() for f in GpuTasksSettings.model_fields}
    out = []
    for var in sorted(env):
        if not var.startswith(PREFIX) or var in known or var.removeprefix(PREFIX) in NOT_SETTINGS:
            continue
        if var.startswith(tuple(PREFIX + p for p in SCRIPT_PREFIXES)):
            continue
        close = difflib.get_close_matches(var, sorted(known), n=1, cutoff=0.75)
        hint = f"; did you mean {close[0]}?" if close else "; docs/profiles.md lists the settings"
        out.append(f"{var} is not a gpu-tasks setting and changes nothing{hint}")
    return out


def resolve(value: Any, field: str, settings: GpuTasksSettings | None = None) -> Any:
    """Return ``value`` unless it is ``None``, else the setting ``field``."""
    if value is not None:
        return value
    return getattr(settings or get_settings(), field)
