"""Profiles whose workers are not this host's leased devices.

- :class:`AddressCluster` (``address=``): an existing Dask cluster. The runner connects
  a client and never starts or closes the cluster; the shared scheduler's ``GPU``
  resources arbitrate between flow runs and hosts. An idle close closes the client.
- :class:`ManagedCluster` (``cluster_class=`` + ``cluster_kwargs``): any Dask cluster
  class (dask-jobqueue, dask-kubernetes, dask-gateway, ``LocalCUDACluster``) created on
  the profile's first task, scaled to the queued tasks (at most ``max_workers``),
  scaled to zero when idle and closed when the flow run ends.

Both act like :class:`~gpu_tasks.cluster.local.ProfileCluster` towards the runner; device
leases (:mod:`gpu_tasks.devices.leases`) do not apply: they cover one host's devices.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpu_tasks.cluster.backends import _non_daemon_workers, _within
from gpu_tasks.cluster.board import SharedBoard
from gpu_tasks.cluster.local import ProfileCluster
from gpu_tasks.compat.cpython import signal_handlers_kept
from gpu_tasks.devices.discovery import Inventory, model_text
from gpu_tasks.errors import ClusterError, UnsatisfiableProfileError
from gpu_tasks.policy import GPU_RESOURCE, task_resources
from gpu_tasks.preemption import describe_waiter
from gpu_tasks.prefect_api.api import loopback_api_error
from gpu_tasks.profiles import ResourceProfile
from gpu_tasks.reporting.ledger import DeviceSpan, LedgerRow, device_spans, union_seconds
from gpu_tasks.settings import get_settings
from gpu_tasks.worker.engine import interrupt_tasks, owned_devices

logger = logging.getLogger("gpu_tasks.runner")

_WAIT_LOG_EVERY = 30.0
BOARD_STEP_S = 0.5  # how often an address GPU profile looks at the shared scheduler's waiter board


# ---------------------------------------------------------------- what a worker is
def worker_facts(dask_worker: Any = None) -> dict[str, Any]:
    """Run on a worker (``Client.run``): its host and the devices it owns.

    A worker owns the first ``GPU``-resource-many of its ``CUDA_VISIBLE_DEVICES``
    (``dask cuda worker`` shows each worker every device, its own first).
    """
    from gpu_tasks.devices.discovery import visible_devices

    own = owned_devices(dask_worker)
    devices = visible_devices().devices[:own]
    return {
        "host": socket.gethostname(),
        "devices": [d.address for d in devices],
        "names": [d.name for d in devices],
        "memory": [d.memory_total for d in devices],
        "emulated": visible_devices().emulated,
    }


def executing_keys(dask_worker: Any) -> list[str]:
    """Run on a worker (``Client.run``): the keys of the tasks it is executing now."""
    return [str(k) for k, ts in dask_worker.state.tasks.items() if ts.state in ("executing", "long-running")]


@dataclass(frozen=True)
class RemoteWorker:
    """One worker of a remote scheduler, as the runner sees it."""

    address: str
    name: str
    host: str
    gpus: float  # its Dask GPU resource
    devices: tuple[str, ...] = ()  # CUDA_VISIBLE_DEVICES ids, when the worker told us
    names: tuple[str, ...] = ()
    memory: tuple[int | None, ...] = ()
    emulated: bool = False
    error: str = ""  # why it cannot run gpu-tasks tasks (it failed to describe itself), if so

    @property
    def device_keys(self) -> tuple[str, ...]:
        """``<host>:<id>`` of each device, as tags and the ledger name them."""
        return tuple(f"{self.host}:{d}" for d in self.devices)

    def models(self) -> dict[str, str]:
        """The model text of each device (``H100 80 GiB``) by its ``<host>:<id>`` key, where told."""
        memory = self.memory + (None,) * (len(self.names) - len(self.memory))
        return {
            key: model_text(name, mem, self.emulated)
            for key, name, mem in zip(self.device_keys, self.names, memory, strict=False)
        }

    def describe(self) -> str:
        """``gpu-host-1 (tcp://...): GPU=1, H100 (emulated)``."""
        what = f"GPU={self.gpus:g}" if self.gpus else "no GPU resource"
        if self.names:
            what += ", " + "/".join(self.names)
        return f"{self.name} on {self.host}: {what}"

    def why_not(self, profile: ResourceProfile) -> str | None:
        """Why this worker can never run a task of ``profile`` (``None``: it can)."""
        if self.error:
            return f"cannot run gpu-tasks tasks ({self.error}); install gpu-tasks, same version, on it"
        if not profile.is_gpu:
            return None
        need = float(profile.gpus) if profile.gpus >= 1 else float(profile.share)
        if self.gpus + 1e-9 < need:
            return f"GPU={self.gpus:g} < {need:g}"
        if profile.gpu_model:
            if not self.names:
                return "publishes no device names (gpu_model)"
            if not all(profile.gpu_model.lower() in n.lower() for n in self.names):
                return f"devices {'/'.join(self.names)} do not match gpu_model={profile.gpu_model!r}"
        if profile.gpu_memory:
            if not self.memory or any(m is None for m in self.memory):
                return "publishes no device memory (gpu_memory)"
            if any(m is not None and m < profile.gpu_memory for m in self.memory):
                return f"device memory below gpu_memory={profile.gpu_memory / 2**30:.1f}GiB"
        return None


def is_leaving(answer: object) -> bool:
    """Whether a worker's answer to ``Client.run`` says it is closing or gone, not that it lacks gpu-tasks.

    A worker being scaled down stays in the scheduler's list for a moment; asking it fails with a
    comm error (``CommClosedError`` and timeouts are ``OSError``), while a worker without gpu-tasks
    answers with its ``ImportError``.
    """
    return isinstance(answer, OSError)


def read_workers(client: Any) -> dict[str, RemoteWorker]:
    """The scheduler's workers: their ``GPU`` resources and, where they can tell, their devices."""
    info = client.scheduler_info(n_workers=-1)["workers"]
    facts: dict[str, Any] = {}
    if info:
        with contextlib.suppress(Exception):  # workers without gpu-tasks cannot describe their devices
            facts = client.run(worker_facts, on_error="return")
    out = {}
    for address, w in info.items():
        f = facts.get(address)
        if is_leaving(f):
            continue  # closing or gone (a scale-down the scheduler has not finished): not a worker to use
        # a worker that cannot import gpu-tasks answers with the exception: a task would break it
        error = f"{type(f).__name__}: {f}" if isinstance(f, BaseException) else ""
        f = f if isinstance(f, dict) else {}
        out[address] = RemoteWorker(
            address=address,
            name=str(w.get("name") or address),
            host=str(f.get("host") or w.get("host") or address),
            gpus=float((w.get("resources") or {}).get(GPU_RESOURCE, 0.0)),
            devices=tuple(f.get("devices") or ()),
            names=tuple(f.get("names") or ()),
            memory=tuple(f.get("memory") or ()),
            emulated=bool(f.get("emulated")),
            error=error,
        )
    return out


def security_for(profile: ResourceProfile) -> Any:
    """Dask ``Security`` for a ``tls://`` address: the profile's files, then GPU_TASKS_TLS_*, then
    Dask's ``distributed.comm.tls`` configuration."""
    from distributed import Security

    settings = get_settings()
    tls = profile.security
    ca = (tls.ca_file if tls else None) or settings.tls_ca_file
    cert = (tls.cert if tls else None) or settings.tls_cert
    key = (tls.key if tls else None) or settings.tls_key
    if ca is None and cert is None:
        return Security()  # Dask's own configuration (distributed.comm.tls.*)
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


def load_cluster_class(profile: ResourceProfile) -> type:
    """The class ``profile.cluster_class`` names, checked to be a Dask cluster class.

    Raises:
        ClusterError: the module or class cannot be imported, or it is not a Dask cluster.
    """
    from distributed.deploy.cluster import Cluster

    path = profile.cluster_class
    assert path is not None
    module_name, _, attr = path.rpartition(".")
    try:
        with signal_handlers_kept():
            module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ClusterError(
            f"profile {profile.name!r}: cluster_class {path!r} cannot be imported ({exc}); install the "
            "package that provides it (e.g. pip install dask-jobqueue) in the flow run's environment, "
            "or fix the path"
        ) from exc
    cls = getattr(module, attr, None)
    if cls is None:
        raise ClusterError(
            f"profile {profile.name!r}: cluster_class {path!r}: module {module_name!r} has no {attr!r}; "
            "fix the class name"
        )
    # dask-gateway's GatewayCluster is no Cluster subclass but acts as one: scale, close, an address
    acts_as_one = all(callable(getattr(cls, m, None)) for m in ("scale", "close")) and hasattr(
        cls, "scheduler_address"
    )
    if not (isinstance(cls, type) and (issubclass(cls, Cluster) or acts_as_one)):
        raise ClusterError(
            f"profile {profile.name!r}: cluster_class {path!r} is not a Dask cluster class (a subclass of "
            "distributed.deploy.Cluster such as dask_jobqueue.SLURMCluster, or a class with scale(), close() "
            "and scheduler_address such as dask_gateway.GatewayCluster); fix cluster_class"
        )
    return cls


# ---------------------------------------------------------------- shared by both kinds
class RemoteCluster(ProfileCluster):
    """What address and cluster_class profiles share: a client, remote workers, the ledger."""

    def __init__(
        self,
        profile: ResourceProfile,
        worker_env: dict[str, str],
        provision_timeout: float,
        dashboard: bool = False,
        api_url: str | None = None,
    ) -> None:
        super().__init__(profile, Inventory(), worker_env, provision_timeout, dashboard)
        self.api_url = api_url
        self.client: Any = None
        self.remote: dict[str, RemoteWorker] = {}
        self.limit = profile.max_workers or 1
        self._busy: dict[str, list[tuple[float, float]]] = {}
        self._tasks = 0
        self._busy_lock = threading.Lock()
        self._allowed: list[str] | None = None  # workers a task may run on (gpu_model / gpu_memory)
        self._fit: list[RemoteWorker] = []  # the workers that can run this profile's tasks
        self._pending: dict[str, float] = {}  # keys submitted and not done: when
        self._futures: dict[str, Any] = {}  # their futures
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None
        # preemption on a shared scheduler (address GPU profiles; gpu_tasks.cluster.board)
        self.board: SharedBoard | None = None
        self.me: dict[str, Any] | None = None  # who we are on the board (flow run, priority)
        self.preempted: dict[str, dict[str, Any]] = {}  # key interrupted -> the waiter it was for
        self.on_board: Callable[[str, dict[str, Any]], None] | None = (
            None  # events (gpu_tasks.runner.session)
        )

    # ------------------------------------------------------------ properties
    @property
    def running(self) -> bool:
        return self.client is not None

    @property
    def emulated(self) -> bool:
        return bool(self.profile.is_gpu and any(w.emulated for w in self.remote.values()))

    @property
    def dashboard_link(self) -> str | None:
        return self.client.dashboard_link if self.client is not None and self.dashboard else None

    @property
    def scheduler_address(self) -> str:
        raise NotImplementedError

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
        # a shared scheduler's workers start the higher-priority task first among those waiting for
        # their GPU resources: this flow run's priority (GPU_TASKS_PRIORITY, else the profile's)
        future = self.client.submit(
            fn, *args, key=key, pure=False, resources=resources, priority=self.priority, **where
        )
        with self._busy_lock:
            self._futures[key] = future
        future.add_done_callback(lambda f: self._done(key))
        self._watch()
        return future

    def _place(self, workers: dict[str, RemoteWorker]) -> None:
        """Send tasks only to the workers that fit, when some do not (gpu_model, gpu_memory, or
        a worker without gpu-tasks, which a task would break)."""
        why = {a: w.why_not(self.profile) for a, w in workers.items()}
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

    def _done(self, key: str) -> None:
        with self._busy_lock:
            self._pending.pop(key, None)
            self._futures.pop(key, None)

    def _cancel_unfinished(self) -> None:
        """Stop our tasks on the cluster (the flow run stopped): queued ones never start; running
        ones are interrupted in their worker thread (``KeyboardInterrupt``: they end ``Crashed``,
        "aborted by an interrupt signal", as on this host) and give the workers' GPUs back."""
        with self._busy_lock:
            futures = list(self._futures.values())
            keys = list(self._futures)
        client = self.client
        if futures and client is not None:
            with contextlib.suppress(Exception):
                _within(
                    5.0, lambda: client.run(interrupt_tasks, keys, "stop", on_error="return"), "interrupt"
                )
            with contextlib.suppress(Exception):
                client.cancel(futures)

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
        """Log the tasks that waited ``wait_log_every`` s in the queue, and why; with a board,
        every ``BOARD_STEP_S`` s also be a waiter or a holder on it (gpu_tasks.cluster.board)."""
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

    def _executing(self, client: Any) -> dict[str, list[str]]:
        """The keys each worker is executing now (not those it holds back for resources)."""
        return {
            str(w): [str(k) for k in keys]
            for w, keys in client.run(executing_keys, on_error="return").items()
            if isinstance(keys, list)
        }

    def _log_waits(self, client: Any) -> None:
        now = time.monotonic()
        with self._busy_lock:
            old = {k: t for k, t in self._pending.items() if now - t >= self.wait_log_every}
        if not old:
            return
        try:
            running = {k for keys in self._executing(client).values() for k in keys}
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
        """Put up (or take down) our waiter entry; as a preemptible holder, interrupt our running
        tasks that a higher-priority waiter on the same workers needs."""
        with self._busy_lock:
            pending = dict(self._pending)
        settings = get_settings()
        posted = board.wait_step(
            client,
            dict(self.me or {}, priority=self.priority),
            pending,
            settings.preemption_grace,
            lambda: {k for keys in self._executing(client).values() for k in keys},
            settings.priority_aging,
        )
        if posted is not None and self.on_board is not None:
            self.on_board("preempting", posted)
        if not self.profile.preemptible or not pending:
            return
        waiters = board.due_waiters(client, self.priority)
        if not waiters:
            return
        mine = {w: [k for k in keys if k in pending] for w, keys in self._executing(client).items()}
        per_task = float((task_resources(self.profile) or {}).get(GPU_RESOURCE, 1.0))
        for waiter in waiters:
            pick = board.victims(waiter, mine, per_task)
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
            logger.warning(
                "profile %r: preempting %d task(s) on worker %s of %s for %s, queued %.1fs there",
                self.profile.name,
                len(keys),
                worker,
                self.scheduler_address,
                describe_waiter(waiter),
                float(waiter.get("waited_s") or 0),
            )
            if self.on_board is not None:
                self.on_board(
                    "preempted",
                    {
                        "by": waiter,
                        "worker": worker,
                        "keys": keys,
                        "interrupted": hit,
                    },
                )

    def admit(self, stop: threading.Event, say: Callable[[str], None]) -> None:
        """Hold a new task back while a waiter of lower priority on the board has aged past our
        priority (``GPU_TASKS_PRIORITY_AGING``) and waits on workers we use: so a stream of our
        tasks cannot starve it. Tasks already with the scheduler keep their place.

        Raises:
            RuntimeError: ``stop`` was set (the runner is stopping).
        """
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
            if now >= next_log:
                first = max(ahead, key=lambda e: int(e["effective_priority"]))
                say(
                    f"profile {self.profile.name!r}: a task waits before going to {self.scheduler_address}: "
                    f"{describe_waiter(first)} has waited {float(first.get('waited_s') or 0):.0f}s and its "
                    f"effective priority {first['effective_priority']} exceeds this run's {self.priority} "
                    "(GPU_TASKS_PRIORITY_AGING)"
                )
                next_log = now + self.wait_log_every
            if stop.wait(BOARD_STEP_S):
                raise RuntimeError("the task runner is shutting down")

    _clear_at = -math.inf  # when the board last had no aged waiter ahead of us

    def preempted_by(self, key: str) -> dict[str, Any]:
        """The waiter ``key`` was interrupted for (``{}`` when not known)."""
        with self._busy_lock:
            return self.preempted.pop(key, {})

    def _wait_reason(self) -> str:
        fit = [w for w in self.remote.values() if w.why_not(self.profile) is None]
        return (
            f"the {len(fit)} worker(s) that fit are busy with other work"
            if fit
            else "no worker that fits is up"
        )

    def record(self, worker: str, start: float, end: float) -> None:
        with self._busy_lock:
            self._busy.setdefault(worker, []).append((start, end))
            self._tasks += 1

    def worker_devices(self, name: str) -> tuple[str, ...] | None:
        w = next((w for w in self.remote.values() if w.name == name or w.address == name), None)
        return None if w is None else w.device_keys

    def retire(self, name: str, reason: str) -> LedgerRow | None:
        """A remote worker died under a task: nothing of ours to give back (its cluster replaces it)."""
        logger.warning(
            "profile %r: worker %r of %s died (%s)", self.profile.name, name, self._where(), reason
        )
        self.remote = {a: w for a, w in self.remote.items() if w.name != name and a != name}
        return None

    def shutdown(self) -> None:
        """Close the client (the flow run ended)."""
        self._watch_stop.set()
        client, self.client = self.client, None
        if client is not None and self.board is not None:
            self.board.take_down(client)
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()

    # ------------------------------------------------------------ internals
    def _connected_workers(self, want: int, deadline: float, what: str) -> dict[str, RemoteWorker]:
        """Wait until the scheduler has ``want`` workers (or the deadline); their facts."""
        assert self.client is not None
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
                    "(GPU_TASKS_PROVISION_TIMEOUT); check that workers can start and reach the scheduler"
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

    def _check_api(self) -> None:
        if self.api_url is None or not self.profile.uses_processes:
            return
        why = loopback_api_error(self.profile.name, self.api_url, self.scheduler_address)
        if why is not None:
            raise ClusterError(why)

    def _known_workers(self) -> list[RemoteWorker]:
        """The workers this cluster's life has seen (for device models)."""
        return list(self.remote.values())

    def _busy_row(self, held: float | None, workers: int, reason: str, closed: float) -> LedgerRow:
        with self._busy_lock:
            intervals = {k: list(v) for k, v in self._busy.items()}
            tasks, self._tasks = self._tasks, 0
            self._busy.clear()
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
            **self.usage.waits(),
        )

    def _spans(
        self, intervals: dict[str, list[tuple[float, float]]], held: tuple[float, float] | None
    ) -> tuple[DeviceSpan, ...]:
        """One span per device a task ran on: over ``held`` (from, to), or, when the cluster is
        not ours to hold (``None``), from its first task's start to its last task's end."""
        models = {k: m for w in self._known_workers() for k, m in w.models().items()}
        spans: list[DeviceSpan] = []
        for key, runs in intervals.items():
            if key == "cpu" or not runs:
                continue
            start, end = held or (min(s for s, _ in runs), max(e for _, e in runs))
            named = [(d, models.get(d, "")) for d in key.split(",")]
            spans.extend(device_spans(self.profile.name, named, start, end, runs))
        return tuple(spans)


