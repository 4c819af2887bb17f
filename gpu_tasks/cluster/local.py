"""One profile's cluster within one flow run: lease devices, start, grow, account, close. It acts on
the decisions of :mod:`gpu_tasks.policy`; workers come from :mod:`gpu_tasks.cluster.backends`."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from gpu_tasks.allocation import PLACEMENT_FREE_ENV
from gpu_tasks.cluster import backends
from gpu_tasks.devices import leases, programs
from gpu_tasks.devices.book import DeviceBook
from gpu_tasks.devices.discovery import Device, Inventory
from gpu_tasks.devices.topology import LEVELS
from gpu_tasks.errors import ClusterError
from gpu_tasks.policy import (
    WorkerSpec,
    desired_workers,
    gang_wiring,
    matching_devices,
    max_worker_count,
    placement_groups,
    set_level,
    worker_groups,
    worker_spec,
)
from gpu_tasks.prefect_api.tag_slots import placement_tags_unlimited
from gpu_tasks.profiles import ResourceProfile
from gpu_tasks.reporting.ledger import Held, LedgerRow, Usage
from gpu_tasks.reporting.measured import NOT_EMULATED
from gpu_tasks.settings import GpuTasksSettings, get_settings
from gpu_tasks.worker import affinity

logger = logging.getLogger(__name__)


def _held(specs: list[WorkerSpec]) -> list[Held]:
    return [
        Held(s.name, tuple(d.address for d in s.devices), tuple(d.model() for d in s.devices), s.cpus)
        for s in specs
    ]


def run_priority(profile: ResourceProfile, settings: GpuTasksSettings | None = None) -> int:
    """The priority ``profile`` waits for devices at: ``GPU_TASKS_PRIORITY`` when set, else its own."""
    override = (settings or get_settings()).priority
    return profile.priority if override is None else override


def _addresses(specs: list[WorkerSpec]) -> list[str]:
    return [d.address for s in specs for d in s.devices]


class ProfileCluster:
    """The live cluster of one profile within one flow run."""

    # Its workers are not this flow run's own (``address``, ``cluster_class``): the runner hands off
    # one at a time, holds quota slots while a task runs, and fails the tasks of a failed start.
    shared = False
    # why a task still running when the flow run stopped did not finish (its crash report)
    stopped_note = "its worker was closed"
    # the keys its close found running (a shared cluster's; ``None``: it cannot tell)
    stopped_running: set[str] | None = None

    def subscribe(self, topic: str, handler: Any) -> None:
        """Call ``handler(event)`` for Dask events on ``topic``: a shared cluster's workers' (remote.py);
        this flow run's own workers tell of their crashes otherwise."""

    def __init__(
        self,
        profile: ResourceProfile,
        inventory: Inventory,
        worker_env: dict[str, str],
        provision_timeout: float,
        dashboard: bool = False,
        book: DeviceBook | None = None,
        pool: Any = None,
    ) -> None:
        self.profile = profile
        self.priority = run_priority(profile)  # what it waits for devices at and holds them with
        # warm worker processes (gpu_tasks.worker.warm), for the profiles whose workers can use them
        self.pool = pool if backends.uses_warm_pool(profile, inventory.emulated) else None
        self.book = book or DeviceBook()
        self.inventory = inventory
        self.worker_env = worker_env
        self.provision_timeout = provision_timeout
        self.dashboard = dashboard
        # every group its workers may own; a start or a growth chooses by what is free then
        self.groups: list[tuple[Device, ...]] = worker_groups(profile, inventory) if profile.is_gpu else []
        self.limit = max_worker_count(profile, len(self.groups))
        self.specs: list[WorkerSpec] = []
        self.retired: set[str] = set()  # names of workers removed one by one
        self.backend: backends.Backend | None = None
        self.usage = Usage()
        if profile.is_gpu and inventory.emulated:  # never sampled: the ledger says so, with no numbers
            self.usage.not_measured(NOT_EMULATED)
        self.startup: dict[str, float] = {}  # seconds the last start() spent in each phase
        self.preemptions = 0  # times its workers were stopped for a higher-priority waiter

    @property
    def running(self) -> bool:
        return self.backend is not None

    def lost(self) -> str | None:
        """Why a running cluster can no longer take tasks, so a new task starts it again; ``None`` here
        (its own processes end with it)."""
        return None

    @property
    def worker_count(self) -> int:
        return len(self.specs)

    @property
    def slots(self) -> int | None:
        """Tasks one worker runs at once, where the workers started tell (the fewest of theirs)."""
        return min((s.nthreads for s in self.specs), default=None)

    def workers_wanted(self, tasks: int) -> int:
        """The workers ``tasks`` tasks want (:func:`gpu_tasks.policy.desired_workers`), within its limit."""
        return desired_workers(self.profile, tasks, self.worker_count, self.limit, self.slots)

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(_addresses(self.specs))

    @property
    def emulated(self) -> bool:
        return bool(self.profile.is_gpu and self.inventory.emulated)

    @property
    def unit(self) -> str:
        """Of the held and busy time its log lines tell."""
        return "device-s" if self.profile.is_gpu else "worker-s"

    @property
    def queue_priority(self) -> int | None:
        """The priority it holds this host's devices at; ``None`` for profiles that never queue here."""
        return self.priority if self.profile.is_gpu and self.profile.is_local else None

    @property
    def gang_wiring(self) -> dict[str, str]:
        """A running gang's devices and the worst link between them, for its events (``{}`` else)."""
        gang, worst, _ = self.usage.gang_wiring
        return {"gang": ",".join(gang), "worst_link": worst} if gang and worst else {}

    @property
    def dashboard_link(self) -> str | None:
        return self.backend.dashboard_link if self.backend is not None else None

    # ------------------------------------------------------------ lifecycle
    def start(self, n_workers: int) -> None:
        """Start the cluster with ``n_workers`` workers (:meth:`workers_wanted`, the one count) and wait
        until they are up (else ``ClusterError``)."""
        asked = time.monotonic()
        # with a warm pool, all that needs no device happens before the lease, which only binds them
        backend = self._start_before_lease(n_workers) if self.pool is not None else None
        prepared = time.monotonic()
        self._placement_limits()
        try:
            groups = self._acquire(n_workers)
        except BaseException:
            if backend is not None:
                backend.close()
            raise
        specs = [self._spec(i, g) for i, g in enumerate(groups)]
        if backend is not None and backend.scheduler_gone():  # its workers would wait for it to time out
            logger.warning(
                "profile %r: its scheduler process ended while the profile waited for devices (killed, "
                "or out of memory); starting another",
                self.profile.name,
            )
            backend.close()
            backend = None
        self._say_wiring(groups)
        acquired = time.time()  # devices are held from here: start-up time counts as held
        t0 = time.monotonic()
        try:
            if backend is None:
                backend = self._backend(specs, lambda: [self._spec(i) for i in range(len(self.groups))])
            else:
                backend.add(specs, len(specs))
        except Exception as exc:
            if backend is not None:
                backend.close()
            self.book.release(self.profile.name, _addresses(specs))
            raise self._start_error(len(specs), _addresses(specs), exc) from exc
        self.backend = backend
        self.specs = specs
        self.usage.held(_held(specs), since=acquired)
        self.startup = {
            "prepare_s": prepared - asked,
            "wait_devices_s": t0 - prepared,
            "start_workers_s": time.monotonic() - t0,
        }
        logger.info(
            "profile %r: provisioned %d worker(s) on %s in %.2fs",
            self.profile.name,
            len(specs),
            self._where(),
            self.startup["start_workers_s"],
        )

    def _placement_limits(self) -> None:
        """Before a GPU profile's lease: tell its workers when the placement tags have no concurrency
        limit (:data:`~gpu_tasks.allocation.PLACEMENT_FREE_ENV`), so they ask for no slots."""
        if not self.profile.is_gpu or get_settings().tag_limit_cache_seconds <= 0:
            return
        env = {k: v for k, v in self.worker_env.items() if k != PLACEMENT_FREE_ENV}
        if placement_tags_unlimited():
            env[PLACEMENT_FREE_ENV] = repr(time.time())
        self.worker_env = env

    def _start_before_lease(self, n_workers: int) -> backends.Backend:
        """Warm processes ready for ``n_workers`` workers and a scheduler with none, before any lease."""
        try:
            assert self.pool is not None
            self.pool.wait_ready(n_workers, self.provision_timeout)
            return self._backend([], lambda: [])
        except Exception as exc:
            raise self._start_error(n_workers, [], exc) from exc

    def _backend(
        self, specs: list[WorkerSpec], every_spec: Callable[[], list[WorkerSpec]]
    ) -> backends.Backend:
        return backends.start(
            self.profile,
            specs,
            every_spec,
            self.inventory.emulated,
            self.provision_timeout,
            self.dashboard,
            pool=self.pool,
        )

    def _start_error(self, n: int, devices: list[str], exc: BaseException) -> ClusterError:
        # a deadline only when one passed: a worker that dies while starting fails at once
        within = f" within {self.provision_timeout:g}s" if isinstance(exc, TimeoutError) else ""
        return ClusterError(
            f"profile {self.profile.name!r}: could not start {n} worker(s) "
            f"({'devices: ' + ','.join(devices) if devices else 'before its device lease'}){within}: "
            f"{type(exc).__name__}: {exc}"
        )

    def _acquire(self, n_workers: int, block: bool = True) -> list[tuple[Device, ...]]:
        """The device groups leased for ``n_workers`` workers (CPU profiles: empty ones); without
        ``block``, those free now. A gang waits for all of them at once, so two gangs never each hold half."""
        if not self.profile.is_gpu:
            return [()] * n_workers
        groups = self._placement(n_workers)
        gang = self.profile.gang
        try:
            indexes = self.book.acquire(
                self.profile.name,
                groups,
                n_workers,
                block=block,
                at_least=n_workers if gang else 1,
                **self._queueing(),
            )
        except ClusterError as exc:
            if not gang:
                raise
            raise ClusterError(
                f"profile {self.profile.name!r} is a gang of {n_workers} workers; it starts all of them "
                f"or none: {exc}"
            ) from exc
        finally:
            self.usage.skipped(self.book.skips(self.profile.name))
        return [groups[i] for i in indexes]

    def _placement(self, n_workers: int) -> list[tuple[Device, ...]]:
        """The groups to lease ``n_workers`` new workers from, best-wired free sets first where wiring
        is known (:func:`gpu_tasks.policy.placement_groups`)."""
        wiring = self.inventory.wiring
        if not wiring.known:
            return self.groups
        matching = matching_devices(self.profile, self.inventory)
        addresses = [d.address for d in matching]
        with self.book.cond:
            mine = set(self.book.holders)
        others = leases.holders(self.book.lease_dir, [a for a in addresses if a not in mine])
        free = {a for a in addresses if a not in mine and others.get(a) is None}
        return placement_groups(self.profile, wiring, matching, free, n_workers)

    def _say_wiring(self, groups: list[tuple[Device, ...]]) -> None:
        """Log how the devices just leased are wired (without a ``topology`` level: which it got)."""
        wiring = self.inventory.wiring
        if not wiring.known or not groups or self.profile.devices_per_worker == 0:
            return
        sets = [[d.address for d in g] for g in groups]
        if self.profile.gang:  # a gang's workers talk to each other: its whole set counts
            sets = [[a for s in sets for a in s]]
            worst, better = gang_wiring(wiring, sets[0], matching_devices(self.profile, self.inventory))
            self.usage.gang(tuple(sets[0]), worst, better)
        for addresses in sets:
            if len(addresses) < 2:
                continue
            paths = sorted({wiring.link(a, b) for i, a in enumerate(addresses) for b in addresses[i + 1 :]})
            logger.info(
                "profile %r: devices %s are wired %s (level %s; topology=%r)",
                self.profile.name,
                ",".join(addresses),
                "/".join(paths),
                LEVELS[set_level(wiring, addresses)],
                self.profile.topology,
            )

    def scale_to(self, n_workers: int) -> int:
        """Grow a GPU profile to ``n_workers`` (:meth:`workers_wanted`; never shrinks while running); the
        new count."""
        if self.backend is None or not self.profile.is_gpu or n_workers <= len(self.specs):
            return len(self.specs)
        groups = self._acquire(n_workers - len(self.specs), block=False)
        if not groups:
            return len(self.specs)  # other profiles hold the rest: tasks queue on the workers we have
        new = [self._spec(len(self.specs) + k, g) for k, g in enumerate(groups)]
        self._say_wiring(groups)
        total = len(self.specs) + len(new)
        acquired = time.time()
        try:
            self.backend.add(new, total)
        except Exception as exc:
            self.book.release(self.profile.name, _addresses(new))
            raise ClusterError(
                f"profile {self.profile.name!r}: could not grow to {total} workers within "
                f"{self.provision_timeout:g}s: {exc}"
            ) from exc
        self.specs.extend(new)
        self.usage.held(_held(new), since=acquired)
        logger.info(
            "profile %r: scaled up to %d worker(s) (%s) because tasks were waiting",
            self.profile.name,
            total,
            self._where(),
        )
        return total

    def submit(self, fn: Any, *args: Any, key: str, resources: dict[str, float] | None) -> Any:
        """Submit ``fn(*args)``: a future with ``add_done_callback`` and ``result``."""
        return self._running().submit(fn, *args, key=key, resources=resources)

    def submit_many(
        self, fn: Any, argss: list[tuple[Any, ...]], keys: list[str], resources: dict[str, float] | None
    ) -> list[Any]:
        """:meth:`submit` for each of ``argss`` at once (one graph on a Dask cluster)."""
        return self._running().submit_many(fn, argss, keys, resources)

    def _running(self) -> backends.Backend:
        if self.backend is None:
            raise ClusterError(f"profile {self.profile.name!r}: its cluster is not running")
        return self.backend

    def record(self, worker: str, start: float, end: float, interrupted: bool = False) -> None:
        """Record that a task ran on ``worker`` (:func:`~gpu_tasks.reporting.ledger.worker_key`);
        ``interrupted``: it did not finish (its cluster closed or its worker died at ``end``)."""
        self.usage.record(worker, start, end, interrupted)

    def drain(self, wait: bool = True) -> None:
        """Let running in-flow-process tasks finish before the runner closes (``wait``: for them)."""
        if self.backend is not None:
            self.backend.drain(wait)

    def close(self, reason: str, hurry: bool = False) -> LedgerRow | None:
        """Close the cluster; its ledger row (``None``: not running). ``hurry``: terminate the workers
        first (the flow was interrupted), as Dask's graceful close waits for each busy one."""
        backend, self.backend = self.backend, None
        if backend is None:
            return None
        row = self.usage.row(self.profile.name, _held(self.specs), self.emulated, time.time(), reason)
        if hurry:
            backend.terminate()
        try:
            backend.close()
        except Exception:
            logger.warning("profile %r: error while closing its workers", self.profile.name, exc_info=True)
        self.book.release(self.profile.name, self.devices)
        self._log_given_back("closed cluster", reason, row)
        self.specs = []
        self.usage.reset()
        return row

    def shutdown(self) -> None:
        """Release what outlives an idle close (after :meth:`close`, when the flow run ends)."""

    def worker_devices(self, name: str) -> tuple[str, ...] | None:
        """Device addresses of the worker called ``name`` (``None``: no such worker of ours)."""
        spec = next((s for s in self.specs if s.name == name), None)
        return None if spec is None else tuple(d.address for d in spec.devices)

    def retire(self, name: str, reason: str, keep: bool = False) -> LedgerRow | None:
        """Remove the dead worker ``name`` and give its devices back; the ledger row. The whole cluster
        closes after its last worker (unless ``keep``), or for a worker not ours by name (dask-cuda's)."""
        spec = next((s for s in self.specs if s.name == name), None)
        if self.backend is None or (spec is None and name in self.retired):
            return None  # nothing running, or retired already (found lost while idle)
        if spec is None or (len(self.specs) == 1 and not keep):
            return self.close(reason)
        [held] = _held([spec])
        row = self.usage.row(self.profile.name, [held], self.emulated, time.time(), reason, whole=False)
        try:
            self.backend.remove(name)
        except Exception:
            logger.warning(
                "profile %r: error while removing worker %r", self.profile.name, name, exc_info=True
            )
        self.specs.remove(spec)
        self.retired.add(name)
        self.usage.forget(held)
        self.book.release(self.profile.name, list(held.devices))
        self._log_given_back(f"removed worker {name!r}", reason, row)
        return row

    def _log_given_back(self, what: str, reason: str, row: LedgerRow) -> None:
        logger.info(
            "profile %r: %s (%s); held %.1f %s, busy %.1f %s%s",
            self.profile.name,
            what,
            reason,
            row.held_seconds,
            self.unit,
            row.busy_seconds,
            self.unit,
            f"; {row.interrupted} task(s) interrupted, busy until then" if row.interrupted else "",
        )

    def _queueing(self) -> dict[str, Any]:
        """How this profile waits in the device queue (gpu_tasks.devices.book.DeviceBook.acquire)."""
        return {
            "priority": self.priority,
            "preemptible": self.profile.preemptible,
            "quota": self.profile.quota,
            "patient": self.preemptions > 0,  # preempted: wait without GPU_TASKS_LEASE_TIMEOUT
            "need_memory": self.profile.need_memory_free,  # free when leased: other programs use the rest
            "min_run_time": self.profile.min_run_time or 0.0,  # not preempted this long after leasing
        }

    # ------------------------------------------------------------ preemption
    def workers_on(self, addresses: Any) -> list[str]:
        """Names of the workers holding any of ``addresses``."""
        wanted = set(addresses)
        return [s.name for s in self.specs if wanted.intersection(d.address for d in s.devices)]

    def whole_stop(self, names: list[str]) -> bool:
        """Whether stopping the workers ``names`` stops the whole cluster: a gang, all of its
        workers, or workers it cannot stop one by one (dask-cuda names its own)."""
        return (
            self.profile.gang
            or set(names) >= {s.name for s in self.specs}
            or self.backend is None
            or not self.backend.worker_names().issuperset(names)
        )

    def admit(self, stop: threading.Event, say: Callable[[str], None]) -> None:
        """Hold a new task back for a shared scheduler's aged waiters (local ones age in the device queue)."""

    def preempted_by(self, key: str) -> dict[str, Any]:
        """The waiter a shared scheduler's task ``key`` was interrupted for (local workers are stopped)."""
        return {}

    def lend(self, task_run: str, borrowed: bool) -> None:
        """Mark a shared scheduler's task as on borrowed quota (local borrowing is in the leases)."""

    def owed_waiters(self) -> list[Any]:
        """Other teams' waiters a shared scheduler's board says are owed devices (none here)."""
        return []

    def lost_workers(self, grace: float) -> list[tuple[str, str | None]]:
        """Its workers whose process ended ``grace`` s ago, unclosed (see ``Backend.lost``)."""
        if self.backend is None:
            return []
        names = {s.name for s in self.specs}
        return [(n, a) for n, a in self.backend.lost(grace) if n in names]

    def running_keys(self, names: list[str]) -> set[str] | None:
        """Keys of the tasks Dask has handed to the workers ``names`` (``None``: cannot tell)."""
        if self.backend is None:
            return set()
        return self.backend.processing(names)

    def stop_workers(self, names: list[str], reason: str, keys: set[str] | None = None) -> list[LedgerRow]:
        """Stop the workers ``names`` at once (their tasks, ``keys``, die and run again), give their
        devices back; the ledger rows."""
        if self.backend is None or not names:
            return []
        self.preemptions += 1
        if self.whole_stop(names):
            row = self.close(reason, hurry=True)
            return [row] if row is not None else []
        self.backend.terminate(names, keys)
        rows = [self.retire(name, reason) for name in names]
        return [r for r in rows if r is not None]

    # ------------------------------------------------------------ internals
    def _where(self) -> str:
        if not self.profile.is_gpu:
            mode = "processes" if self.profile.uses_processes else "threads in the flow process"
            return f"CPU ({mode})"
        kind = "emulated devices" if self.inventory.emulated else "devices"
        return f"{kind} {','.join(self.devices) or '?'}"

    def _spec(self, index: int, devices: tuple[Device, ...] | None = None) -> WorkerSpec:
        if devices is None:
            devices = self.groups[index] if self.profile.is_gpu else ()
        by_memory = self.profile.by_memory and devices  # tasks are packed against what others leave free
        use = programs.sample(devices, self.book.lease_dir).get(devices[0].address) if by_memory else None
        free_bytes = use.free if use is not None else None
        spec = worker_spec(
            self.profile, index, devices, self.inventory.emulated, extra_env=self.worker_env, free=free_bytes
        )
        if by_memory:
            logger.info(
                "profile %r: device %s has %s free: %d task(s) of gpu_memory_per_task=%s at once",
                self.profile.name,
                devices[0].address,
                "unknown memory" if free_bytes is None else f"{free_bytes / 2**30:.1f} GiB",
                spec.nthreads,
                f"{(self.profile.gpu_memory_per_task or 0) / 2**30:g}GiB",
            )
        if not spec.devices:
            return spec
        # on its devices' CPUs (gpu_tasks.worker.affinity: the worker applies, the ledger records)
        env, record = affinity.plan(
            self.profile.cpu_affinity, [self.inventory.wiring.cpus_of(d.address) for d in spec.devices]
        )
        return dataclasses.replace(spec, env={**spec.env, affinity.ENV: env}, cpus=record)
