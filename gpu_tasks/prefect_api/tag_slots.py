"""Prefect tag concurrency slots a GPU task takes in the flow process before it leases a device, so
that no task waits for a slot while it holds one (PrefectHQ/prefect#8539; docs/runner.md)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from gpu_tasks.prefect_api.concurrency_leases import CLOSE_TIMEOUT_S, Answer, LeaseHolder

logger = logging.getLogger("gpu_tasks.runner")

NAME = "gpu-tasks-slots"  # the gate's thread
LEASE_S = 60.0  # the lease Prefect's task engine asks for on tag slots
RENEW_EVERY_S = 20.0  # well inside the lease, so one slow renewal does not lose it
WAIT_LOGGED_S = 30.0  # a wait this long is logged (each RENEW_EVERY_S while it lasts)

PLACEMENT_PREFIX = "tag:gpu:"  # the limits of the gpu:<id> tags a worker adds to its task runs
LIMITS_READ_MAX = 2000  # more than this many limits: not read through, the worker asks as Prefect does


def placement_tags_unlimited() -> bool:
    """Whether no limit exists on the tags a worker adds to its task runs, so it need not ask for their
    slots; ``False`` when unsure (too many limits, no API yet, a failed read): it asks as Prefect does."""
    from gpu_tasks.allocation import EMULATED_TAG
    from gpu_tasks.prefect_api.api import flow_api_url
    from gpu_tasks.prefect_api.quotas import all_limits
    from gpu_tasks.prefect_api.states import no_client_retries

    if flow_api_url() is None:  # no API this process uses yet: never start one just for this
        return False
    try:
        with no_client_retries():
            limits = all_limits(LIMITS_READ_MAX)
        return len(limits) < LIMITS_READ_MAX and not any(
            lim.name.startswith(PLACEMENT_PREFIX) or lim.name == f"tag:{EMULATED_TAG}" for lim in limits
        )
    except Exception as exc:
        logger.debug("gpu-tasks: could not read the concurrency limits (%s); workers ask for theirs", exc)
    return False


def slot_names(tags: Sequence[str] | set[str]) -> list[str]:
    """The concurrency limit names Prefect's engine takes a slot of for a task run with ``tags``."""
    return [f"tag:{t}" for t in sorted(set(tags))]


class Hold:
    """One task run's tag slots: ``waiting``, ``held`` (or ``failed``), ``released``; changed on the
    gate's loop only."""

    def __init__(self, names: list[str], holder_id: uuid.UUID, ctx: contextvars.Context) -> None:
        self.names = names
        self.holder_id = holder_id
        self.ctx = ctx
        self.state = "waiting"
        self.waited = 0.0  # seconds from take() until the slots were granted
        self.limits: list[str] = []  # names of the limits that exist (the others need no slot)
        self.lease_id: uuid.UUID | None = None
        self._asked = time.monotonic()
        self._release_wanted = False
        self._wake: asyncio.Event | None = None

    def __repr__(self) -> str:
        return f"Hold({self.holder_id}, {self.names}, {self.state})"

    def releasing(self) -> bool:
        """Whether :meth:`SlotGate.release` was called for it (a method: mypy would narrow the flag)."""
        return self._release_wanted


