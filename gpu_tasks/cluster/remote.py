"""What ``address=`` (:mod:`~gpu_tasks.cluster.address`) and ``cluster_class=``
(:mod:`~gpu_tasks.cluster.managed`) profiles share; device leases cover one host and do not apply."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from gpu_tasks.borrowing import Claim
from gpu_tasks.cluster.board import SharedBoard
from gpu_tasks.cluster.local import ProfileCluster
from gpu_tasks.cluster.remote_workers import RemoteWorker, executing_keys, read_workers, started_keys
from gpu_tasks.cluster.within import within
from gpu_tasks.devices import wait_reasons
from gpu_tasks.devices.discovery import Inventory
from gpu_tasks.errors import ClusterError, UnsatisfiableProfileError
from gpu_tasks.policy import Holding
from gpu_tasks.preemption import describe_waiter
from gpu_tasks.prefect_api.api import api_headers, unreachable_api_error
from gpu_tasks.profiles import ResourceProfile
from gpu_tasks.reporting.ledger import DeviceSpan, LedgerRow, device_spans, union_seconds
from gpu_tasks.reporting.measured import NOT_ELSEWHERE, NOT_EMULATED, Measured
from gpu_tasks.settings import get_settings
from gpu_tasks.worker.api_probe import probe_api
from gpu_tasks.worker.interrupts import interrupt_tasks

logger = logging.getLogger("gpu_tasks.runner")

_WAIT_LOG_EVERY = 30.0
BOARD_STEP_S = 0.5  # how often an address GPU profile looks at the shared scheduler's waiter board
API_PROBE_TIMEOUT_S = 5.0  # how long a worker's request to the flow run's Prefect API may take


def security_for(profile: ResourceProfile) -> Any:
    """Dask ``Security`` for a ``tls://`` address: the profile's files, else GPU_TASKS_TLS_*, else
    Dask's ``distributed.comm.tls`` configuration."""
    from distributed import Security

    settings = get_settings()
    tls = profile.security
    ca = (tls.ca_file if tls else None) or settings.tls_ca_file
    cert = (tls.cert if tls else None) or settings.tls_cert
    key = (tls.key if tls else None) or settings.tls_key
    if ca is None and cert is None:
        return Security()
    for what, path in (("ca_file", ca), ("cert", cert), ("key", key)):
        if path is not None:
            try:
                open(path, "rb").close()
            except OSError as exc:
                raise ClusterError(
                    f"profile {profile.name!r}: security.{what} {str(path)!r} cannot be read: "
                    f"{exc.strerror}; point it (or GPU_TASKS_TLS_*) at a PEM file"
                ) from exc
    return Security(
        tls_ca_file=str(ca) if ca else None,
        tls_client_cert=str(cert) if cert else None,
        tls_client_key=str(key) if key else None,
        require_encryption=True,
    )


def _by_worker(answers: dict[Any, Any]) -> dict[str, list[str]]:
    """A ``Client.run`` of a keys function, by worker address (workers that failed left out)."""
    return {str(w): [str(k) for k in keys] for w, keys in answers.items() if isinstance(keys, list)}


