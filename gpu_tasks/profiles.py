"""Resource profiles: what a task needs, validated when the profile is built.

A profile is data. :func:`gpu_tasks.policy.worker_spec` turns it (and the devices
it may use) into worker specs; nothing here starts a process. :func:`resolve_profiles`
is the one place that decides which profiles are in force and which is the default.
"""

from __future__ import annotations

import contextlib
import math
import re
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from dask.utils import parse_bytes
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gpu_tasks.errors import ProfileError, UnknownProfileError

if TYPE_CHECKING:
    from gpu_tasks.settings import GpuTasksSettings

TAG_PREFIX = "profile:"
DEFAULT_PROFILE = "cpu"  # untagged tasks run here; added as a plain CPU profile when not defined
MAX_SHARE = 64
# \Z, not $: "$" also matches before a trailing newline, which let "gpu\n" through.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,62}\Z")


def is_valid_name(name: str) -> bool:
    """Whether ``name`` may name a profile or a quota: letters, digits, '_', '.', '-', at most 63."""
    return bool(_NAME_RE.match(name))


# a Dask scheduler address: [tcp|tls|ucx|ucxx|ws|wss://]host:port (host may be [IPv6])
_ADDRESS_RE = re.compile(
    r"^(?:(tcp|tls|ucx|ucxx|ws|wss)://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})\Z"
)
_IMPORT_PATH_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+\Z")


def _parse_size(value: Any, field: str) -> int | None:
    """Parse ``"16GiB"``, ``"500 MB"`` or a byte count into bytes."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError("must be a size such as '16GiB' or a number of bytes")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("must be a finite size such as '16GiB' or a number of bytes")
    if isinstance(value, (int, float)):
        size = int(value)
    elif isinstance(value, str):
        # parse_bytes reads "" and "GiB" as 1 and 1 GiB; a size must have a number in it.
        if not any(ch in "0123456789" for ch in value):
            raise ValueError("must be a size such as '16GiB' or a number of bytes")
        try:
            size = int(parse_bytes(value))
        except (ValueError, TypeError, OverflowError) as exc:  # "1e400" overflows to inf
            raise ValueError("must be a size such as '16GiB' or a number of bytes") from exc
    else:
        raise ValueError("must be a size such as '16GiB' or a number of bytes")
    if size <= 0:
        raise ValueError("must be a positive size")
    return size


class CudaOptions(BaseModel):
    """dask-cuda options passed to ``LocalCUDACluster`` on real GPUs (ignored when emulated)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rmm_pool_size: int | None = Field(default=None, description="RMM pool per device, e.g. '24GiB'.")
    rmm_async: bool = False
    enable_cudf_spill: bool = False
    protocol: Literal["tcp", "ucx", "ucxx"] = "tcp"

    @field_validator("rmm_pool_size", mode="before")
    @classmethod
    def _size(cls, value: Any) -> int | None:
        return _parse_size(value, "rmm_pool_size")