class SlotGate:
    """Takes, renews and gives back the tag slots of one runner's GPU tasks."""

    def __init__(self) -> None:
        # its thread starts with the first callback
        self._callbacks = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{NAME}-callback")
        self._leases = LeaseHolder(NAME, LEASE_S, RENEW_EVERY_S, logger, on_tick=self._say_long_waits)
        self._holds: set[Hold] = set()

    def take(
        self,
        names: list[str],
        holder_id: uuid.UUID,
        ctx: contextvars.Context,
        on_ready: Callable[[Hold], Any],
        on_error: Callable[[BaseException], Any],
    ) -> Hold:
        """Start taking ``names`` for task run ``holder_id``; returns at once. ``on_ready(hold)`` or
        ``on_error(exc)`` (neither once released) runs on the gate's callback thread, one at a time."""
        hold = Hold(names, holder_id, ctx.copy())
        try:
            self._leases.submit(lambda: self._acquire(hold, on_ready, on_error), hold.ctx)
        except RuntimeError:
            raise RuntimeError("the task runner is shutting down") from None
        return hold

    def release(self, hold: Hold) -> None:
        """Give ``hold``'s slots back (or stop waiting for them); never blocks; idempotent."""
        if hold.state != "released":  # not running: nothing taken yet, or close() gave it all back
            self._leases.call_soon(self._release_soon, hold)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """End every wait and give back every held slot (within ``timeout``), then stop the thread."""
        self._leases.close(timeout, first=self._stop_all)
        for hold in list(self._holds):  # the loop has stopped: what it left is over
            self._done(hold)
        self._callbacks.shutdown(wait=False, cancel_futures=True)

    def _callback(self, fn: Callable[..., Any], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the gate closed meanwhile
            self._callbacks.submit(self._run_callback, fn, *args)

    @staticmethod
    def _run_callback(fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            logger.warning("gpu-tasks: a tag slot callback failed", exc_info=True)

    async def _acquire(
        self, hold: Hold, on_ready: Callable[[Hold], Any], on_error: Callable[[BaseException], Any]
    ) -> None:
        hold._wake = asyncio.Event()
        self._holds.add(hold)
        try:
            granted = await self._increment(hold)
        except Exception as exc:
            hold.state = "failed"
            self._done(hold)
            if not hold._release_wanted:
                self._callback(on_error, exc)
            return
        if granted is None:  # released (or closed) while waiting
            self._done(hold)
            return
        hold.waited = time.monotonic() - hold._asked
        hold.limits = list(granted.limits)
        hold.lease_id = granted.lease_id
        if not hold.limits:
            from gpu_tasks.compat.prefect import remember_without_limits

            remember_without_limits(hold.names)
        hold.state = "held"
        if hold._release_wanted:  # released while the request was in flight
            await self._give_back(hold)
            return
        self._callback(on_ready, hold)

    async def _increment(self, hold: Hold) -> Answer | None:
        """The server's grant for ``hold``, or ``None`` once it is released while it waits."""
        from gpu_tasks.compat.prefect import known_without_limits

        assert hold._wake is not None
        while not hold.releasing():
            hold._wake.clear()  # before the request: a slot given back while it is out wakes the next try
            # unless: an answer of "no limit" came while this hold waited its turn
            answer = await self._leases.increment(
                hold.names,
                1,
                f"the tag concurrency slots of task run {hold.holder_id}",
                holder=("task_run", hold.holder_id),
                unless=lambda: known_without_limits(hold.names),
            )
            if answer.granted:
                return answer
            if hold.releasing():
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(hold._wake.wait(), answer.retry_after)
        return None

    def _release_soon(self, hold: Hold) -> None:
        if hold.state == "released":
            return
        hold._release_wanted = True
        if hold.state == "waiting":
            if hold._wake is not None:  # not started yet: _acquire sees the flag
                hold._wake.set()  # a wait between tries ends now; a request in flight finishes first
            return
        if hold.state == "held":
            self._leases.spawn(lambda: self._give_back(hold), hold.ctx)
        else:  # failed
            self._done(hold)

    def _stop_all(self) -> None:
        """On close: every wait ends, every held slot is given back."""
        for hold in list(self._holds):
            self._release_soon(hold)

    async def _give_back(self, hold: Hold) -> None:
        lease_id, hold.lease_id = hold.lease_id, None
        if lease_id is not None:
            await self._leases.give_back(lease_id)
        self._done(hold)
        if not hold.limits:  # no waiter can take what this gave back: a map's holds are not scanned
            return
        # a waiter for one of these limits tries again now, not after its Retry-After
        for other in list(self._holds):
            if other.state == "waiting" and other._wake is not None and set(other.names) & set(hold.limits):
                other._wake.set()

    def _done(self, hold: Hold) -> None:
        hold.state = "released"
        self._holds.discard(hold)

    def _say_long_waits(self) -> None:
        """Log the task runs that have waited over ``WAIT_LOGGED_S`` for their slots: nothing waits unseen."""
        now = time.monotonic()
        waiting: dict[tuple[str, ...], list[float]] = {}
        for hold in list(self._holds):
            if hold.state == "waiting" and now - hold._asked >= WAIT_LOGGED_S:
                waiting.setdefault(tuple(hold.names), []).append(now - hold._asked)
        for names, waits in waiting.items():
            logger.info(
                "gpu-tasks: %d task run(s) waiting for Prefect tag concurrency slots (%s), the longest "
                "%.0fs; they hold no device meanwhile",
                len(waits),
                ", ".join(names),
                max(waits),
            )
