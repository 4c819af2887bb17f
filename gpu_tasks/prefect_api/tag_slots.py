"""Prefect tag concurrency slots a GPU task takes in the flow process, before it leases a device.

Prefect's task engine takes a task run's ``tag:<tag>`` slots when the run begins, which
on a worker is after the worker was started on a leased device: a task that waits for a
slot there holds the device all the while (PrefectHQ/prefect#8539). Instead the flow
process takes them first (:class:`SlotGate`), holds them until the task ends, and tells
the worker's engine not to take them again
(:func:`gpu_tasks.compat.prefect.tag_slots_held_by_flow`).

All of one runner's slot traffic runs on one event loop, in a thread of its own, with a
Prefect client of its own. It never calls into Prefect's shared machinery
(``run_coro_as_sync``, the global event loop, the acquisition services and their
instance lock), never blocks the caller, and a wait is a coroutine, not a thread:

- :meth:`SlotGate.take` returns at once; the slots are asked for as Prefect's engine
  asks (``POST /v2/concurrency_limits/increment-with-lease``, one slot per limit, a
  60 s lease, ``holder`` the task run), retried after the server's ``Retry-After``
  while a limit is full, and sooner when this gate gives a slot of the same limit back.
  ``on_ready(hold)`` or ``on_error(exc)`` then runs on the gate's callback thread.
- Held leases are renewed every 20 s (a failed renewal is logged, as Prefect's engine
  does when not strict) and given back by :meth:`SlotGate.release`, from any thread.
- :meth:`SlotGate.close` ends every wait and gives back every held slot within its
  deadline, on every path the runner stops on (flow end, an error, Ctrl-C). A request
  already sent is let finish (each has the client's request timeout) so a slot the server
  grants meanwhile is given back too, rather than left to its lease's expiry.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger("gpu_tasks.runner")

LEASE_S = 60.0  # the lease Prefect's task engine asks for on tag slots
RENEW_EVERY_S = 20.0  # well inside the lease, so one slow renewal does not lose it
RETRY_AFTER_DEFAULT_S = 1.0  # a full limit's answer without a usable Retry-After
CLOSE_TIMEOUT_S = 10.0
WAIT_LOGGED_S = 30.0  # a wait this long is logged (each RENEW_EVERY_S while it lasts)


def slot_names(tags: Sequence[str] | set[str]) -> list[str]:
    """The concurrency limit names Prefect's engine takes a slot of for a task run with ``tags``."""
    return [f"tag:{t}" for t in sorted(set(tags))]


class Hold:
    """One task run's tag slots: ``waiting``, then ``held`` (or ``failed``), then ``released``.

    Changed on the gate's loop only; other threads read ``state``, ``waited`` and ``limits``.
    """

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
        """Whether :meth:`SlotGate.release` was called for it."""
        return self._release_wanted


