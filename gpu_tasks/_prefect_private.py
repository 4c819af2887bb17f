"""The private Prefect APIs gpu-tasks relies on, each with why and the versions checked.

Checked against prefect 3.8.8 (pinned in pyproject.toml). Each wrapper degrades to
Prefect's shipped behaviour, or fails with a clear error, on a release where the
private name is gone, so a Prefect upgrade breaks here, in one place.

**The tag "no limits" cache** (``prefect.concurrency.services._no_limits_cache``).
Prefect's task engine asks the server for tag concurrency slots before every task
run that has tags, and every gpu-tasks task run has tags (``profile:<name>``,
``gpu:<id>``). Prefect caches a "no limits for this tag set" answer per process
for 5 seconds. Each time that cache expires, the next check goes to the server,
and on a busy SQLite server (thousands of short tasks, the task-run recorder
writing) every task carrying the same tags waits behind that one request. Measured
on 2 cores with 10,000 tagged tasks on Prefect's own ThreadPoolTaskRunner: 141 s
with the 5 s cache, 53 s (linear in the task count) with a longer one.

gpu-tasks lengthens that cache in the flow process and in its worker processes to
``GPU_TASKS_TAG_LIMIT_CACHE_SECONDS`` (default 60; 0 keeps Prefect's). Limits that
exist when a tag set is first checked are always honoured, since only "no limits"
answers are cached; a limit created in the middle of a run applies within that many
seconds instead of 5. The cache is a private part of Prefect: when it is not found
(another Prefect release), nothing is changed and Prefect behaves as it ships.

**The in-process ephemeral server** (``SubprocessASGIServer._instances``): see
:func:`ephemeral_server_url`.

**The deployment context** (``prefect.context._deployment_id`` and
``_deployment_parameters``): see :func:`deployment_context`.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def extend_no_limits_cache(seconds: float) -> float | None:
    """Make Prefect's per-process "no tag limits" cache keep answers ``seconds`` long.

    Never shortens it. Returns the cache's time-to-live afterwards, or ``None`` when
    this Prefect has no such cache (nothing changed).
    """
    try:
        import cachetools
        from prefect.concurrency import services
    except ImportError:  # pragma: no cover - prefect always brings cachetools
        return None
    cache = getattr(services, "_no_limits_cache", None)
    lock = getattr(services, "_cache_lock", None)
    if not isinstance(cache, cachetools.TTLCache) or lock is None:
        logger.debug("gpu-tasks: Prefect has no tag 'no limits' cache here; leaving tag checks as they are")
        return None
    if seconds <= cache.ttl:
        return float(cache.ttl)
    with lock:
        longer: cachetools.TTLCache[Any, Any] = cachetools.TTLCache(maxsize=cache.maxsize, ttl=seconds)
        for key, value in cache.items():
            longer[key] = value
        services._no_limits_cache = longer
    return float(seconds)


def ephemeral_server_url() -> str | None:
    """The URL of the ephemeral API server this process started, if one runs.

    Prefect's client starts a ``SubprocessASGIServer`` when there is no
    ``PREFECT_API_URL`` and keeps its URL in no setting; Prefect keeps one instance
    per requested port (the default client asks for port ``None``) in the private
    ``_instances``. Any running instance in this process is the one the flow run
    talks to; the default-port one is preferred.
    """
    from prefect.server.api.server import SubprocessASGIServer

    instances = getattr(SubprocessASGIServer, "_instances", None)
    if not isinstance(instances, dict):  # pragma: no cover - another Prefect release
        logger.debug("gpu-tasks: Prefect has no SubprocessASGIServer._instances here")
        return None
    servers = sorted(instances.values(), key=lambda s: getattr(s, "_instance_key", None) is not None)
    for server in servers:
        process = server.server_process
        if server.running and process is not None and process.poll() is None:
            return str(server.api_url)
    return None


def deployment_context() -> tuple[str | None, Any]:
    """The deployment id (as a string) and parameters of the run in this context.

    Prefect's ``serialize_context`` sends them to remote task runs from the private
    context variables ``_deployment_id`` and ``_deployment_parameters``; gpu-tasks
    serializes context itself (``gpu_tasks._context``) and sends the same.
    """
    from prefect import context as pctx

    deployment_id = pctx._deployment_id.get()
    return (str(deployment_id) if deployment_id else None), pctx._deployment_parameters.get()
