"""The tag that sends a task to a profile: ``profile:<name>``, from a task's tags or a block."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from gpu_tasks.errors import ProfileError
from gpu_tasks.profiles.model import _NAME_RE, TAG_PREFIX


def profile_tag(name: str) -> str:
    """The tag that sends a task to profile ``name``: ``profile_tag("gpu") == "profile:gpu"``."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ProfileError(f"profile name {name!r} is not valid: use letters, digits, '_', '.', '-'")
    return f"{TAG_PREFIX}{name}"


profile = profile_tag  # its first name, kept: tags=[profile("gpu")] works as before


def profile_from_tags(tags: Iterable[str]) -> str | None:
    """The profile named by ``profile:<name>`` tags, or ``None``; ``ProfileError`` when they name two."""
    names = _profile_names(tags)
    if len(names) > 1:
        raise ProfileError(
            f"a task carries tags for several profiles ({', '.join(names)}); keep exactly one "
            "profile:<name> tag"
        )
    return next(iter(names), None)


def _profile_names(tags: Iterable[str]) -> list[str]:
    """The distinct profile names of ``profile:<name>`` tags, sorted."""
    return sorted({t[len(TAG_PREFIX) :] for t in tags if isinstance(t, str) and t.startswith(TAG_PREFIX)})


@contextlib.contextmanager
def use_profile(name: str) -> Iterator[None]:
    """Send every task submitted inside the block to profile ``name`` (a ``prefect.tags`` block)."""
    from prefect import tags

    with tags(profile(name)):
        yield


def requested_profile(task: Any) -> str | None:
    """The profile a task asks for: its own ``profile:<name>`` tag, else the one the ``use_profile`` /
    ``prefect.tags`` blocks around the submit name, else ``None`` (the runner's default)."""
    from prefect.context import TagsContext

    own = profile_from_tags(task.tags)
    if own is not None:
        return own
    tags_ctx = TagsContext.get()
    names = _profile_names(tags_ctx.current_tags if tags_ctx else ())
    if len(names) > 1:
        raise ProfileError(
            f"task {getattr(task, 'name', task)!r} was submitted inside blocks naming several profiles "
            f"({', '.join(names)}) (use_profile / prefect.tags; inside a task, its parent's profile counts "
            "too); give the task its own profile tag, which wins, or keep one block"
        )
    return names[0] if names else None