class RemoteCluster(ProfileCluster):
    """What address and cluster_class profiles share: a client, remote workers, the ledger."""

    shared = True

    def __init__(
        self,
        profile: ResourceProfile,
        worker_env: dict[str, str],
        provision_timeout: float,
        dashboard: bool = False,
        api_url: str | None = None,
        on_board: Callable[[str, dict[str, Any]], None] | None = None,
    ) -> None:
        super().__init__(profile, Inventory(), worker_env, provision_timeout, dashboard)
        self.api_url = api_url
        self.on_board = on_board  # preemption on the shared scheduler, told to the flow run (events)
        self.client: Any = None
        self.remote: dict[str, RemoteWorker] = {}
        self.limit = profile.max_workers or 1
        self._busy_lock = threading.Lock()
        self._allowed: list[str] | None = None  # workers a task may run on (gpu_model / gpu_memory_total)
        self._fit: list[RemoteWorker] = []
        self._no_api: dict[str, str] = {}  # workers that could not reach the Prefect API: why
        self._pending: dict[str, float] = {}  # keys submitted and not done: when
        self._futures: dict[str, Any] = {}
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self.board: SharedBoard | None = None  # preemption on a shared scheduler (address GPU profiles)
        self.me: dict[str, Any] | None = None  # who we are on the board (flow run, priority)
        self.preempted: dict[str, dict[str, Any]] = {}  # key interrupted -> the waiter it was for
        self._lent: set[str] = set()  # task runs (hex ids) whose task runs on borrowed quota

    @property
    def running(self) -> bool:
        return self.client is not None

    def lost(self) -> str | None:
        """Why the client can no longer reach the scheduler (it reconnects, or gave up), else ``None``.
        A task handed to a client in that state never ended: Dask cancelled what it held when the
        connection went, and a later task waited for good (a retry of a task run it crashed)."""
        status = str(getattr(self.client, "status", "running")) if self.client is not None else "running"
        if status in ("running", "newly-created"):
            return None
        return f"its client lost the connection to the Dask scheduler at {self.scheduler_address} ({status})"

    @property
    def emulated(self) -> bool:
        return bool(self.profile.is_gpu and any(w.emulated for w in self.remote.values()))

    @property
    def dashboard_link(self) -> str | None:
        return self.client.dashboard_link if self.client is not None and self.dashboard else None

    @property
    def scheduler_address(self) -> str:
        raise NotImplementedError

    def subscribe(self, topic: str, handler: Any) -> None:
        """Call ``handler(event)`` for each Dask event its workers log on ``topic`` (after :meth:`start`)."""
        if self.client is not None:
            self.client.subscribe_topic(topic, handler)

    # ------------------------------------------------------------ tasks
    def submit(self, fn: Any, *args: Any, key: str, resources: dict[str, float] | None) -> Any:
        if self.client is None:
            raise ClusterError(f"profile {self.profile.name!r}: its cluster is not running")
        where: dict[str, Any] = {}
        if self._allowed is not None and time.monotonic() - self._placed_at > self.replace_every:
            # workers come and go (a restarted worker has a new address): place on those up now
            with contextlib.suppress(Exception):
                self._place(read_workers(self.client))
        if self._allowed is not None:
            where = {"workers": self._allowed, "allow_other_workers": False}
        if self.board is not None and self.me is None:
            from gpu_tasks.devices.leases import owner_info

            self.me = owner_info(self.profile.name, self.priority)  # in the flow run's context
        with self._busy_lock:
            self._pending[key] = time.monotonic()
        # a shared scheduler's workers start the higher-priority task first among those waiting
        future = self.client.submit(
            fn, *args, key=key, pure=False, resources=resources, priority=self.priority, **where
        )
        with self._busy_lock:
            self._futures[key] = future
        future.add_done_callback(lambda f: self._done(key, f.status))
        self._watch()
        return future

    def _place(self, workers: dict[str, RemoteWorker]) -> None:
        """Send tasks only to the workers that fit, when some do not (gpu_model, gpu_memory_total, no
        gpu-tasks, no Prefect API)."""
        why = {a: w.why_not(self.profile) or self._no_api.get(a) for a, w in workers.items()}
        for address, reason in why.items():
            w = workers[address]
            if reason is not None and w.error and address not in self.remote:
                logger.warning(
                    "profile %r: worker %s of %s gets none of its tasks: %s",
                    self.profile.name,
                    w.name,
                    self.scheduler_address,
                    reason,
                )
        self.remote = workers
        self._fit = [w for a, w in workers.items() if why[a] is None]
        self._allowed = [w.address for w in self._fit] if len(self._fit) < len(workers) else None
        self._placed_at = time.monotonic()

    _placed_at = 0.0
    replace_every = 5.0  # seconds before a submit re-reads the workers a restricted profile may use

    def _done(self, key: str, status: str) -> None:
        with self._busy_lock:
            self._pending.pop(key, None)
            self._futures.pop(key, None)
        # a task's started mark (metadata under its key) goes with the task on the scheduler

    def _cancel_unfinished(self) -> None:
        """Stop our tasks on the cluster: cancel the queued first (else a worker freed by an interrupt
        could take one), then interrupt the running (``Crashed``)."""
        with self._busy_lock:
            futures = list(self._futures.values())
            keys = list(self._futures)
        client = self.client
        self.stopped_running = None
        if futures and client is not None:
            with contextlib.suppress(Exception):
                client.cancel(futures)
            with contextlib.suppress(Exception):
                hit = within(
                    5.0, lambda: client.run(interrupt_tasks, keys, "stop", on_error="return"), "interrupt"
                )
                # those started: a task still queued there had not run (its crash report says so)
                self.stopped_running = {k for found in _by_worker(hit).values() for k in found}

    # ------------------------------------------------------------ waiting, logged
    wait_log_every = _WAIT_LOG_EVERY  # seconds a task waits in the scheduler's queue before it is logged

    def _watch(self) -> None:
        if self._watcher is None or self._watch_stop.is_set():
            self._watch_stop = threading.Event()  # one per watcher: an old one may still be exiting
            self._watcher = threading.Thread(
                target=self._watch_queue,
                args=(self._watch_stop,),
                name=f"gpu-tasks-wait-{self.profile.name}",
                daemon=True,
            )
            self._watcher.start()

    def _watch_queue(self, stop: threading.Event) -> None:
        """Log the tasks long in the queue; with a board, also take our turn on it."""
        step = min(self.wait_log_every, BOARD_STEP_S) if self.board is not None else self.wait_log_every
        next_log = time.monotonic() + self.wait_log_every
        while not stop.wait(step):
            client = self.client
            if client is None:
                continue
            if time.monotonic() >= next_log:
                next_log = time.monotonic() + self.wait_log_every
                self._log_waits(client)
            if self.board is not None:
                try:
                    self._board_step(client, self.board)
                except Exception:  # a scheduler that went away: the wait log says the rest
                    logger.debug("profile %r: board step failed", self.profile.name, exc_info=True)

    def _started(self, client: Any) -> set[str]:
        """The keys no longer queued on any worker: running, or ended and not yet heard of here."""
        return {k for keys in _by_worker(client.run(started_keys, on_error="return")).values() for k in keys}

    def _log_waits(self, client: Any) -> None:
        now = time.monotonic()
        with self._busy_lock:
            old = {k: t for k, t in self._pending.items() if now - t >= self.wait_log_every}
        if not old:
            return
        try:
            running = self._started(client)
        except Exception:
            return
        queued = [k for k in old if k not in running]
        if queued:
            logger.info(
                "profile %r: %d task(s) have waited up to %.0fs in the queue of %s for %s; %s",
                self.profile.name,
                len(queued),
                max(now - old[k] for k in queued),
                self.scheduler_address,
                f"GPU={self.profile.gpus:g}" if self.profile.is_gpu else "a worker thread",
                self._wait_reason(),
            )

    def _board_step(self, client: Any, board: SharedBoard) -> None:
        """Renew our waiter entry; as a preemptible holder, interrupt our running tasks that a
        higher-priority waiter on our workers needs, or borrowed ones another team reclaims."""
        with self._busy_lock:
            pending = dict(self._pending)
        settings = get_settings()
        posted = board.wait_step(
            client,
            dict(self.me or {}, priority=self.priority, quota=self.profile.quota),
            pending,
            settings.preemption_grace,
            lambda: self._started(client),
            settings.priority_aging,
            self.borrowed,
        )
        if posted is not None and self.on_board is not None:
            self.on_board("preempting", posted)
        if not self.profile.preemptible or not pending:
            return
        lent = self.profile.quota if any(self.borrowed(k) for k in pending) else None
        waiters = board.due_waiters(client, self.priority, lent)
        if not waiters:
            return
        # the keys each worker is executing now (not those it holds back for resources)
        executing = _by_worker(client.run(executing_keys, on_error="return"))
        mine = {w: [k for k in keys if k in pending] for w, keys in executing.items()}
        protect = float(self.profile.min_run_time or 0.0)

        def claim(key: str) -> Claim:
            held = Holding(
                preemptible=True, priority=self.priority, since=pending.get(key), min_run_time=protect
            )
            return Claim(self.profile.quota, self.borrowed(key), held)

        for waiter in waiters:
            pick = board.victims(waiter, mine, board.need, claim)
            if pick is None:
                continue
            worker, keys = pick
            with self._busy_lock:
                for key in keys:
                    self.preempted[key] = waiter
            hit = client.run(interrupt_tasks, keys, workers=[worker], on_error="return").get(worker)
            hit = hit if isinstance(hit, list) else []
            with self._busy_lock:
                for key in set(keys) - set(hit):  # it ended meanwhile (or the worker is gone)
                    self.preempted.pop(key, None)
            mine[worker] = [k for k in mine[worker] if k not in keys]
            reclaim = waiter.get("reclaimed_by")
            logger.warning(
                "profile %r: %s %d task(s) on worker %s of %s for %s, queued %.1fs there",
                self.profile.name,
                f"reclaimed by {reclaim}: stopping borrowed" if reclaim else "preempting",
                len(keys),
                worker,
                self.scheduler_address,
                describe_waiter(waiter),
                float(waiter.get("waited_s") or 0),
            )
            if self.on_board is not None:
                self.on_board("preempted", {"by": waiter, "worker": worker, "keys": keys, "interrupted": hit})

    def admit(self, stop: threading.Event, say: Callable[[str], None]) -> None:
        """Hold a new task back while a lower-priority waiter on our workers has aged past us, so our
        tasks cannot starve it; ``RuntimeError`` once ``stop`` is set."""
        board, client = self.board, self.client
        if board is None or client is None or time.monotonic() - self._clear_at < BOARD_STEP_S:
            return
        next_log = time.monotonic()
        ours = {w.address for w in self._fit}
        while True:
            try:
                ahead = [
                    e
                    for e in board.aged_ahead(client, self.priority)
                    if not e.get("workers") or not ours or set(e["workers"]) & ours
                ]
            except Exception:  # the board cannot be read: nothing to defer to
                ahead = []
            now = time.monotonic()
            if not ahead:
                self._clear_at = now
                return
            me = {"effective_priority": self.priority, "workers": sorted(ours), "token": "-"}
            wait_reasons.tell(wait_reasons.board_reason(me, ahead))  # its task run's log says why
            if now >= next_log:
                first = max(ahead, key=lambda e: int(e["effective_priority"]))
                say(
                    f"profile {self.profile.name!r}: a task waits before going to {self.scheduler_address}: "
                    f"{describe_waiter(first)} has waited {float(first.get('waited_s') or 0):.0f}s and its "
                    f"effective priority {first['effective_priority']} exceeds this run's {self.priority} "
                    "(GPU_TASKS_TUNE_PRIORITY_AGING)"
                )
                next_log = now + self.wait_log_every
            if stop.wait(BOARD_STEP_S):
                raise RuntimeError("the task runner is shutting down")

    _clear_at = -math.inf  # when the board last had no aged waiter ahead of us

    def preempted_by(self, key: str) -> dict[str, Any]:
        with self._busy_lock:
            return self.preempted.pop(key, {})

    # ------------------------------------------------------------ borrowing (gpu_tasks.borrowing)
    def lend(self, task_run: str, borrowed: bool) -> None:
        with self._busy_lock:
            (self._lent.add if borrowed else self._lent.discard)(task_run)

    def borrowed(self, key: str) -> bool:
        """Whether our Dask ``key`` (``<task>-<task run hex>-<attempt>``) runs on borrowed quota."""
        parts = key.rsplit("-", 2)
        return len(parts) == 3 and parts[1] in self._lent

    def owed_waiters(self) -> list[Any]:
        board, client = self.board, self.client
        if board is None or client is None:
            return []
        try:
            return [
                a for a in board.owed(client, {w.address for w in self._fit}) if a.team != self.profile.quota
            ]
        except Exception:
            return []

    def _wait_reason(self) -> str:
        fit = [w for w in self.remote.values() if w.why_not(self.profile) is None]
        if fit:
            return f"the {len(fit)} worker(s) that fit are busy with other work"
        return "no worker that fits is up"

    def worker_devices(self, name: str) -> tuple[str, ...] | None:
        w = next((w for w in self.remote.values() if w.name == name or w.address == name), None)
        return None if w is None else w.device_keys

    def retire(self, name: str, reason: str, keep: bool = False) -> LedgerRow | None:
        """A remote worker died under a task: nothing of ours to give back (its cluster replaces it)."""
        logger.warning(
            "profile %r: worker %r of %s died (%s)", self.profile.name, name, self._where(), reason
        )
        self.remote = {a: w for a, w in self.remote.items() if w.name != name and a != name}
        return None

    def shutdown(self) -> None:
        self._watch_stop.set()
        client, self.client = self.client, None
        if client is not None:
            if self.board is not None:
                self.board.take_down(client)
            with contextlib.suppress(Exception):
                client.close()

    # ------------------------------------------------------------ internals
    def _connected_workers(self, want: int, deadline: float, what: str) -> dict[str, RemoteWorker]:
        """Wait until the scheduler has ``want`` workers (or the deadline); their facts."""
        next_log = time.monotonic() + _WAIT_LOG_EVERY
        while True:
            workers = read_workers(self.client)
            if len(workers) >= want:
                return workers
            now = time.monotonic()
            if now >= deadline:
                raise ClusterError(
                    f"profile {self.profile.name!r}: {what}: {len(workers)} of {want} worker(s) joined "
                    f"{self.scheduler_address} within {self.provision_timeout:g}s "
                    f"(GPU_TASKS_PROVISION_TIMEOUT); {self.no_workers_hint}"
                )
            if now >= next_log:
                logger.info(
                    "profile %r: waiting for %d worker(s) to join %s (%d so far)",
                    self.profile.name,
                    want,
                    self.scheduler_address,
                    len(workers),
                )
                next_log = now + _WAIT_LOG_EVERY
            time.sleep(0.1)

    no_workers_hint = "check that workers can start and reach the scheduler"

    def _check_workers(self, workers: dict[str, RemoteWorker]) -> list[RemoteWorker]:
        """The workers that can run this profile's tasks; fail when none ever can."""
        fit = [w for w in workers.values() if w.why_not(self.profile) is None]
        if not fit and workers:
            lines = "; ".join(f"{w.describe()} ({w.why_not(self.profile)})" for w in workers.values())
            raise UnsatisfiableProfileError(
                f"profile {self.profile.name!r} asks for gpus={self.profile.gpus:g}"
                + (f", gpu_model={self.profile.gpu_model!r}" if self.profile.gpu_model else "")
                + f", but no worker of {self.scheduler_address} can ever run it: {lines}. Lower the request, "
                "or start workers with `--resources GPU=<n>` on the right devices"
            )
        return fit

    def _check_api(self, workers: list[RemoteWorker], every: bool = False) -> None:
        """Ask ``workers`` whether they reach the flow run's Prefect API; those that cannot get no task
        (``_no_api``), or, with none left or ``every`` (a cluster class's workers are alike), fail."""
        self._no_api = failed = self._probe_api(workers)
        if not failed:
            return
        assert self.api_url is not None
        named = {f"{w.name} on {w.host}": failed[w.address] for w in workers if w.address in failed}
        why = unreachable_api_error(self.profile.name, self.api_url, self.scheduler_address, named)
        if every or len(failed) == len(workers):
            raise ClusterError(why)
        logger.warning("%s; its tasks go to the other %d worker(s)", why, len(workers) - len(failed))

    def _probe_api(self, workers: list[RemoteWorker]) -> dict[str, str]:
        """{address: why not} for the ``workers`` that cannot reach the API (``{}``: cannot ask)."""
        client, url = self.client, self.api_url
        if url is None or client is None or not workers or not self.profile.uses_processes:
            return {}
        from prefect.context import FlowRunContext

        ctx = FlowRunContext.get()
        run_id = str(ctx.flow_run.id) if ctx is not None and ctx.flow_run is not None else None
        headers, addresses = api_headers(), [w.address for w in workers]
        try:
            answers = within(
                2 * API_PROBE_TIMEOUT_S + 5,
                lambda: client.run(
                    probe_api, url, run_id, headers, API_PROBE_TIMEOUT_S, workers=addresses, on_error="return"
                ),
                f"Prefect API probe of profile {self.profile.name!r}",
                hint=f"The workers of {self.scheduler_address} did not answer",
            )
        except Exception:
            logger.warning(
                "profile %r: could not ask the workers of %s whether they reach the Prefect API at %s",
                self.profile.name,
                self.scheduler_address,
                url,
                exc_info=True,
            )
            return {}
        failed: dict[str, str] = {}
        for address, answer in answers.items():
            if isinstance(answer, BaseException):
                failed[address] = f"the probe failed there: {type(answer).__name__}: {answer}"
            elif answer is not None:
                failed[address] = str(answer)
        return failed

    def _known_workers(self) -> list[RemoteWorker]:
        """The workers this cluster's life has seen (for device models)."""
        return list(self.remote.values())

    def _busy_row(self, held: float | None, workers: int, reason: str, closed: float) -> LedgerRow:
        intervals, tasks = self.usage.busy()  # reset by its close, after this row
        busy_by = {k: union_seconds(v) for k, v in intervals.items()}
        per = max(1, self.profile.devices_per_worker)
        busy = sum(busy_by.values()) * (per if self.profile.is_gpu else 1)
        devices = tuple(k for k in busy_by if k != "cpu")
        started = self.usage.provisioned_at or closed
        spans = self._spans(intervals, None if held is None else (started, closed))
        return LedgerRow(
            profile=self.profile.name,
            workers=workers,
            devices=devices,
            emulated=self.emulated,
            provisioned_at=started,
            closed_at=closed,
            held_seconds=busy if held is None else held,
            busy_seconds=busy if held is None else min(busy, held),
            tasks=tasks,
            reason=reason,
            spans=spans,
            skipped=(),  # its devices are on other hosts: no programs sampled here
            measured=Measured(note=NOT_EMULATED if self.emulated else NOT_ELSEWHERE) if devices else None,
            wait_devices_seconds=(waits := self.usage.waits())["wait_devices_seconds"],
            wait_slots_seconds=waits["wait_slots_seconds"],
        )

    def _spans(
        self, intervals: dict[str, list[tuple[float, float]]], held: tuple[float, float] | None
    ) -> tuple[DeviceSpan, ...]:
        """One span per device a task ran on: over ``held``, or, for a cluster not ours to hold
        (``None``), from its first task's start to its last task's end."""
        models = {k: m for w in self._known_workers() for k, m in w.models().items()}
        spans: list[DeviceSpan] = []
        for key, runs in intervals.items():
            if key == "cpu" or not runs:
                continue
            start, end = held or (min(s for s, _ in runs), max(e for _, e in runs))
            named = [(d, models.get(d, "")) for d in key.split(",")]
            spans.extend(device_spans(self.profile.name, named, start, end, runs))
        return tuple(spans)
