"""Waiting out a busy Prefect API: what gpu-tasks asks of it, or causes, is never a failed task run
because the server was busy for a while.

Prefect's client retries a refusal (408, 429, 502, 503) or a dropped connection a few times
(``PREFECT_CLIENT_MAX_RETRIES``, 5 by default: about a minute with its backoff); a busy embedded
SQLite server under tens of thousands of task runs refuses for longer than that. gpu-tasks then
waits and asks again, with a warning in the log each time it waits, for up to
``GPU_TASKS_TUNE_API_BUSY_TIMEOUT`` seconds (default 600) before it gives the error up:

- the tag-slot check Prefect's task engine makes before every task run gpu-tasks runs (its own
  placement tags, ``gpu:<id>`` and ``gpu-tasks:emulated``, are on every task), on the worker;
- the tag slots the flow process takes for a task before its device is leased
  (:mod:`gpu_tasks.prefect_api.concurrency_leases`).

A refusal that is an answer (401, 403, 404, 422: wrong address, key or request) is not waited
out: it is raised at once.

**Prefect's own waits, capped** (:func:`gpu_tasks.compat.prefect_client.cap_client_waits`). Prefect's
client waits ``2**n`` s (with jitter) before its n-th try of a refused request, with no upper bound: with
``PREFECT_CLIENT_MAX_RETRIES=10`` (what the embedded server gives its clients) one wait can be
512 or 1024 s. A task run's request refused six times while ten flow runs loaded the embedded
server waited 61 s after the sixth, on a worker holding a device with nothing running (measured
with ``bench.many_flows``: a device held 126 s, and 460 s at 10 x 1,000, before its first task).
In gpu-tasks' worker processes (every request) and in the task runs gpu-tasks runs, each such
wait is at most ``GPU_TASKS_TUNE_API_LONGEST_WAIT`` s (default 30, the same cap as gpu-tasks' own waits
above), so a worker asks again within that long after the API recovers; Prefect's number of tries
is unchanged. The flow process's other requests wait as Prefect ships. Waits a server asks for
(``Retry-After``) are kept, and with ``PREFECT_CLIENT_RETRY_JITTER_FACTOR=0`` Prefect's waits are
not capped.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

BUSY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
FIRST_WAIT_S = 1.0


def busy_reason(exc: BaseException) -> str | None:
    """Why ``exc`` (or an error it was raised from) is a busy or unreachable API, to wait out;
    ``None`` when it is anything else."""
    import httpx

    seen: set[int] = set()
    err: BaseException | None = exc
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, httpx.HTTPStatusError) and err.response.status_code in BUSY_STATUS:
            reason = err.response.reason_phrase
            return f"{err.response.status_code} {reason}".strip()
        if isinstance(err, httpx.TimeoutException | httpx.NetworkError | httpx.RemoteProtocolError):
            return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        err = err.__cause__ or err.__context__
    return None


@dataclass
class BusyWait:
    """The waits between tries of one request to a busy API: 1 s, doubling to ``longest``
    (``GPU_TASKS_TUNE_API_LONGEST_WAIT``, 30 s), with jitter, until ``timeout`` seconds have passed since
    the first refusal."""

    what: str
    timeout: float
    longest: float = field(default_factory=lambda: longest_wait())  # the longest wait between two tries
    tries: int = 0
    started: float = field(default_factory=time.monotonic)

    def next_wait(self, exc: BaseException, log: Any = None) -> float:
        """Seconds to wait before asking again; raises ``exc`` when it is not a busy API's refusal
        or the time is up."""
        reason = busy_reason(exc)
        waited = time.monotonic() - self.started
        if reason is None:
            raise exc
        if waited >= self.timeout:
            (log or logger).error(
                "gpu-tasks: the Prefect API still refuses %s after %.0f s (%s); giving up "
                "(GPU_TASKS_TUNE_API_BUSY_TIMEOUT=%g)",
                self.what,
                waited,
                reason,
                self.timeout,
            )
            raise exc
        wait = min(self.longest, FIRST_WAIT_S * 2.0**self.tries) * random.uniform(0.8, 1.2)
        wait = max(0.0, min(wait, self.timeout - waited))
        self.tries += 1
        (log or logger).warning(
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


def longest_wait() -> float:
    """``GPU_TASKS_TUNE_API_LONGEST_WAIT`` (seconds) from this process's environment."""
    from gpu_tasks.settings import get_settings

    longest: float = get_settings().api_longest_wait
    return longest


def busy_timeout() -> float:
    """``GPU_TASKS_TUNE_API_BUSY_TIMEOUT`` (seconds) from this process's environment."""
    from gpu_tasks.settings import get_settings

    timeout: float = get_settings().api_busy_timeout
    return timeout
