"""The tag that sends a task to a profile: ``profile:<name>``, from a task's tags or a block."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from gpu_tasks.errors import ProfileError
from gpu_tasks.profiles.model import _NAME_RE, TAG_PREFIX


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


def requested_profile(task: Any) -> str | None:
    """The profile a task's own tags and the enclosing ``prefect.tags`` blocks name, if any.

    Raises:
        ProfileError: they name two different profiles.
    """
    from prefect.context import TagsContext

    tags_ctx = TagsContext.get()
    return profile_from_tags(set(task.tags) | set(tags_ctx.current_tags if tags_ctx else ()))
