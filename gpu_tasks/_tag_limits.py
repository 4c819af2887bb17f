"""How long a task process trusts Prefect's answer "no concurrency limit for these tags".

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
"""

from __future__ import annotations

import logging

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
        longer: cachetools.TTLCache = cachetools.TTLCache(maxsize=cache.maxsize, ttl=seconds)
        for key, value in cache.items():
            longer[key] = value
        services._no_limits_cache = longer
    return float(seconds)
