"""Which profiles are in force: the code's, a TOML file's (``GPU_TASKS_PROFILES_FILE``), the default."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpu_tasks.errors import ProfileError, UnknownProfileError
from gpu_tasks.profiles.model import WARN_AT, ResourceProfile

if TYPE_CHECKING:
    from gpu_tasks.settings import GpuTasksSettings

DEFAULT_PROFILE = "cpu"  # untagged tasks run here; added as a plain CPU profile when not defined


def profiles_from_mapping(
    data: Mapping[str, Any], source: str = "profiles", text: str | None = None, path: str | None = None
) -> dict[str, ResourceProfile]:
    """Build profiles from ``{"profiles": {name: {field: value}}}``; a ``ProfileError`` names ``source``
    and, given ``text`` (the TOML they came from), the line at fault; a warning names ``path``, the
    file, and its line."""
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

        def at(field: tuple[str, ...] = (), name: str = name) -> str:
            line = None if text is None else line_of(text, ("profiles", name, *field))
            return source if line is None else f"{source}, line {line}"

        if not isinstance(fields, Mapping):
            raise ProfileError(f"{at()}: [profiles.{name}] must be a table of fields")
        if "name" in fields and fields["name"] != name:
            raise ProfileError(
                f"{at(('name',))}: [profiles.{name}] sets name = {fields['name']!r}; drop it or make it match"
            )
        where = None  # the old spelling's FutureWarning names the file's line (WARN_AT)
        if path is not None and "gpu_memory" in fields:
            where = (path, (text and line_of(text, ("profiles", name, "gpu_memory"))) or 0)
        token = WARN_AT.set(where)
        try:
            out[name] = ResourceProfile(**{**fields, "name": name})
        except ProfileError as exc:
            field = exc.fields[0] if exc.fields else ()
            raise ProfileError(f"{at(field or _named_first(str(exc)))}: {exc}") from None
        finally:
            WARN_AT.reset(token)
    return out


def _named_first(message: str) -> tuple[str, ...]:
    """For a rule across fields (``profile 'x': quota applies to ...``), the field it names first,
    whose line a file's message gives; ``()`` when it starts with none."""
    first = message.split(": ", 1)[-1].split(" ", 1)[0]
    return (first,) if first in ResourceProfile.model_fields else ()


def line_of(text: str, path: tuple[str, ...]) -> int | None:
    """The line (from 1) of TOML ``text`` that sets the key at ``path``, else of the nearest table or
    key above it; ``None`` if none. A plain scan, for error messages."""

    def parts(key: str) -> tuple[str, ...]:
        return tuple(p.strip().strip("\"'") for p in key.split("."))

    table: tuple[str, ...] = ()
    best: tuple[int, int] | None = None  # (how much of path it covers, line)
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        header = re.match(r"^\[\[?([^\]]+)\]\]?", line)
        if header:
            table = parts(header.group(1))
            found = table
        else:
            key = re.match(r"^([A-Za-z0-9_\-.\"' ]+?)\s*=", line)
            if not key:
                continue
            found = table + parts(key.group(1))
        covered = len(found) if path[: len(found)] == found else 0
        if covered == len(path):
            return number
        if covered >= 2 and (best is None or covered > best[0]):
            best = (covered, number)
    return None if best is None else best[1]


def load_profiles_file(path: str | Path, origin: str = "") -> tuple[dict[str, ResourceProfile], str | None]:
    """Load profiles (and an optional ``default``) from a TOML file; ``origin``: where the user named
    it (``GPU_TASKS_PROFILES_FILE``, a CLI option).

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
        ) from None  # one line, not two tracebacks, where a flow module fails
    try:
        text = raw.decode("utf-8")
        data = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ProfileError(f"profiles file {str(path)!r} is not valid TOML: {exc}") from None
    default = data.get("default")
    if default is not None and not isinstance(default, str):
        raise ProfileError(f"profiles file {str(path)!r}: default must be a profile name string")
    return profiles_from_mapping(data, f"profiles file {str(path)!r}", text, str(path)), default


def resolve_profiles(
    profiles: Iterable[ResourceProfile] = (),
    default: str | None = None,
    path: str | Path | None = None,
    origin: str = "",
) -> tuple[dict[str, ResourceProfile], str]:
    """The profiles in force (``profiles`` overridden by the file at ``path``) and the default's name:
    ``default``, else the file's, else :data:`DEFAULT_PROFILE`."""
    in_force = {p.name: p for p in profiles}
    file_default = None
    if path is not None:
        loaded, file_default = load_profiles_file(path, origin)
        in_force.update(loaded)
    name = default or file_default or DEFAULT_PROFILE
    source = f"profiles file {str(path)!r}: " if default is None and file_default is not None else ""
    known = ", ".join(sorted(in_force)) or "none"
    # the file's default is checked even where default= replaces it: `gpu-tasks profiles --file` rejects it
    if file_default not in (*in_force, DEFAULT_PROFILE, None):
        raise UnknownProfileError(
            f"profiles file {str(path)!r}: default profile {file_default!r} is not defined; known "
            f"profiles: {known}; add [profiles.{file_default}] to the file or change its default"
        )
    if name not in in_force:
        if name != DEFAULT_PROFILE:
            raise UnknownProfileError(
                f"default profile {name!r} is not defined; known profiles: {known}; define it "
                f"(ResourceProfile(name={name!r}, ...) in profiles=[...]) or change default="
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
    """Where the profiles in force got their values, as run log lines ``(info, warnings)``; a setting
    that changes no profile is a warning."""
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
