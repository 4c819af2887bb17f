"""The tag that sends a task to a profile: ``profile:<name>``, from a task's tags or a block."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

from gpu_tasks.errors import ProfileError, UnknownProfileError
from gpu_tasks.profiles.model import _NAME_RE, NAME_RULE, TAG_PREFIX


def profile_tag(name: str) -> str:
    """The tag that sends a task to profile ``name``: ``profile_tag("gpu") == "profile:gpu"``."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ProfileError(f"profile name {name!r} is not valid: {NAME_RULE}")
    return f"{TAG_PREFIX}{name}"


profile = profile_tag  # its first name, kept: tags=[profile("gpu")] works as before


def profile_from_tags(tags: Iterable[str], task: Any = None) -> str | None:
    """The profile named by ``profile:<name>`` tags, or ``None``; ``ProfileError`` when they name two,
    ``UnknownProfileError`` for a bare ``profile:`` (``task``: the task carrying them, named in both)."""
    who = f"task {getattr(task, 'name', task)!r}" if task is not None else "a task"
    names = _profile_names(tags, who)
    if len(names) > 1:
        raise ProfileError(
            f"{who} carries tags for several profiles ({', '.join(names)}); keep exactly one "
            "profile:<name> tag"
        )
    return next(iter(names), None)


def is_profile_tag(tag: Any) -> bool:
    """Whether ``tag`` is a ``profile:<name>`` tag; the prefix is read in any case (``Profile:gpu``
    too): a tag meant for a profile is never silently ignored."""
    return isinstance(tag, str) and tag[: len(TAG_PREFIX)].lower() == TAG_PREFIX


def _profile_names(tags: Iterable[str], who: str) -> list[str]:
    """The distinct profile names of ``profile:<name>`` tags, sorted; ``who`` carries them. The prefix
    is read in any case (``Profile:gpu`` too): a tag meant for a profile is never silently ignored."""
    ours = (t for t in tags if is_profile_tag(t))
    names = sorted({t[len(TAG_PREFIX) :] for t in ours})
    if names[:1] == [""]:  # e.g. f"profile:{name}" with an empty name: never the default profile silently
        raise UnknownProfileError(
            f"{who} carries the tag {TAG_PREFIX!r}, which names no profile; put a profile's name after "
            f"it ({TAG_PREFIX}<name>, or profile(name)), or drop the tag to run on the default profile"
        )
    return names


def unknown_profile_fix(name: str, known: Iterable[str]) -> str:
    """The fix for a tag naming profile ``name``, which is not in ``known``: the profile it nearly
    names (another case, spaces around it), else the naming rule it breaks, else to define it."""
    near = [k for k in sorted(known) if k.casefold() == name.strip().casefold()]
    if near:
        return f"Did you mean {near[0]!r}? Tag the task {TAG_PREFIX}{near[0]} (names are case-sensitive)"
    if not _NAME_RE.match(name):
        return f"{name!r} is not a valid profile name: fix the tag; a name must {NAME_RULE}"
    return (
        f"Add a ResourceProfile(name={name!r}, ...) to ProfileTaskRunner(profiles=[...]) or to "
        "GPU_TASKS_PROFILES_FILE"
    )


def use_profile(name: str) -> contextlib.AbstractContextManager[Any]:
    """Send every task submitted inside the block to profile ``name`` (a ``prefect.tags`` block); the
    name is checked here, at the call."""
    from prefect import tags

    return tags(profile(name))


def requested_profile(task: Any) -> str | None:
    """The profile a task asks for: its own ``profile:<name>`` tag, else the one the ``use_profile`` /
    ``prefect.tags`` blocks around the submit name, else ``None`` (the runner's default)."""
    from prefect.context import TagsContext

    own = profile_from_tags(task.tags, task)
    if own is not None:
        return own
    tags_ctx = TagsContext.get()
    name = getattr(task, "name", task)
    names = _profile_names(tags_ctx.current_tags if tags_ctx else (), f"a block around task {name!r}")
    if len(names) > 1:
        raise ProfileError(
            f"task {name!r} was submitted inside blocks naming several profiles "
            f"({', '.join(names)}) (use_profile / prefect.tags; inside a task, its parent's profile counts "
            "too); give the task its own profile tag, which wins, or keep one block"
        )
    return names[0] if names else None
