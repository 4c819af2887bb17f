"""What a resource profile is: its fields, its three kinds and their rules, checked when it is built."""

from __future__ import annotations

import math
import re
import sys
import warnings
from collections.abc import Mapping
from contextvars import ContextVar
from fractions import Fraction
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core.core_schema import ValidationInfo

from gpu_tasks.errors import ProfileError
from gpu_tasks.settings import size_bytes

TAG_PREFIX = "profile:"
MAX_SHARE = 64
# \Z, not $: "$" also matches before a trailing newline, which let "gpu\n" through.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,62}\Z")
# where a profiles file sets the profile being built (file, line): its warnings point there, not at the
# caller's line (typer's, under the CLI)
WARN_AT: ContextVar[tuple[str, int] | None] = ContextVar("gpu_tasks_profile_warn_at", default=None)
NAME_RULE = "start with a letter or digit and use only letters, digits, '_', '.', '-' (at most 63 characters)"


def is_valid_name(name: str) -> bool:
    """Whether ``name`` may name a profile or a quota: letters, digits, '_', '.', '-', at most 63."""
    return bool(_NAME_RE.match(name))


# [tcp|tls|ucx|ucxx|ws|wss://]host:port (host may be [IPv6])
_ADDRESS_RE = re.compile(
    r"^(?:(tcp|tls|ucx|ucxx|ws|wss)://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})\Z"
)
_IMPORT_PATH_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+\Z")


def _parse_size(value: Any) -> int | None:
    """Parse ``"16GiB"``, ``"500 MB"`` or a byte count into bytes."""
    if value is None:
        return None
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("must be a finite size such as '16GiB' or a number of bytes")
    try:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError
        size = size_bytes(value) if isinstance(value, str) else int(value)
    except ValueError:
        raise ValueError("must be a size such as '16GiB' or a number of bytes") from None
    if size <= 0:
        raise ValueError("must be a positive size")
    return size


class CudaOptions(BaseModel):
    """dask-cuda options passed to ``LocalCUDACluster`` on real GPUs (ignored when emulated)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rmm_pool_size: int | None = Field(
        default=None, description="RMM pool per device, in bytes or a size string ('24GiB'); None: no pool."
    )
    rmm_async: bool = Field(default=False, description="Use RMM's asynchronous allocator (on/off).")
    enable_cudf_spill: bool = Field(
        default=False, description="Let cuDF spill device memory to host (on/off)."
    )
    protocol: Literal["tcp", "ucx", "ucxx"] = Field(
        default="tcp", description="Transport between the workers: 'tcp', 'ucx' or 'ucxx'."
    )

    @field_validator("rmm_pool_size", mode="before")
    @classmethod
    def _size(cls, value: Any) -> int | None:
        return _parse_size(value)


class TlsOptions(BaseModel):
    """Certificates for a ``tls://`` scheduler address (Dask's ``Security``); unset fields fall back to
    ``GPU_TASKS_TLS_*``, then to Dask's ``distributed.comm.tls`` configuration."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ca_file: str | None = Field(
        default=None, description="Path of the CA certificate (PEM) that signed the scheduler's."
    )
    cert: str | None = Field(default=None, description="Path of the client certificate (PEM).")
    key: str | None = Field(
        default=None, description="Path of the client private key (PEM); may be in ``cert``."
    )


