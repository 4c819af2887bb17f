"""Renewing gpu-tasks' "no tag limits" answers before they expire, so a long map's task runs never all
miss at once and queue behind Prefect's own check (docs/runner.md, "Tagged task runs")."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

from gpu_tasks.compat.prefect import remembered_tag_sets, renew_answers
from gpu_tasks.prefect_api.api import ephemeral_api_url, last_ephemeral_api_url

logger = logging.getLogger(__name__)

_STARTED: dict[str, int] = {}
_LOCK = threading.Lock()


def start_renewing(profile: Any = None, settings: Any = None) -> None:
    """Start this process's renewing thread (once per process, forked children too), for the server of
    ``settings`` (a worker's, from its flow run), else of the settings in force now."""
    from prefect.context import SettingsContext

    if settings is None:
        found = SettingsContext.get()
        if found is None:
            return
        profile, settings = found.profile, found.settings
        if not settings.api.url:  # on the ephemeral API: remember its URL for the thread, which runs
            ephemeral_api_url()  # outside the run's context
    with _LOCK:
        if _STARTED.get("pid") == os.getpid():
            return
        _STARTED["pid"] = os.getpid()
    threading.Thread(
        target=_renew_forever, args=(profile, settings), name="gpu-tasks-tag-limits", daemon=True
    ).start()


def _renew_forever(profile: Any, settings: Any) -> None:
    from prefect.context import SettingsContext

    while True:
        # a third of the time-to-live: a read may take up to that long under load and still renew
        time.sleep(max(0.5, (remembered_tag_sets()[0] or 60.0) / 3))
        try:
            server = _with_server(settings)
            if server is None:  # no server to ask (none started yet): the answers expire as they would
                continue
            with SettingsContext(profile=profile, settings=server):
                refresh_no_limits()
        except Exception:  # a busy or unreachable server: the answers expire as they would
            logger.debug("gpu-tasks: could not renew the 'no tag limits' answers", exc_info=True)


def _with_server(settings: Any) -> Any:
    """``settings`` if they name a server, else a copy naming the ephemeral server this process last
    used (``None`` if none): settings without an address would start another server."""
    if settings.api.url:
        return settings
    url = last_ephemeral_api_url()
    if url is None:
        return None
    return settings.model_copy(update={"api": settings.api.model_copy(update={"url": url})})


def read_without_limits(names: list[str]) -> bool:
    """Whether none of ``names`` has a limit, read (no slot taken) from the server of :func:`_with_server`."""
    from prefect.context import SettingsContext

    found = SettingsContext.get()
    server = _with_server(found.settings) if found is not None else None
    if found is None or server is None:
        raise RuntimeError("no Prefect server to read tag concurrency limits from")
    with SettingsContext(profile=found.profile, settings=server):
        return not limited_names(names)


def refresh_no_limits() -> tuple[int, int]:
    """Renew the answers whose tag sets still have no limit, drop the others: (renewed, dropped)."""
    keys = remembered_tag_sets()[1]
    if not keys:
        return 0, 0
    limited = limited_names({n for key in keys for n in key})
    drop = [key for key in keys if key & limited]
    return renew_answers([key for key in keys if not key & limited], drop), len(drop)


def limited_names(names: Iterable[str]) -> set[str]:
    """The concurrency limits among ``names`` that exist on the server now: a read each, no slot taken."""
    from prefect.exceptions import ObjectNotFound

    from gpu_tasks.prefect_api.api import sync_client

    limited: set[str] = set()
    with sync_client() as client:
        for name in sorted(set(names)):
            try:
                client.read_global_concurrency_limit_by_name(name)
            except ObjectNotFound:
                continue
            limited.add(name)
    return limited