# ---------------------------------------------------------------- an existing cluster
class AddressCluster(RemoteCluster):
    """A client to an existing Dask cluster; the cluster is never started or closed here."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.profile.is_gpu:  # waits, and preemptible work, go on the scheduler's waiter board
            need = float((task_resources(self.profile) or {}).get(GPU_RESOURCE, 1.0))
            self.board = SharedBoard(self.profile.name, need, self.profile.preemptible)

    @property
    def scheduler_address(self) -> str:
        assert self.profile.address is not None
        return self.profile.address

    @property
    def worker_count(self) -> int:
        return len(self._fit) if self.client is not None else 0

    def check_reachable(self) -> None:
        """Fail at submit when workers of the address cannot reach the Prefect API."""
        self._check_api()

    def start(self, n_workers: int) -> None:
        from distributed import Client

        t0 = time.monotonic()
        deadline = t0 + self.provision_timeout
        self._check_api()
        address = self.scheduler_address
        security = security_for(self.profile) if address.startswith("tls://") else None
        try:
            client = _within(
                self.provision_timeout,
                lambda: Client(
                    address,
                    security=security,
                    timeout=self.provision_timeout,
                    set_as_default=False,
                    name=f"gpu-tasks:{self.profile.name}",
                ),
                f"client of profile {self.profile.name!r}",
            )
        except Exception as exc:
            # a Client whose constructor raised sits in a reference cycle; collected while another
            # client starts, it can hang that one (distributed 2026.7): collect it now
            gc.collect()
            hint = (
                "check the scheduler's certificates and the profile's security (or GPU_TASKS_TLS_*)"
                if address.startswith("tls://")
                else "if the scheduler uses TLS, use a tls:// address with security"
            )
            raise ClusterError(
                f"profile {self.profile.name!r}: cannot connect to the Dask scheduler at {address} within "
                f"{self.provision_timeout:g}s: {type(exc).__name__}: {exc}. Check that the scheduler runs "
                f"and this host can reach it (address, port, firewall); {hint}"
            ) from exc
        self.client = client
        try:
            workers = self._connected_workers(1, deadline, "waiting for workers")
            self._check_workers(workers)
        except BaseException:
            self.shutdown()
            raise
        self._place(workers)
        self.usage.provisioned_at = time.time()
        self.startup = {"wait_devices_s": 0.0, "start_workers_s": time.monotonic() - t0}
        busy = [w for w in self._fit if w.gpus]
        logger.info(
            "profile %r: connected to %s; %d worker(s) can run its tasks (%s); tasks wait in that "
            "scheduler's queue while other work uses their GPU resources",
            self.profile.name,
            address,
            len(self._fit),
            "; ".join(w.describe() for w in (busy or self._fit)),
        )

    def scale_to(self, n_workers: int) -> int:
        return self.worker_count  # the cluster's owner scales it

    def close(self, reason: str, hurry: bool = False) -> LedgerRow | None:
        """Close our client (the cluster keeps running); the row counts device time our tasks used."""
        if self.client is None:
            return None
        row = self._busy_row(None, len(self._fit), reason, time.time())
        self._cancel_unfinished()
        self.shutdown()
        logger.info(
            "profile %r: closed its client of %s (%s); its tasks used %.1f device-s",
            self.profile.name,
            self.scheduler_address,
            reason,
            row.busy_seconds,
        )
        self.usage.reset()
        return row

    def _where(self) -> str:
        return f"the cluster at {self.scheduler_address}"


# ---------------------------------------------------------------- a cluster manager's cluster
class ManagedCluster(RemoteCluster):
    """A cluster of ``profile.cluster_class``, created on the first task and scaled with the queue."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.manager: Any = None
        self._asked: list[float] = []  # when each requested worker was asked for (wall clock)
        self._seen: dict[str, RemoteWorker] = {}  # every worker of this lifetime

    @property
    def scheduler_address(self) -> str:
        return str(getattr(self.manager, "scheduler_address", None) or self.profile.cluster_class)

    @property
    def running(self) -> bool:
        return self.client is not None and bool(self._asked)

    @property
    def worker_count(self) -> int:
        return len(self._asked)

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(k for w in self.remote.values() for k in w.device_keys)

    def _known_workers(self) -> list[RemoteWorker]:
        return list({**self._seen, **self.remote}.values())

    def start(self, n_workers: int) -> None:
        t0 = time.monotonic()
        if self.manager is None:
            self._create()
        want = self.limit if self.profile.gang else max(1, min(n_workers, self.limit))
        self._ask(want)
        try:
            workers = self._connected_workers(
                want if self.profile.gang else 1, t0 + self.provision_timeout, f"scaled to {want}"
            )
            self._check_resources(workers)
            self._check_workers(workers)
        except BaseException:
            self.close("provisioning failed")
            self.shutdown()
            raise
        self._note(workers)
        self.startup = {"wait_devices_s": 0.0, "start_workers_s": time.monotonic() - t0}
        logger.info(
            "profile %r: %s asked for %d worker(s); %d up after %.2fs (%s)",
            self.profile.name,
            self.profile.cluster_class,
            want,
            len(workers),
            self.startup["start_workers_s"],
            "; ".join(w.describe() for w in workers.values()),
        )

    def _create(self) -> None:
        import dask

        cls = load_cluster_class(self.profile)
        name = self.profile.cluster_class

        def make() -> Any:
            # a task whose worker died is reported by the runner, not re-run by the scheduler
            # (for schedulers in this process: dask-jobqueue, LocalCUDACluster)
            with _non_daemon_workers(), dask.config.set({"distributed.scheduler.allowed-failures": 0}):
                return cls(**self.profile.cluster_kwargs)

        try:
            manager = _within(self.provision_timeout, make, f"cluster of profile {self.profile.name!r}")
        except Exception as exc:
            # TypeError or ValueError for arguments the class does not take; anything else its own
            rejected = isinstance(exc, (TypeError, ValueError))
            raise ClusterError(
                f"profile {self.profile.name!r}: {name}(**cluster_kwargs) "
                + (f"rejected cluster_kwargs {sorted(self.profile.cluster_kwargs)}" if rejected else "failed")
                + f": {type(exc).__name__}: {exc}; fix cluster_kwargs to match {name}'s arguments"
                + ("" if rejected else " or the cluster manager's configuration")
            ) from exc
        self.manager = manager
        try:
            self._check_api()
            from distributed import Client

            self.client = Client(manager, set_as_default=False, timeout=self.provision_timeout)
        except BaseException:
            self.shutdown()
            raise

    def _ask(self, n: int) -> None:
        """Scale the cluster manager to ``n`` workers; held time starts now for the new ones."""
        now = time.time()
        if self.usage.provisioned_at is None:
            self.usage.provisioned_at = now
        with _non_daemon_workers():
            self.manager.scale(n)
        self._asked = (self._asked + [now] * n)[:n]

    def _check_resources(self, workers: dict[str, RemoteWorker]) -> None:
        if not self.profile.is_gpu:
            return
        missing = [w for w in workers.values() if not w.gpus]
        if missing:
            raise ClusterError(
                f"profile {self.profile.name!r}: the workers of {self.profile.cluster_class} advertise no "
                f"Dask resource {GPU_RESOURCE!r} ({'; '.join(w.describe() for w in missing)}), so no GPU "
                "task could ever be placed. Make its workers advertise it: for dask-jobqueue "
                'cluster_kwargs worker_extra_args = ["--resources", "GPU=1"] (and processes = 1); for the '
                "dask operator's KubeCluster a worker command with --resources GPU=1 in its cluster spec "
                "(docs/distributed.md)"
            )

    def _note(self, workers: dict[str, RemoteWorker]) -> None:
        self.remote = workers
        self._seen.update(workers)

    def scale_to(self, n_workers: int) -> int:
        n = min(n_workers, self.limit)
        if self.manager is None or not self._asked or n <= len(self._asked):
            return len(self._asked)
        self._ask(n)
        with contextlib.suppress(Exception):
            self._note(read_workers(self.client))
        logger.info(
            "profile %r: asked %s for %d worker(s) because tasks were waiting",
            self.profile.name,
            self.profile.cluster_class,
            n,
        )
        return n

    def close(self, reason: str, hurry: bool = False) -> LedgerRow | None:
        """Scale to zero (the cluster object stays for the next task) and write the ledger row."""
        if self.manager is None or not self._asked:
            return None
        closed = time.time()
        with contextlib.suppress(Exception):
            self._note(read_workers(self.client))
        per = max(1, self.profile.devices_per_worker)
        held = sum(closed - t for t in self._asked) * per
        row = self._busy_row(held, len(self._asked), reason, closed)
        if not row.devices:
            row.devices = tuple(k for w in self._seen.values() for k in w.device_keys)
        try:
            with _non_daemon_workers():
                self.manager.scale(0)
        except Exception:
            logger.warning("profile %r: error while scaling to zero", self.profile.name, exc_info=True)
        self._asked = []
        self.remote = {}
        self._seen = {}
        self.usage.reset()
        logger.info(
            "profile %r: scaled %s to zero (%s); held %.1f device-s, busy %.1f device-s",
            self.profile.name,
            self.profile.cluster_class,
            reason,
            row.held_seconds,
            row.busy_seconds,
        )
        return row

    def shutdown(self) -> None:
        """Close the client and the cluster manager's cluster (the flow run ended)."""
        super().shutdown()
        manager, self.manager = self.manager, None
        if manager is not None:
            try:
                manager.close()
            except Exception:
                logger.warning(
                    "profile %r: error while closing its cluster", self.profile.name, exc_info=True
                )

    def _where(self) -> str:
        return f"{self.profile.cluster_class} at {self.scheduler_address}"


def remote_cluster(
    profile: ResourceProfile,
    worker_env: dict[str, str],
    provision_timeout: float,
    dashboard: bool,
    api_url: str | None,
) -> RemoteCluster:
    """The cluster of an ``address`` or ``cluster_class`` profile."""
    cls = AddressCluster if profile.address is not None else ManagedCluster
    return cls(profile, worker_env, provision_timeout, dashboard, api_url)