Kind = Literal["local", "address", "cluster_class"]
_LOCAL: frozenset[str] = frozenset({"local"})
_KIND_WORDS = {
    "local": "local profile (this host's devices or CPUs)",
    "address": "address profile (an existing Dask scheduler)",
    "cluster_class": "cluster_class profile (workers a cluster manager starts)",
}
# The fields only some kinds take: those kinds, what the field does, and the fix. A field at its
# default counts as not given, so ``ResourceProfile(**p.model_dump())`` works.
KIND_FIELDS: dict[str, tuple[frozenset[str], str, str]] = {
    "cpus": (_LOCAL, "it sizes the CPU workers the runner starts here", "remove cpus"),
    "memory": (
        _LOCAL,
        "it limits the worker processes the runner starts here",
        "remove memory (a cluster_class sets its workers' memory in cluster_kwargs)",
    ),
    "gpu_memory_free": (
        _LOCAL,
        "free memory is read from this host's devices as they are leased",
        "remove gpu_memory_free (gpu_memory_total picks workers by device size)",
    ),
    "gpu_memory_per_task": (
        _LOCAL,
        "it packs tasks on this host's devices by memory; a cluster's GPU resources arbitrate",
        "use gpus=1/k there",
    ),
    "fallback": (
        _LOCAL,
        "it falls back when this host's devices can never satisfy the profile",
        "remove fallback, or add a CPU profile for that work",
    ),
    "processes": (_LOCAL, "tasks run on that cluster's worker processes", "remove processes"),
    "topology": (_LOCAL, "it chooses among this host's devices by how they are wired", "remove topology"),
    "cpu_affinity": (
        _LOCAL,
        "it pins the worker processes the runner starts here to their devices' CPUs",
        "remove cpu_affinity",
    ),
    "cuda": (
        _LOCAL,
        "dask-cuda options for the workers the runner starts here",
        "remove cuda and configure the cluster's workers (dask cuda worker --rmm-pool-size ...)",
    ),
    "gang": (
        frozenset({"local", "cluster_class"}),
        "an existing cluster at address cannot be started as a gang",
        "remove gang, or use cluster_class",
    ),
    "max_workers": (
        frozenset({"local", "cluster_class"}),
        "the runner never starts or scales an existing cluster's workers",
        "remove max_workers",
    ),
    "min_run_time": (
        _LOCAL,
        "it protects a run on this host's devices; a shared scheduler interrupts tasks by their waiters' "
        "grace alone",
        "remove min_run_time",
    ),
    "preemptible": (
        frozenset({"local", "address"}),
        "its cluster manager grants and takes back devices",
        "remove preemptible",
    ),
    "quota": (frozenset({"local", "address"}), "its cluster manager grants devices", "remove quota"),
    "address": (
        frozenset({"address"}),
        "it names an existing scheduler",
        "remove address, or remove kind (address sets it by itself)",
    ),
    "security": (
        frozenset({"address"}),
        "it holds the certificates for a tls:// address",
        "set address, or remove security (a cluster_class takes its class's security in cluster_kwargs)",
    ),
    "cluster_class": (
        frozenset({"cluster_class"}),
        "it names a cluster manager",
        "remove cluster_class, or remove kind (cluster_class sets it by itself)",
    ),
    "cluster_kwargs": (
        frozenset({"cluster_class"}),
        "they are passed to cluster_class",
        "set cluster_class, or remove cluster_kwargs",
    ),
}