class TlsOptions(BaseModel):
    """Certificates for a ``tls://`` scheduler address (Dask's ``Security``).

    Unset fields fall back to ``GPU_TASKS_TLS_CA_FILE``, ``GPU_TASKS_TLS_CERT`` and
    ``GPU_TASKS_TLS_KEY``, then to Dask's own ``distributed.comm.tls`` configuration.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    ca_file: str | None = Field(default=None, description="CA certificate (PEM) that signed the scheduler's.")
    cert: str | None = Field(default=None, description="Client certificate (PEM).")
    key: str | None = Field(default=None, description="Client private key (PEM); may be in ``cert``.")


class ResourceProfile(BaseModel):
    """What each task of a stage needs, and how its cluster behaves.

    Args:
        name: Profile name; tasks select it with the tag ``profile:<name>``.
        cpus: CPU cores per task (may be fractional, e.g. 0.5).
        gpus: 0 for CPU-only; ``1/k`` (0.5, 0.25, ...) to share one device among k
            tasks; a whole number n for n whole devices per task.
        memory: Memory limit per worker (``"16GiB"`` or bytes); ``None`` lets Dask decide.
        gpu_memory: Minimum total memory of a device this profile may use.
        gpu_memory_per_task: Device memory each task needs (``"20GiB"``), instead of ``gpus``:
            tasks are packed on a device by it, floor(free memory / this) at once (an 80 GiB
            device runs four 20 GiB tasks), and each worker's CuPy / RMM / PyTorch allocators
            are capped to its tasks' shares (docs/shared-hosts.md, "Memory as the request").
        gpu_model: Case-insensitive substring of the device name (``"H100"``).
        max_workers: Cap on workers (devices, or device groups) the profile may hold.
        idle_timeout: Seconds without running or queued tasks before the cluster is
            closed; ``None`` takes ``GPU_TASKS_IDLE_TIMEOUT``.
        fallback: ``"error"`` (fail at submit) or ``"cpu"`` (run on the runner's CPU
            profile, logged) when no device can ever satisfy the profile.
        processes: Run workers as processes. GPU profiles always do (each worker owns
            its devices through ``CUDA_VISIBLE_DEVICES``); CPU profiles default to
            threads in the flow process, which costs far less per task.
        gang: Start all ``max_workers`` workers before the first task runs (for
            data-parallel training); provisioning fails as a whole if one cannot start.
        priority: Higher goes first when profiles wait for devices.
        preemptible: Its workers may be stopped, and its running tasks re-queued, when a
            waiter of higher priority has waited ``GPU_TASKS_TUNE_PREEMPTION_GRACE`` seconds for
            the devices it holds (docs/leases.md, Preemption); on a shared scheduler
            (``address``), its running tasks are interrupted. Not for ``cluster_class``.
        quota: Count the devices its workers hold (``address``: its running tasks use)
            against this quota: at most N devices at once across all flow runs, N being the
            Prefect global concurrency limit ``gpu-quota:<quota>`` (docs/leases.md, Quotas).
            Not for ``cluster_class``.
        on_oom: Name of a (larger) profile to re-run a task on, once, when it runs out of
            memory here: its worker is killed for exceeding ``memory``, or the task raises
            an out-of-memory error (CUDA, RMM, cuDF, ``MemoryError``). Logged and sent as a
            ``gpu-tasks.task.escalated`` event; ``None`` (the default) reports the failure.
        cuda: dask-cuda options (RMM pool, cuDF spilling, protocol), validated here.
        address: Run on an existing Dask cluster, by its scheduler's address
            (``tls://gpu-scheduler:8786``): the runner connects a client and never
            starts or closes the cluster; the scheduler's ``GPU`` resources arbitrate.
        security: Certificates for a ``tls://`` address (:class:`TlsOptions`).
        cluster_class: Import path of a Dask cluster class (``dask_jobqueue.SLURMCluster``,
            ``dask_kubernetes.operator.KubeCluster``, ...) the runner creates on the
            profile's first task, scales to the queued tasks, scales to zero when idle
            and closes at the end of the flow run. Needs ``max_workers``.
        cluster_kwargs: Keyword arguments for ``cluster_class``; its workers must
            advertise the Dask resource ``GPU`` (for GPU profiles).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    cpus: float = Field(default=1.0)
    gpus: float = Field(default=0.0)
    memory: int | None = None
    gpu_memory: int | None = None
    gpu_memory_per_task: int | None = None
    gpu_model: str | None = None
    max_workers: int | None = None
    idle_timeout: float | None = None
    fallback: Literal["error", "cpu"] = "error"
    processes: bool | None = None
    gang: bool = False
    priority: int = 0
    preemptible: bool = False
    quota: str | None = None
    on_oom: str | None = None
    cuda: CudaOptions = Field(default_factory=CudaOptions)
    address: str | None = None
    security: TlsOptions | None = None
    cluster_class: str | None = None
    cluster_kwargs: dict[str, Any] = Field(default_factory=dict)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ProfileError(_describe(exc, data.get("name"))) from None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME_RE.match(value):
            raise ValueError(
                "must start with a letter or digit and use only letters, digits, '_', '.', '-' "
                "(at most 63 characters)"
            )
        return value

    @field_validator("cpus", "gpus", "max_workers", "idle_timeout", "priority", mode="before")
    @classmethod
    def _not_bool(cls, value: Any) -> Any:
        # pydantic's lax mode reads true/false as 1/0, so `gpus = true` would ask for a device.
        if isinstance(value, bool):
            raise ValueError("must be a number, not true/false")
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

    @field_validator("memory", "gpu_memory", "gpu_memory_per_task", mode="before")
    @classmethod
    def _sizes(cls, value: Any, info: Any) -> int | None:
        return _parse_size(value, info.field_name)

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

    @field_validator("idle_timeout")
    @classmethod
    def _idle(cls, value: float | None) -> float | None:
        if value is not None and (not math.isfinite(value) or value < 0):
            raise ValueError("must be a number of seconds >= 0, or left unset for GPU_TASKS_IDLE_TIMEOUT")
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
        if self.gpu_memory_per_task is not None:
            self._consistent_memory_request()
        if not self.is_gpu:
            for field in ("gpu_memory", "gpu_model"):
                if getattr(self, field) is not None:
                    raise ValueError(
                        f"{field} needs gpus > 0 or gpu_memory_per_task; set one of them or remove {field}"
                    )
            if self.gang:
                raise ValueError("gang needs gpus > 0 (gangs start GPU workers together)")
        elif self.processes is False:
            raise ValueError("processes=False is not possible with gpus > 0: each GPU worker is a process")
        if self.on_oom is not None and (self.on_oom == self.name or not _NAME_RE.match(self.on_oom)):
            raise ValueError(
                "on_oom must name another profile (a larger one to re-run out-of-memory tasks on); got "
                f"{self.on_oom!r}"
            )
        if self.quota is not None and (not self.is_gpu or self.cluster_class is not None):
            raise ValueError(
                "quota applies to GPU profiles (gpus > 0) on this host's devices or on a shared scheduler "
                "(address), not to cluster_class profiles, whose cluster manager grants devices; remove quota"
            )
        if self.quota is not None and not _NAME_RE.match(self.quota):
            raise ValueError(
                "quota must be a name of letters, digits, '_', '.', '-' (at most 63 characters); got "
                f"{self.quota!r}"
            )
        if self.preemptible and (not self.is_gpu or self.cluster_class is not None):
            raise ValueError(
                "preemptible applies to GPU profiles (gpus > 0) on this host's devices or on a shared "
                "scheduler (address), not to cluster_class profiles; remove preemptible"
            )
        if self.gang and self.max_workers is None:
            raise ValueError("gang needs max_workers: the number of workers to start together")
        self._consistent_placement()
        return self

    def _consistent_memory_request(self) -> None:
        """Rules for ``gpu_memory_per_task`` (memory as the request)."""
        size = f"{self.gpu_memory_per_task / 2**30:g}GiB" if self.gpu_memory_per_task else "?"
        if self.gpus != 0:
            raise ValueError(
                f"gpu_memory_per_task ({size}) and gpus ({self.gpus:g}) exclude each other: "
                "gpu_memory_per_task packs tasks on a device by their memory, gpus by a fixed share; "
                "remove gpus (or remove gpu_memory_per_task and use gpus=1/k)"
            )
        if not self.is_local:
            raise ValueError(
                "gpu_memory_per_task applies to this host's devices, not to address or cluster_class "
                "profiles (their workers' GPU resources arbitrate); use gpus=1/k there"
            )

    def _consistent_placement(self) -> None:
        """Rules for ``address`` and ``cluster_class`` profiles."""
        if self.address is not None and self.cluster_class is not None:
            raise ValueError(
                "address and cluster_class exclude each other: use address for a cluster that is already "
                "running, cluster_class for one the runner starts"
            )
        if self.cluster_kwargs and self.cluster_class is None:
            raise ValueError("cluster_kwargs needs cluster_class (the class they are passed to)")
        if self.security is not None and self.address is None:
            raise ValueError(
                "security applies to an address profile; for a cluster_class pass the class's own "
                "security argument in cluster_kwargs"
            )
        if self.is_local:
            return
        where = "address" if self.address is not None else "cluster_class"
        if self.processes is False:
            raise ValueError(
                f"processes=False is not possible with {where}: tasks run on that cluster's workers"
            )
        if self.fallback == "cpu":
            raise ValueError(
                f"fallback='cpu' applies to this host's devices, not to a profile with {where}; remove "
                "fallback or add a CPU profile for that work"
            )
        if self.address is not None and self.gang:
            raise ValueError(
                "gang needs workers the runner starts (local devices or cluster_class); an existing "
                "cluster at address cannot be started as a gang"
            )
        if self.cluster_class is not None and self.max_workers is None:
            raise ValueError(
                "cluster_class needs max_workers: the most workers the cluster manager may start for "
                "this profile"
            )

    # ----------------------------------------------------------------- derived
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
        return profile(self.name)

    @property
    def share(self) -> Fraction:
        """The fraction of one device a task holds (0 for CPU, 1 for whole devices).

        A ``gpu_memory_per_task`` profile's tasks hold 1 here (at most the whole device); how many
        share it depends on the device's free memory (:func:`gpu_tasks.policy.memory_slots`).
        """
        if self.by_memory:
            return Fraction(1)
        if self.gpus == 0:
            return Fraction(0)
        if self.gpus < 1:
            return Fraction(1, round(1 / self.gpus))
        return Fraction(1)

    @property
    def devices_per_worker(self) -> int:
        """Devices each worker owns: n for n-GPU tasks, else 1 (0 for CPU)."""
        if not self.is_gpu:
            return 0
        return int(self.gpus) if self.gpus >= 1 else 1

    @property
    def uses_processes(self) -> bool:
        """Whether workers run as separate processes."""
        return True if self.is_gpu or not self.is_local else bool(self.processes)

    @property
    def is_local(self) -> bool:
        """Whether the runner starts this profile's workers on this host's devices (the default)."""
        return self.address is None and self.cluster_class is None

    @property
    def kind(self) -> Literal["local", "address", "cluster_class"]:
        """Where the profile's workers come from."""
        if self.address is not None:
            return "address"
        return "cluster_class" if self.cluster_class is not None else "local"


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


# --------------------------------------------------------------------- tags
def profile_tag(name: str) -> str:
    """The tag that sends a task to profile ``name``: ``profile_tag("gpu") == "profile:gpu"``
    (``profile`` is the same function under its first name)."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ProfileError(f"profile name {name!r} is not valid: use letters, digits, '_', '.', '-'")
    return f"{TAG_PREFIX}{name}"


profile = profile_tag  # its first name, kept: tags=[profile("gpu")] works as before


def profile_from_tags(tags: Iterable[str]) -> str | None:
    """The profile named by ``profile:<name>`` tags, or ``None``.

    Raises:
        ProfileError: when the tags name two different profiles.
    """
    names = {t[len(TAG_PREFIX) :] for t in tags if isinstance(t, str) and t.startswith(TAG_PREFIX)}
    if len(names) > 1:
        raise ProfileError(
            f"a task carries tags for several profiles ({', '.join(sorted(names))}); keep exactly one "
            "profile:<name> tag"
        )
    return next(iter(names), None)


@contextlib.contextmanager
def use_profile(name: str) -> Iterator[None]:
    """Send every task submitted inside the block to profile ``name`` (a ``prefect.tags`` block)."""
    from prefect import tags

    with tags(profile(name)):
        yield


# --------------------------------------------------------------------- TOML
def profiles_from_mapping(data: Mapping[str, Any], source: str = "profiles") -> dict[str, ResourceProfile]:
    """Build profiles from ``{"profiles": {name: {field: value}}}``.

    Raises:
        ProfileError: naming ``source`` and the profile at fault.
    """
    tables = data.get("profiles")
    if not isinstance(tables, Mapping) or not tables:
        raise ProfileError(f"{source}: expected [profiles.<name>] tables, e.g. [profiles.gpu] with gpus = 1")
    unknown_top = set(data) - {"profiles", "default"}
    if unknown_top:
        raise ProfileError(
            f"{source}: unknown top-level keys {sorted(unknown_top)}; use [profiles.<name>] and default"
        )
    out: dict[str, ResourceProfile] = {}
    for name, fields in tables.items():
        if not isinstance(fields, Mapping):
            raise ProfileError(f"{source}: [profiles.{name}] must be a table of fields")
        if "name" in fields and fields["name"] != name:
            raise ProfileError(
                f"{source}: [profiles.{name}] sets name = {fields['name']!r}; drop it or make it match"
            )
        try:
            out[name] = ResourceProfile(**{**fields, "name": name})
        except ProfileError as exc:
            raise ProfileError(f"{source}: {exc}") from None
    return out


def load_profiles_file(path: str | Path, origin: str = "") -> tuple[dict[str, ResourceProfile], str | None]:
    """Load profiles (and an optional ``default``) from a TOML file.

    ``origin`` is where the user named the file (``GPU_TASKS_PROFILES_FILE``, a CLI option), for
    the message when it cannot be read.

    Raises:
        ProfileError: the file is missing, is not TOML, or holds a bad profile.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        named = f" ({origin})" if origin else ""
        fix = (
            f"give {origin} an existing TOML file"
            if origin.startswith("-")
            else f"point {origin} at an existing TOML file"
            if origin
            else "give the path of an existing TOML file"
        )
        raise ProfileError(
            f"profiles file {str(path)!r}{named} cannot be read: {exc.strerror}; {fix}"
        ) from None  # the message says all: one line, not two tracebacks, where a flow module fails
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ProfileError(f"profiles file {str(path)!r} is not valid TOML: {exc}") from None
    default = data.get("default")
    if default is not None and not isinstance(default, str):
        raise ProfileError(f"profiles file {str(path)!r}: default must be a profile name string")
    return profiles_from_mapping(data, source=f"profiles file {str(path)!r}"), default


# --------------------------------------------------------------------- in force
def resolve_profiles(
    profiles: Iterable[ResourceProfile] = (),
    default: str | None = None,
    path: str | Path | None = None,
    origin: str = "",
) -> tuple[dict[str, ResourceProfile], str]:
    """The profiles in force and the default profile's name.

    ``profiles`` (from code) come first; those of the TOML file at ``path``
    (``GPU_TASKS_PROFILES_FILE``) are added and override same-named ones. The default
    is ``default``, else the file's ``default``, else :data:`DEFAULT_PROFILE`, which is
    added as a plain CPU profile when no profile has its name. ``origin``: where the user named
    the file (see :func:`load_profiles_file`).

    Raises:
        UnknownProfileError: the default, or a profile's ``on_oom``, names no profile.
        ProfileError: the file is bad, or the default profile asks for GPUs.
    """
    in_force = {p.name: p for p in profiles}
    file_default = None
    if path is not None:
        loaded, file_default = load_profiles_file(path, origin)
        in_force.update(loaded)
    name = default or file_default or DEFAULT_PROFILE
    source = f"profiles file {str(path)!r}: " if default is None and file_default is not None else ""
    if name not in in_force:
        if name != DEFAULT_PROFILE:
            raise UnknownProfileError(
                f"{source}default profile {name!r} is not defined; known profiles: "
                f"{', '.join(sorted(in_force)) or 'none'}"
            )
        in_force[DEFAULT_PROFILE] = ResourceProfile(name=DEFAULT_PROFILE)
    for p in in_force.values():
        if p.on_oom is not None and p.on_oom not in in_force:
            raise UnknownProfileError(
                f"profile {p.name!r} sets on_oom={p.on_oom!r}, which this runner does not know; known "
                "profiles: "
                f"{', '.join(sorted(in_force))}. Add a ResourceProfile(name={p.on_oom!r}, ...) or remove "
                "on_oom"
            )
    if in_force[name].is_gpu:
        raise ProfileError(
            f"{source}default profile {name!r} must be a CPU profile (gpus=0); untagged tasks run there"
        )
    return in_force, name


def profile_sources(
    code: Iterable[ResourceProfile],
    in_force: Mapping[str, ResourceProfile],
    path: str | Path | None,
    from_file: Iterable[str],
    runner_idle_timeout: float | None,
    settings: GpuTasksSettings,
) -> tuple[list[str], list[str]]:
    """Where the profiles in force got their values, as lines for the run log: ``(info, warnings)``.

    The rule (docs/profiles.md, "Where a profile's values come from"): the profiles file replaces
    same-named profiles of the code; a field a profile sets wins; ``ProfileTaskRunner(idle_timeout=)``
    then ``GPU_TASKS_IDLE_TIMEOUT`` fill ``idle_timeout`` where a profile leaves it unset;
    ``GPU_TASKS_PRIORITY`` replaces every GPU profile's priority. A setting given (in the environment,
    e.g. by a deployment's job variables) that changes no profile is a warning.
    """
    info: list[str] = []
    warnings: list[str] = []
    code_names = {p.name for p in code}
    if path is not None:
        names = sorted(from_file)
        replaced = sorted(set(names) & code_names)
        line = f"profiles file {str(path)!r} (GPU_TASKS_PROFILES_FILE): {', '.join(names) or 'no profile'}"
        info.append(line + (f"; replacing the code's {', '.join(replaced)}" if replaced else ""))
    given = settings.model_fields_set
    unset = sorted(n for n, p in in_force.items() if p.idle_timeout is None)
    if "idle_timeout" in given:
        env = f"GPU_TASKS_IDLE_TIMEOUT={settings.idle_timeout:g}"
        if runner_idle_timeout is not None:
            warnings.append(
                f"{env} changes no profile: ProfileTaskRunner(idle_timeout={runner_idle_timeout:g}) is "
                "set in code and comes first; remove one of them"
            )
        elif unset:
            info.append(f"{env} sets idle_timeout of {', '.join(unset)} (profiles that leave it unset)")
        else:
            own = ", ".join(f"{n}={p.idle_timeout:g}s" for n, p in sorted(in_force.items()))
            warnings.append(
                f"{env} changes no profile: every profile sets its own idle_timeout ({own}); remove the "
                "setting, or idle_timeout from the profiles (in code or in GPU_TASKS_PROFILES_FILE)"
            )
    if settings.priority is not None:
        gpu = sorted(n for n, p in in_force.items() if p.is_gpu)
        if gpu:
            info.append(f"GPU_TASKS_PRIORITY={settings.priority} replaces the priority of {', '.join(gpu)}")
        else:
            warnings.append(f"GPU_TASKS_PRIORITY={settings.priority} changes no profile: none asks for GPUs")
    return info, warnings


def requested_profile(task: Any) -> str | None:
    """The profile a task asks for, by one rule wherever it is submitted (the flow, or a task
    running on a worker): its own ``profile:<name>`` tag wins; without one, the profile that the
    ``use_profile`` / ``prefect.tags`` blocks around the submit name (in a worker, its parent's);
    ``None`` when neither names one (the runner's default).

    Raises:
        ProfileError: the task's own tags, or the blocks around it, name two different profiles.
    """
    from prefect.context import TagsContext

    own = profile_from_tags(task.tags)
    if own is not None:
        return own
    tags_ctx = TagsContext.get()
    blocks = tags_ctx.current_tags if tags_ctx else ()
    names = sorted({t[len(TAG_PREFIX) :] for t in blocks if isinstance(t, str) and t.startswith(TAG_PREFIX)})
    if len(names) > 1:
        raise ProfileError(
            f"task {getattr(task, 'name', task)!r} was submitted inside blocks naming several profiles "
            f"({', '.join(names)}) (use_profile / prefect.tags; inside a task, its parent's profile counts "
            "too); give the task its own profile tag, which wins, or keep one block"
        )
    return names[0] if names else None