class SlotGate:
    """Takes, renews and gives back the tag slots of one runner's GPU tasks (see the module doc)."""

    def __init__(self, name: str = "gpu-tasks-slots") -> None:
        self._name = name
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._callbacks: concurrent.futures.ThreadPoolExecutor | None = None
        self._client: Any = None
        self._client_lock: asyncio.Lock | None = None
        self._send_lock: asyncio.Lock | None = None
        self._holds: set[Hold] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    # ------------------------------------------------------------ any thread
    def take(
        self,
        names: list[str],
        holder_id: uuid.UUID,
        ctx: contextvars.Context,
        on_ready: Callable[[Hold], Any],
        on_error: Callable[[BaseException], Any],
    ) -> Hold:
        """Start taking ``names`` for task run ``holder_id``; returns at once.

        ``on_ready(hold)`` runs once the slots are held, ``on_error(exc)`` if they cannot be
        taken; neither runs if the hold is released (or the gate closed) first. Both run on
        the gate's callback thread, one at a time; they should hand long work on.

        Raises:
            RuntimeError: the gate is closed (the runner is stopping).
        """
        hold = Hold(names, holder_id, ctx.copy())
        with self._lock:  # scheduled under the lock: never after close() scheduled its shutdown
            if self._closed:
                raise RuntimeError("the task runner is shutting down")
            loop = self._start(hold.ctx)
            loop.call_soon_threadsafe(self._spawn, self._acquire(hold, on_ready, on_error), hold.ctx)
        return hold

    def release(self, hold: Hold) -> None:
        """Give ``hold``'s slots back (or stop waiting for them); never blocks; idempotent."""
        loop = self._loop
        if loop is None or hold.state == "released":
            return
        try:
            loop.call_soon_threadsafe(self._release_soon, hold)
        except RuntimeError:  # the loop closed: close() gave everything back
            pass

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """End every wait and give back every held slot (within ``timeout``), then stop the thread."""
        with self._lock:
            self._closed = True
            loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        done = asyncio.run_coroutine_threadsafe(self._shutdown(timeout), loop)
        try:
            done.result(timeout + 5)
        except Exception:
            logger.warning("gpu-tasks: giving back Prefect concurrency slots did not finish", exc_info=True)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        if self._callbacks is not None:
            self._callbacks.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ the loop thread
    def _start(self, ctx: contextvars.Context) -> asyncio.AbstractEventLoop:
        """The gate's loop, started on first use (call under ``_lock``); renewals run in ``ctx``
        (the flow run's context, for its Prefect settings)."""
        if self._loop is not None:
            return self._loop
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            try:
                loop.run_forever()
            finally:
                loop.close()

        self._callbacks = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"{self._name}-callback"
        )
        self._thread = threading.Thread(target=run, name=self._name, daemon=True)
        self._thread.start()
        ready.wait()
        self._loop = loop
        self._spawn(self._renew_forever(), ctx.copy(), threadsafe=True)
        return loop

    def _spawn(self, coro: Any, ctx: contextvars.Context, threadsafe: bool = False) -> None:
        loop = self._loop
        assert loop is not None
        if threadsafe:
            loop.call_soon_threadsafe(self._spawn, coro, ctx)
            return
        task = loop.create_task(coro, context=ctx)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _callback(self, fn: Callable[..., Any], *args: Any) -> None:
        executor = self._callbacks
        try:
            assert executor is not None
            executor.submit(self._run_callback, fn, *args)
        except RuntimeError:  # the gate closed meanwhile
            pass

    @staticmethod
    def _run_callback(fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            logger.warning("gpu-tasks: a tag slot callback failed", exc_info=True)

    def _one_at_a_time(self) -> asyncio.Lock:
        """The gate's requests go out one at a time: two slot writes at once on a Prefect server's
        SQLite database kept the second waiting about 2 s for the first one's write lock (prefect
        3.8.8), which a task waiting for a slot then added to its wait."""
        if self._send_lock is None:
            self._send_lock = asyncio.Lock()
        return self._send_lock

    async def _api(self) -> Any:
        """The gate's Prefect client, built on first use (in the flow run's context, as every task
        on the loop runs in it)."""
        if self._client_lock is None:
            self._client_lock = asyncio.Lock()
        async with self._client_lock:
            if self._client is None:
                client = _new_client()
                await client.__aenter__()
                self._client = client
        return self._client

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
        hold.limits = [limit["name"] for limit in granted.get("limits") or ()]
        if hold.limits:
            hold.lease_id = uuid.UUID(str(granted["lease_id"]))
        else:
            from gpu_tasks.compat.prefect import remember_without_limits

            remember_without_limits(hold.names)
        hold.state = "held"
        if hold._release_wanted:  # released while the request was in flight
            await self._give_back(hold)
            return
        self._callback(on_ready, hold)

    async def _increment(self, hold: Hold) -> dict[str, Any] | None:
        """The server's grant for ``hold``, or ``None`` once it is released while it waits."""
        import httpx
        from prefect.client.schemas.objects import ConcurrencyLeaseHolder

        from gpu_tasks.compat.prefect import known_without_limits

        client = await self._api()
        holder = ConcurrencyLeaseHolder(type="task_run", id=hold.holder_id)
        assert hold._wake is not None
        while not hold.releasing():
            # cleared before the request: a slot given back while it is out wakes the next try
            hold._wake.clear()
            try:
                async with self._one_at_a_time():
                    if known_without_limits(hold.names):
                        # an answer that came while this hold waited its turn (a map's tasks all
                        # queue here when the cached answer expires): no limit, nothing to take
                        return {"limits": []}
                    response = await client.increment_concurrency_slots_with_lease(
                        names=hold.names, slots=1, mode="concurrency", lease_duration=LEASE_S, holder=holder
                    )
                return dict(response.json())
            except httpx.HTTPStatusError as exc:
                if exc.response.status_code != 423:  # 423: a limit is full
                    raise
                delay = _retry_after(exc.response.headers.get("Retry-After"))
            if hold.releasing():
                break
            try:
                await asyncio.wait_for(hold._wake.wait(), delay)
            except TimeoutError:
                pass
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
            self._spawn(self._give_back(hold), hold.ctx)
        else:  # failed
            self._done(hold)

    async def _give_back(self, hold: Hold) -> None:
        lease_id, hold.lease_id = hold.lease_id, None
        if lease_id is not None:
            try:
                client = await self._api()
                async with self._one_at_a_time():
                    await client.release_concurrency_slots_with_lease(lease_id)
            except Exception:
                logger.warning(
                    "gpu-tasks: could not give back the Prefect concurrency slots of task run %s (%s); "
                    "they are free again when their lease expires (%gs)",
                    hold.holder_id,
                    ", ".join(hold.limits),
                    LEASE_S,
                    exc_info=True,
                )
        self._done(hold)
        # a waiter of this gate for one of these limits tries again now, not after its Retry-After
        for other in list(self._holds):
            if other.state == "waiting" and other._wake is not None and set(other.names) & set(hold.limits):
                other._wake.set()

    def _done(self, hold: Hold) -> None:
        hold.state = "released"
        self._holds.discard(hold)

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(RENEW_EVERY_S)
            self._say_long_waits()
            held = [h for h in list(self._holds) if h.state == "held" and h.lease_id is not None]
            if held:
                await asyncio.gather(*(self._renew(h) for h in held))

    def _say_long_waits(self) -> None:
        """Log the task runs that have waited over ``WAIT_LOGGED_S`` for their slots (nothing waits
        unseen: a full limit, or a server that does not answer)."""
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

    async def _renew(self, hold: Hold) -> None:
        lease_id = hold.lease_id
        if lease_id is None:
            return
        try:
            client = await self._api()
            async with self._one_at_a_time():
                await client.renew_concurrency_lease(lease_id, LEASE_S)
        except Exception:
            logger.warning(
                "gpu-tasks: renewing the Prefect concurrency slots of task run %s (%s) failed; other "
                "task runs may take them when the lease expires",
                hold.holder_id,
                ", ".join(hold.limits),
                exc_info=True,
            )

    async def _shutdown(self, timeout: float) -> None:
        """Stop waits, give back held slots, close the client; whatever is left after ``timeout`` is
        cancelled (its lease, if the server granted one, expires by itself)."""
        for hold in list(self._holds):
            self._release_soon(hold)
        current = asyncio.current_task()
        pending = {t for t in self._tasks if t is not current and not _is_renewal(t)}
        if pending:
            _, late = await asyncio.wait(pending, timeout=timeout)
            for task in late:
                task.cancel()
            if late:
                logger.warning(
                    "gpu-tasks: %d Prefect concurrency slot request(s) still unanswered after %gs; any "
                    "slot the server grants them is free again when its lease expires (%gs)",
                    len(late),
                    timeout,
                    LEASE_S,
                )
        for task in list(self._tasks):
            if task is not current:
                task.cancel()
        for hold in list(self._holds):
            self._done(hold)
        if self._client is not None:
            try:
                await self._client.__aexit__(None, None, None)
            except Exception:
                logger.debug("gpu-tasks: closing the slot gate's Prefect client failed", exc_info=True)
            self._client = None


def _is_renewal(task: asyncio.Task[Any]) -> bool:
    return getattr(task.get_coro(), "__name__", "") == "_renew_forever"


def _retry_after(value: str | None) -> float:
    try:
        delay = float(value) if value is not None else RETRY_AFTER_DEFAULT_S
    except ValueError:
        delay = RETRY_AFTER_DEFAULT_S
    return max(0.05, delay)


def _new_client() -> Any:
    """A Prefect client for the flow run's API (its URL, credentials and client settings).

    Built directly rather than with ``get_client()``, which in Prefect's serverless mode
    would start a server of its own when the URL is in no setting.
    """
    from prefect.client.orchestration import PrefectClient
    from prefect.settings import get_current_settings

    from gpu_tasks.prefect_api.api import require_flow_api_url

    settings = get_current_settings()
    key, auth = settings.api.key, settings.api.auth_string
    return PrefectClient(
        require_flow_api_url("(tag concurrency slots)"),
        api_key=key.get_secret_value() if key else None,
        auth_string=auth.get_secret_value() if auth else None,
    )
