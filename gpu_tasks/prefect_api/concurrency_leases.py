"""Prefect concurrency leases: slots taken under a lease, renewed while held, given back; the one
holder tag slots and team quotas both use (docs/runner.md, "Tag concurrency slots")."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import logging
import threading
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

MIN_LEASE_S = 60.0  # Prefect's smallest lease
RETRY_AFTER_DEFAULT_S = 1.0  # a full limit's answer without a usable Retry-After
CLOSE_TIMEOUT_S = 10.0
RELEASE_WAIT_S = 30.0  # how long release() waits; the give-back goes on after that


@dataclass(frozen=True)
class Answer:
    """The server's answer to one slot request."""

    granted: bool
    lease_id: uuid.UUID | None = None  # granted with slots of limits that exist: their lease, now held
    limits: tuple[str, ...] = ()  # the limits that exist (the others need no slot)
    retry_after: float = 0.0  # not granted (a limit is full): seconds the server asks to wait


class LeaseHolder:
    """Takes, renews (every ``renew_every_s``, default a third of ``lease_s``) and gives back leases on
    a loop thread ``name`` of its own; ``on_tick`` runs on it each period, before the renewals."""

    def __init__(
        self,
        name: str,
        lease_s: float,
        renew_every_s: float | None = None,
        log: logging.Logger | None = None,
        on_tick: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self.lease_s = float(lease_s)
        self.renew_every_s = float(renew_every_s) if renew_every_s is not None else self.lease_s / 3
        self.log = log or logging.getLogger(__name__)
        self._on_tick = on_tick
        self._lock = threading.Lock()
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ctx: contextvars.Context | None = None  # the first caller's: renewals and the client
        self._client: Any = None
        self._client_lock = asyncio.Lock()  # bound to the holder's loop at first use
        self._send_lock = asyncio.Lock()  # the holder's requests go out one at a time
        self._held: dict[uuid.UUID, str] = {}  # lease id -> what it holds, for log lines
        self._tasks: set[asyncio.Task[Any]] = set()
        self._renewal: asyncio.Task[Any] | None = None

    def submit(
        self, make: Callable[[], Awaitable[Any]], ctx: contextvars.Context | None = None
    ) -> concurrent.futures.Future[Any]:
        """Run ``make()`` on the loop in ``ctx`` (default: a copy of the caller's); returns at once.
        The first call starts the loop, renewing in its context. ``RuntimeError`` once closed."""
        ctx = ctx if ctx is not None else contextvars.copy_context()
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:  # scheduled under the lock: never after close() scheduled its shutdown
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            loop = self._start(ctx)
            loop.call_soon_threadsafe(self._create, make, ctx, done)
        return done

    def take(
        self,
        names: Sequence[str],
        slots: int,
        what: str,
        holder: tuple[str, uuid.UUID] | None = None,
    ) -> Answer:
        """:meth:`increment`, waited for (from a thread other than the holder's)."""
        return self.submit(lambda: self.increment(names, slots, what, holder)).result()  # type: ignore[no-any-return]

    def release(self, lease_id: uuid.UUID | None) -> None:
        """:meth:`give_back`, waited for up to ``RELEASE_WAIT_S`` (closed: it gave everything back)."""
        if lease_id is None or self._loop is None:
            return
        try:
            done = self.submit(lambda: self.give_back(lease_id), self._ctx)
        except RuntimeError:  # closed
            return
        with contextlib.suppress(concurrent.futures.TimeoutError):  # still under way; close() waits for it
            done.result(RELEASE_WAIT_S)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Call ``fn(*args)`` on the loop soon, never blocking; nothing when it is not running."""
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed
                loop.call_soon_threadsafe(fn, *args)

    def close(self, timeout: float = CLOSE_TIMEOUT_S, first: Callable[[], None] | None = None) -> None:
        """Run ``first`` on the loop, give back every held lease (within ``timeout``), stop the thread."""
        with self._lock:
            self._closed = True
            loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        assert self._ctx is not None
        loop.call_soon_threadsafe(self._create, lambda: self._shutdown(timeout, first), self._ctx, done)
        try:
            done.result(timeout + 5)
        except Exception:
            self.log.warning("gpu-tasks: giving back Prefect concurrency slots did not finish", exc_info=True)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)

    def spawn(self, make: Callable[[], Awaitable[Any]], ctx: contextvars.Context) -> None:
        """Run ``make()`` as a task of the holder (on its loop; :meth:`close` waits for it)."""
        self._create(make, ctx, None)

    async def increment(
        self,
        names: Sequence[str],
        slots: int,
        what: str,
        holder: tuple[str, uuid.UUID] | None = None,
        unless: Callable[[], bool] | None = None,
    ) -> Answer:
        """Ask once for ``slots`` of each limit in ``names`` (``what`` in log lines). ``unless()`` is
        asked in this request's turn, just before it is sent: true, it is granted with nothing held."""
        import httpx
        from prefect.client.schemas.objects import ConcurrencyLeaseHolder

        from gpu_tasks.compat.api_busy import BusyWait

        client = await self._api()
        ref = ConcurrencyLeaseHolder(type=holder[0], id=holder[1]) if holder is not None else None  # type: ignore[arg-type]
        busy: BusyWait | None = None
        while True:
            try:
                async with self._send_lock:
                    if unless is not None and unless():
                        return Answer(granted=True)
                    response = await client.increment_concurrency_slots_with_lease(
                        names=list(names),
                        slots=slots,
                        mode="concurrency",
                        lease_duration=self.lease_s,
                        holder=ref,
                    )
                break
            except Exception as exc:
                if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code == 423:  # full
                    retry_after = _retry_after(exc.response.headers.get("Retry-After"))
                    return Answer(granted=False, retry_after=retry_after)
                busy = busy or BusyWait(what)
                await asyncio.sleep(busy.next_wait(exc, self.log))  # raised unless the API is busy
        body = dict(response.json())
        limits = tuple(str(limit["name"]) for limit in body.get("limits") or ())
        if not limits:
            return Answer(granted=True)
        lease_id = uuid.UUID(str(body["lease_id"]))
        self._held[lease_id] = f"{what} ({', '.join(limits)})"
        return Answer(granted=True, lease_id=lease_id, limits=limits)

    async def give_back(self, lease_id: uuid.UUID) -> None:
        """Give ``lease_id``'s slots back (best effort: on failure the lease expires)."""
        what = self._held.pop(lease_id, None)
        if what is None:
            return
        try:
            client = await self._api()
            async with self._send_lock:
                await client.release_concurrency_slots_with_lease(lease_id)
        except Exception:
            self.log.warning(
                "gpu-tasks: could not give back %s (lease %s); they are free again when the lease "
                "expires (%gs)",
                what,
                lease_id,
                self.lease_s,
                exc_info=True,
            )

    def _start(self, ctx: contextvars.Context) -> asyncio.AbstractEventLoop:
        """The loop, started on first use (under ``_lock``)."""
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

        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()
        ready.wait()
        self._loop = loop
        self._ctx = ctx.copy()
        loop.call_soon_threadsafe(self._start_renewal)
        return loop

    def _start_renewal(self) -> None:
        assert self._loop is not None and self._ctx is not None
        self._renewal = self._loop.create_task(self._renew_forever(), context=self._ctx.copy())

    def _create(
        self,
        make: Callable[[], Awaitable[Any]],
        ctx: contextvars.Context,
        done: concurrent.futures.Future[Any] | None,
    ) -> None:
        loop = self._loop
        assert loop is not None

        async def run() -> Any:
            return await make()

        task = loop.create_task(run(), context=ctx)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if done is not None:
            task.add_done_callback(lambda t: _settle(done, t))

    async def _api(self) -> Any:
        """The holder's Prefect client, built on first use (in the flow run's context)."""
        async with self._client_lock:
            if self._client is None:
                client = _new_client(self.name)
                await client.__aenter__()
                self._client = client
        return self._client

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.renew_every_s)
            if self._on_tick is not None:
                try:
                    self._on_tick()
                except Exception:
                    self.log.debug("gpu-tasks: %s: the renewal tick failed", self.name, exc_info=True)
            await asyncio.gather(*(self._renew(lease_id) for lease_id in list(self._held)))

    async def _renew(self, lease_id: uuid.UUID) -> None:
        try:
            client = await self._api()
            async with self._send_lock:
                if lease_id not in self._held:  # given back meanwhile
                    return
                await client.renew_concurrency_lease(lease_id, self.lease_s)
        except Exception:
            self.log.warning(
                "gpu-tasks: renewing the Prefect lease on %s failed (tried again in %gs); others may take "
                "the slots if the lease (%gs) expires first",
                self._held.get(lease_id, "concurrency slots"),
                self.renew_every_s,
                self.lease_s,
                exc_info=True,
            )

    async def _shutdown(self, timeout: float, first: Callable[[], None] | None) -> None:
        """Give back every lease and let pending requests finish; those left after ``timeout`` are
        cancelled (a lease the server grants one later expires by itself)."""
        if first is not None:
            first()
        for lease_id in list(self._held):
            self.spawn(functools.partial(self.give_back, lease_id), self._ctx or contextvars.Context())
        current = asyncio.current_task()
        pending = {t for t in self._tasks if t is not current and t is not self._renewal}
        if pending:
            _, late = await asyncio.wait(pending, timeout=timeout)
            for task in late:
                task.cancel()
            if late:
                self.log.warning(
                    "gpu-tasks: %d Prefect concurrency slot request(s) still unanswered after %gs; any "
                    "slot the server grants them is free again when its lease expires (%gs)",
                    len(late),
                    timeout,
                    self.lease_s,
                )
        if self._renewal is not None:
            self._renewal.cancel()
        for task in list(self._tasks):
            if task is not current:
                task.cancel()
        if self._client is not None:
            try:
                await self._client.__aexit__(None, None, None)
            except Exception:
                self.log.debug("gpu-tasks: closing %s's Prefect client failed", self.name, exc_info=True)
            self._client = None


def _settle(done: concurrent.futures.Future[Any], task: asyncio.Task[Any]) -> None:
    if done.cancelled():  # the caller gave up on it
        return
    if task.cancelled():
        done.cancel()
    elif task.exception() is not None:
        done.set_exception(task.exception())
    else:
        done.set_result(task.result())


def _retry_after(value: str | None) -> float:
    try:
        delay = float(value) if value is not None else RETRY_AFTER_DEFAULT_S
    except ValueError:
        delay = RETRY_AFTER_DEFAULT_S
    return max(0.05, delay)


def _new_client(purpose: str) -> Any:
    """A client for the flow run's API; not ``get_client()``, which would start a server of its own
    when the URL is in no setting."""
    from prefect.client.orchestration import PrefectClient
    from prefect.settings import get_current_settings

    from gpu_tasks.prefect_api.api import client_tls, require_flow_api_url

    settings = get_current_settings()
    key, auth = settings.api.key, settings.api.auth_string
    url = require_flow_api_url(f"({purpose})")
    return PrefectClient(
        url,
        api_key=key.get_secret_value() if key else None,
        auth_string=auth.get_secret_value() if auth else None,
        httpx_settings=client_tls(url),
    )