class ResourceProfile(BaseModel):
    """What each task of a stage needs, and where and how its workers run (docs/profiles.md).

    ``kind`` follows from ``address`` or ``cluster_class`` where left out; each kind takes only its own
    fields (:data:`KIND_FIELDS`).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Profile name; tasks select it with the tag ``profile:<name>``.")
    kind: Kind = Field(
        default="local",
        description="Where the workers come from: 'local' (this host), 'address' (an existing scheduler), "
        "'cluster_class' (a cluster manager); by default, from address or cluster_class.",
    )
    cpus: float = Field(
        default=1.0,
        description="CPU cores each task needs (per task, may be fractional: 0.5); CPU profiles run "
        "floor(cores / cpus) tasks at once on their worker.",
    )
    gpus: float = Field(
        default=0.0,
        description="Devices each task needs (per task): 0 for CPU only, 1/k (0.5, 0.25, ...) to share one "
        "device among k tasks, a whole n for n whole devices.",
    )
    memory: int | None = Field(
        default=None,
        description="Memory limit of each worker process (per worker, not per task), in bytes or a size "
        "string ('16GiB'); None lets Dask decide.",
    )
    gpu_memory_total: int | None = Field(
        default=None,
        description="Use only devices whose total memory is at least this (bytes or '40GiB'): a device's "
        "size, checked against the inventory (or a cluster's workers) before anything is leased.",
    )
    gpu_memory_free: int | None = Field(
        default=None,
        description="A device must have at least this much memory free (bytes or '40GiB') when it is "
        "leased; less (programs outside gpu-tasks use the rest) and the profile waits.",
    )
    gpu_memory_per_task: int | None = Field(
        default=None,
        description="Device memory each task needs (per task, bytes or '20GiB'), instead of gpus: a device "
        "runs floor(free memory / this) tasks at once; its worker's allocators are capped to their shares.",
    )
    gpu_model: str | None = Field(
        default=None, description="Case-insensitive part of the device name ('H100'); None: any model."
    )
    max_workers: int | None = Field(
        default=None,
        description="Most workers the profile holds at once (a worker owns one device, or a group of n); "
        "None: one per matching device group. Required for cluster_class.",
    )
    idle_timeout: float | None = Field(
        default=None,
        description="Seconds with nothing running or queued before the cluster closes; None takes the "
        "runner's idle_timeout=, then GPU_TASKS_IDLE_TIMEOUT.",
    )
    fallback: Literal["error", "cpu"] = Field(
        default="error",
        description="'error' (fail at submit) or 'cpu' (run on the runner's CPU profile, logged) when no "
        "device here can ever satisfy the profile.",
    )
    processes: bool | None = Field(
        default=None,
        description="CPU profiles: run the worker as a process (true) instead of threads in the flow "
        "process (unset, false); GPU workers are always processes.",
    )
    topology: Literal["nvlink", "pcie-switch", "socket"] | None = Field(
        default=None,
        description="Wiring a worker's devices (a gang's: all of them) must have, every pair: 'nvlink', "
        "'pcie-switch' (one switch tree), 'socket' (one NUMA node); the profile waits for such a set. "
        "None: the best set free now.",
    )
    cpu_affinity: bool = Field(
        default=True,
        description="Pin each GPU worker process to its devices' CPUs (those this process may use); "
        "false leaves its CPUs as they are.",
    )
    gang: bool = Field(
        default=False,
        description="Start all max_workers workers before the first task runs (all or nothing), for "
        "data-parallel training.",
    )
    priority: int = Field(
        default=0, description="Higher goes first when profiles wait for devices (a plain integer, no unit)."
    )
    preemptible: bool = Field(
        default=False,
        description="Its workers (on a shared scheduler: its running tasks) may be stopped and their tasks "
        "re-queued for a higher-priority waiter that waited GPU_TASKS_TUNE_PREEMPTION_GRACE seconds.",
    )
    min_run_time: float | None = Field(
        default=None,
        description="Seconds a preemptible profile's run on a device is protected from preemption, "
        "counted from when it took the device; preemption then stops the run that lost the least work.",
    )
    quota: str | None = Field(
        default=None,
        description="Count its devices against this quota: at most N devices at once across all flow runs, "
        "N being the Prefect global concurrency limit gpu-quota:<quota>.",
    )
    on_oom: str | None = Field(
        default=None,
        description="Name of a (larger) profile to re-run a task on, once, when it runs out of memory here.",
    )
    cuda: CudaOptions = Field(
        default_factory=CudaOptions, description="dask-cuda options (RMM pool, cuDF spilling, protocol)."
    )
    address: str | None = Field(
        default=None,
        description="The scheduler of an existing Dask cluster ('tls://gpu-scheduler:8786'); the runner "
        "connects a client and never starts or closes that cluster.",
    )
    security: TlsOptions | None = Field(default=None, description="Certificates for a tls:// address.")
    cluster_class: str | None = Field(
        default=None,
        description="Import path of a Dask cluster class ('dask_jobqueue.SLURMCluster') the runner creates "
        "on the first task, scales to the queue and to zero, and closes at the end of the flow run.",
    )
    cluster_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments for cluster_class; its workers must advertise the Dask resource GPU.",
    )

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            error = ProfileError(_describe(exc, data.get("name")))
            error.fields = tuple(tuple(str(p) for p in e["loc"]) for e in exc.errors())
            raise error from None

    @model_validator(mode="before")
    @classmethod
    def _kind_and_old_spellings(cls, data: Any) -> Any:
        """Infer ``kind`` where it is left out, and map ``gpu_memory`` to what it did (warned)."""
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        address, cluster_class = data.get("address"), data.get("cluster_class")
        if data.get("kind") is None:
            if address is not None and cluster_class is not None:
                raise ValueError(
                    "address and cluster_class exclude each other: use address for a cluster that is "
                    "already running, cluster_class for one the runner starts"
                )
            data["kind"] = "address" if address is not None else "cluster_class" if cluster_class else "local"
        if "gpu_memory" in data:
            data.update(_old_gpu_memory(data))
        return data

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME_RE.match(value):
            raise ValueError(f"must {NAME_RULE}")
        return value

    @field_validator("cpus", "gpus", "max_workers", "idle_timeout", "priority", "min_run_time", mode="before")
    @classmethod
    def _not_bool(cls, value: Any) -> Any:
        # pydantic's lax mode reads true/false as 1/0, so `gpus = true` would ask for a device.
        if isinstance(value, bool):
            raise ValueError("must be a number, not true/false")
        return value

    @field_validator("min_run_time", "idle_timeout")
    @classmethod
    def _seconds(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is not None and (not math.isfinite(value) or value < 0):
            raise ValueError(
                "must be a number of seconds >= 0, or left unset for GPU_TASKS_IDLE_TIMEOUT"
                if info.field_name == "idle_timeout"
                else "must be a number of seconds, 0 or more, e.g. 600"
            )
        return value

    @field_validator("cpus")
    @classmethod
    def _cpus(cls, value: float) -> float:
        if not math.isfinite(value) or value <= 0:
            raise ValueError("must be a positive number of cores, e.g. 1 or 0.5")
        return value

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, value: float) -> float:
        if not math.isfinite(value) or value < 0:
            raise ValueError("must be 0, a whole number of devices, or 1/k for k in 2..64")
        if value == 0 or (value >= 1 and float(value).is_integer()):
            return float(value)
        if 1 / (MAX_SHARE + 1) < value < 1:  # smaller shares (and subnormals) are never valid
            k = round(1 / value)
            if 2 <= k <= MAX_SHARE and math.isclose(1 / k, value, rel_tol=1e-9, abs_tol=1e-12):
                return 1 / k
        raise ValueError("must be a whole number or 1/k for k in 2..64 (e.g. 1, 2, 0.5, 0.25)")

    @field_validator("memory", "gpu_memory_total", "gpu_memory_free", "gpu_memory_per_task", mode="before")
    @classmethod
    def _sizes(cls, value: Any) -> int | None:
        return _parse_size(value)

    @field_validator("gpu_model")
    @classmethod
    def _model(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must be a non-empty part of a device name, e.g. 'H100', or left unset")
        return value.strip() if value is not None else None

    @field_validator("max_workers")
    @classmethod
    def _max_workers(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError("must be at least 1, or left unset for no cap")
        return value

    @field_validator("address")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        if value is None:
            return None
        value = value.strip()
        match = _ADDRESS_RE.match(value)
        if not match or not 0 < int(match.group(3)) < 65536:
            raise ValueError(
                "must be a Dask scheduler address such as 'tcp://gpu-scheduler:8786' or 'tls://10.0.0.5:8786'"
            )
        return value

    @field_validator("cluster_class")
    @classmethod
    def _cluster_class(cls, value: str | None) -> str | None:
        if value is not None and not _IMPORT_PATH_RE.match(value.strip()):
            raise ValueError(
                "must be the import path of a Dask cluster class, such as 'dask_jobqueue.SLURMCluster'"
            )
        return value.strip() if value is not None else None

    @model_validator(mode="after")
    def _consistent(self) -> ResourceProfile:
        self._consistent_kind()
        if self.gpu_memory_per_task is not None and self.gpus != 0:
            size = f"{self.gpu_memory_per_task / 2**30:g}GiB"
            raise ValueError(
                f"gpu_memory_per_task ({size}) and gpus ({self.gpus:g}) exclude each other: "
                "gpu_memory_per_task packs tasks on a device by their memory, gpus by a fixed share; "
                "remove gpus (or remove gpu_memory_per_task and use gpus=1/k)"
            )
        if not self.is_gpu:
            for field in ("gpu_memory_total", "gpu_memory_free", "gpu_model", "topology"):
                if getattr(self, field) is not None:
                    raise ValueError(
                        f"{field} needs gpus > 0 or gpu_memory_per_task; set one of them or remove {field}"
                    )
            if self.gang:
                raise ValueError("gang needs gpus > 0 (gangs start GPU workers together)")
        elif self.processes is False:
            raise ValueError("processes=False is not possible with gpus > 0: each GPU worker is a process")
        if self.is_gpu and self.topology is not None and self.devices_per_worker < 2 and not self.gang:
            raise ValueError(
                f"topology={self.topology!r} needs two or more devices per worker (gpus >= 2, or a gang): a "
                "worker with one device has no pair to wire; remove topology"
            )
        if self.on_oom is not None and (self.on_oom == self.name or not _NAME_RE.match(self.on_oom)):
            raise ValueError(
                "on_oom must name another profile (a larger one to re-run out-of-memory tasks on); got "
                f"{self.on_oom!r}"
            )
        for field in ("quota", "preemptible"):
            if getattr(self, field) not in (None, False) and not self.is_gpu:
                raise ValueError(f"{field} applies to GPU profiles (gpus > 0); remove {field}")
        if self.min_run_time is not None and not self.preemptible:
            raise ValueError(
                "min_run_time protects preemptible work from preemption; set preemptible=True or remove "
                "min_run_time"
            )
        if self.quota is not None and not _NAME_RE.match(self.quota):
            raise ValueError(
                "quota must be a name of letters, digits, '_', '.', '-' (at most 63 characters); got "
                f"{self.quota!r}"
            )
        if self.gang and self.max_workers is None:
            raise ValueError("gang needs max_workers: the number of workers to start together")
        if self.kind == "cluster_class" and self.max_workers is None:
            raise ValueError(
                "cluster_class needs max_workers: the most workers the cluster manager may start for "
                "this profile"
            )
        return self

    def _consistent_kind(self) -> None:
        """Each kind takes only its own fields (:data:`KIND_FIELDS`), and the one that defines it."""
        if self.kind == "address" and self.address is None:
            raise ValueError("kind='address' needs address: the scheduler's, e.g. 'tcp://gpu-scheduler:8786'")
        if self.kind == "cluster_class" and self.cluster_class is None:
            raise ValueError(
                "kind='cluster_class' needs cluster_class: the import path of a Dask cluster class, e.g. "
                "'dask_jobqueue.SLURMCluster'"
            )
        for field, (kinds, why, fix) in KIND_FIELDS.items():
            default = type(self).model_fields[field].get_default(call_default_factory=True)
            if self.kind not in kinds and getattr(self, field) != default:
                takes = " and ".join(k for k in _KIND_WORDS if k in kinds)
                raise ValueError(
                    f"{field} applies to {takes} profiles, not to this {_KIND_WORDS[self.kind]}: {why}; {fix}"
                )

    @property
    def gpu_memory(self) -> int | None:
        """Deprecated: :attr:`gpu_memory_total` (a device's size) or :attr:`gpu_memory_free`."""
        warnings.warn(
            "ResourceProfile.gpu_memory is deprecated: read gpu_memory_total (devices at least this large) "
            "or gpu_memory_free (this much free when a device is leased)",
            FutureWarning,
            stacklevel=2,
        )
        return self.gpu_memory_total

    @property
    def is_gpu(self) -> bool:
        """Whether tasks of this profile need devices (``gpus`` or ``gpu_memory_per_task``)."""
        return self.gpus > 0 or self.gpu_memory_per_task is not None

    @property
    def by_memory(self) -> bool:
        """Whether tasks are packed on a device by ``gpu_memory_per_task`` (not a fixed share)."""
        return self.gpu_memory_per_task is not None

    @property
    def tag(self) -> str:
        """The task tag that selects this profile."""
        return f"{TAG_PREFIX}{self.name}"

    @property
    def share(self) -> Fraction:
        """The fraction of one device a task holds: 0 for CPU, 1 for whole devices and for
        ``gpu_memory_per_task`` (how many share then depends on free memory)."""
        if self.by_memory or self.gpus >= 1:
            return Fraction(1)
        return Fraction(1, round(1 / self.gpus)) if self.gpus else Fraction(0)

    @property
    def devices_per_worker(self) -> int:
        """Devices each worker owns: n for n-GPU tasks, else 1 (0 for CPU)."""
        if not self.is_gpu:
            return 0
        return int(self.gpus) if self.gpus >= 1 else 1

    @property
    def uses_processes(self) -> bool:
        """Whether workers run as separate processes."""
        return self.is_gpu or not self.is_local or bool(self.processes)

    @property
    def is_local(self) -> bool:
        """Whether the runner starts this profile's workers on this host's devices (the default)."""
        return self.kind == "local"

    @property
    def need_memory_free(self) -> int | None:
        """Bytes a device must have free when leased: the larger of ``gpu_memory_free`` and
        ``gpu_memory_per_task`` (``None``: no need to check)."""
        needs = [n for n in (self.gpu_memory_free, self.gpu_memory_per_task) if n is not None]
        return max(needs) if needs else None


def _old_gpu_memory(data: dict[str, Any]) -> dict[str, Any]:
    """The new spelling of ``gpu_memory`` (popped from ``data``), with a warning that gives it."""
    old = data.pop("gpu_memory")
    given = [f for f in ("gpu_memory_total", "gpu_memory_free") if data.get(f) is not None]
    if given:
        raise ValueError(
            f"gpu_memory is the old spelling of gpu_memory_total and gpu_memory_free; remove gpu_memory "
            f"and keep {' and '.join(given)}"
        )
    if old is None:
        return {}
    new = {"gpu_memory_total": old}
    if data.get("kind") == "local":
        new["gpu_memory_free"] = old
    name = data.get("name")
    who = f"profile {name!r}" if isinstance(name, str) and name else "profile"
    total = f"gpu_memory_total={old!r} (devices with at least that much memory)"
    free = f" and gpu_memory_free={old!r} (that much free when a device is leased)"
    message = (
        f"{who}: gpu_memory is deprecated: write {total}{free}, which it stood for, or only the one you mean"
        if "gpu_memory_free" in new
        else f"{who}: gpu_memory is deprecated: write {total}, which it stands for on this "
        f"{data.get('kind')} profile"
    )
    if (at := WARN_AT.get()) is not None:  # once per file line
        warnings.warn_explicit(message, FutureWarning, *at, registry=_WARNED.setdefault(at[0], {}))
    else:
        warnings.warn(message, FutureWarning, stacklevel=_caller_level())
    return new


_WARNED: dict[str, dict[Any, Any]] = {}  # a warnings registry per profiles file


def _caller_level() -> int:
    """The ``stacklevel`` of the user's line: the first frame outside gpu_tasks and pydantic."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and (
        frame.f_globals.get("__name__", "").split(".")[0] in {"gpu_tasks", "pydantic", "pydantic_core"}
    ):
        frame, level = frame.f_back, level + 1
    return level


def _describe(exc: ValidationError, name: Any) -> str:
    """Turn pydantic errors into ``profile 'x': field must ...; got v`` lines."""
    who = f"profile {name!r}" if isinstance(name, str) and name else "profile"
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "profile"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            nested: dict[str, type[BaseModel]] = {"cuda": CudaOptions, "security": TlsOptions}
            model = nested.get(str(err["loc"][0]), ResourceProfile)
            known = ", ".join(sorted(model.model_fields))
            msg = f"is not a profile field (known fields: {known})"
        if err["type"] == "missing":
            lines.append(f"{who}: {field} is required")
            continue
        if not err["loc"]:  # a rule across fields
            lines.append(f"{who}: {msg}")
            continue
        lines.append(f"{who}: {field} {msg}; got {err.get('input')!r}")
    return "\n".join(lines)
