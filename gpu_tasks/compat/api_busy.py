"""Waiting out a busy Prefect API, so that a busy server is never a failed task run
(docs/operations.md, "Failure behaviour").
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

from gpu_tasks.settings import get_settings

logger = logging.getLogger(__name__)

BUSY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
FIRST_WAIT_S = 1.0


def busy_reason(exc: BaseException) -> str | None:
    """Why ``exc`` (or an error it was raised from) is a busy or unreachable API; else ``None``."""
    import httpx

    seen: set[int] = set()
    err: BaseException | None = exc
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, httpx.HTTPStatusError) and err.response.status_code in BUSY_STATUS:
            return f"{err.response.status_code} {err.response.reason_phrase}".strip()
        if isinstance(err, httpx.TimeoutException | httpx.NetworkError | httpx.RemoteProtocolError):
            return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        err = err.__cause__ or err.__context__
    return None


@dataclass
class BusyWait:
    """The waits between tries of one request to a busy API: 1 s, doubling to ``longest``, each
    shortened by up to a fifth at random, until ``timeout`` seconds have passed since the first refusal."""

    what: str
    timeout: float = field(default_factory=lambda: get_settings().api_busy_timeout)
    longest: float = field(default_factory=lambda: get_settings().api_longest_wait)
    tries: int = 0
    started: float = field(default_factory=time.monotonic)

    def next_wait(self, exc: BaseException, log: Any = None) -> float:
        """Seconds to wait before asking again; raises ``exc`` when not a busy API's or time is up."""
        reason = busy_reason(exc)
        waited = time.monotonic() - self.started
        log = log or logger
        if reason is None:
            raise exc
        if waited >= self.timeout:
            log.error(
                "gpu-tasks: the Prefect API still refuses %s after %.0f s (%s); giving up "
                "(GPU_TASKS_TUNE_API_BUSY_TIMEOUT=%g)",
                self.what,
                waited,
                reason,
                self.timeout,
            )
            raise exc
        # the jitter shortens, never lengthens: a wait is at most ``longest`` (it reached 1.2 x that)
        wait = min(self.longest, FIRST_WAIT_S * 2.0**self.tries) * random.uniform(0.8, 1.0)
        wait = max(0.0, min(wait, self.timeout - waited))
        self.tries += 1
        log.warning(
            "gpu-tasks: the Prefect API is busy (%s) for %s; asking again in %.1f s (try %d, %.0f s of "
            "GPU_TASKS_TUNE_API_BUSY_TIMEOUT=%g waited)",
            reason,
            self.what,
            wait,
            self.tries + 1,
            waited,
            self.timeout,
        )
        return wait
