"""One profile's Dask cluster: start, grow, account for, close.

The decisions (how many workers, which devices, when to close) come from
:mod:`gpu_tasks.policy`; this module only acts on them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_tasks import _gpu, leases
from gpu_tasks._slots import SlotPool
from gpu_tasks.devices import Device, Inventory
from gpu_tasks.errors import ClusterError
from gpu_tasks.policy import WorkerSpec, device_groups, matching_devices, max_worker_count, worker_spec
from gpu_tasks.profiles import ResourceProfile
from gpu_tasks.settings import get_settings, resolve

logger = logging.getLogger(__name__)

LOCALHOST = "127.0.0.1"


@dataclass
class LedgerRow:
    """One cluster lifetime, for the resource ledger."""

    profile: str
    workers: int
    devices: tuple[str, ...]
    emulated: bool
    provisioned_at: float
    closed_at: float
    held_seconds: float
    busy_seconds: float
    tasks: int
    reason: str

    @property
    def utilization(self) -> float:
        """Busy over held (1.0 is the physical limit)."""
        return self.busy_seconds / self.held_seconds if self.held_seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Plain dict for artifacts and JSON."""
        return {
            "profile": self.profile, "workers": self.workers, "devices": ",".join(self.devices) or "-",
            "emulated": self.emulated, "provisioned_at": self.provisioned_at, "closed_at": self.closed_at,
            "held_s": round(self.held_seconds, 3), "busy_s": round(self.busy_seconds, 3),
            "utilization": round(self.utilization, 3), "tasks": self.tasks, "reason": self.reason,
        }


def _non_daemon_workers() -> Any:
    """Start worker processes as non-daemonic, so tasks may start processes of their own
    (a training gang, a dask-cuDF cluster). The nanny still stops them when the cluster
    closes; the lifecycle tests prove none outlives the flow."""
    import dask

    return dask.config.set({"distributed.worker.daemon": False})


def _within(seconds: float, fn: Any, what: str) -> Any:
    """``fn()`` in a daemon thread, giving up after ``seconds``.

    Dask's SpecCluster can wait forever when a worker process fails while starting
    (for one, a script that runs its flow at import time under the spawn start
    method). A result that arrives after the deadline is closed, not leaked.
    """
    box: dict[str, Any] = {}
    done = threading.Event()
    lock = threading.Lock()

    def run() -> None:
        try:
            value = fn()
        except BaseException as exc:  # handed to the caller below
            box["error"] = exc
        else:
            with lock:
                box["value"] = value
                late = box.get("abandoned", False)
            if late:
                with contextlib.suppress(Exception):
                    value.close()
        finally:
            done.set()

    threading.Thread(target=run, name=f"gpu-tasks-start-{what}", daemon=True).start()
    if not done.wait(seconds):
        with lock:
            box["abandoned"] = True
            value = box.get("value")
        if value is None:
            raise TimeoutError(
                f"{what} did not start within {seconds:g}s (GPU_TASKS_PROVISION_TIMEOUT). Worker "
                "processes are spawned and re-import the script that started the flow: guard "
                "the flow call with `if __name__ == \"__main__\":`, and see the Dask log above"
            )
    if "error" in box:
        raise box["error"]
    return box["value"]


def worker_key(devices: Any) -> str:
    """Key that ties a task's timing to its worker: its devices, or ``"cpu"``."""
    return ",".join(devices) or "cpu"


def _union_seconds(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


class DeviceBook:
    """Which profile's cluster holds each device, within one entered runner.

    A device belongs to at most one profile's cluster at a time, whole or fractional:
    a profile waits (logged) for devices another profile holds, and an idle holder is
    asked to give them back at once (``reclaim``) instead of after its idle timeout.

    Across processes (flow runs) on this host, a device the book hands out is also
    leased (:mod:`gpu_tasks.leases`, in ``lease_dir``): a group is free only when this
    book has it free and every one of its devices can be leased now. The lease is
    given back when the book's holder releases the device. A profile that waits
    ``lease_timeout`` seconds for devices other processes lease gets a ``ClusterError``.

    Waiters are queued: a profile that has to wait registers, in this book and as a
    waiter file in ``lease_dir`` (:func:`gpu_tasks.leases.enqueue`), and a group is
    not taken while a waiter that ranks before the taker (higher ``priority``, then
    earlier arrival; :func:`gpu_tasks.leases.rank`), of this book or of any process,
    wants one of its devices.
    """

    def __init__(
        self, reclaim: Any = None, stop: threading.Event | None = None, log_every: float = 30.0,
        lease_dir: Path | None = None, lease_timeout: float | None = None,
    ):
        self.holders: dict[str, str] = {}
        self.cond = threading.Condition()
        self.reclaim = reclaim  # reclaim(wanted_devices, by_profile) -> None; closes idle holders
        self.stop = stop or threading.Event()
        self.log_every = log_every
        settings = get_settings() if lease_dir is None or lease_timeout is None else None
        self.lease_dir = Path(resolve(lease_dir, "lease_dir", settings))
        self.lease_timeout = float(resolve(lease_timeout, "lease_timeout", settings))
        self.leases: dict[str, leases.Lease] = {}  # address -> this process's lease on it
        self.waiting: dict[int, dict[str, Any]] = {}  # this book's waiters (leases.rank fields), by id

    def acquire(
        self, owner: str, groups: list[tuple[Device, ...]], n: int, block: bool, priority: int = 0,
    ) -> list[int]:
        """Up to ``n`` indexes of ``groups`` whose devices are all free, now held by ``owner``.

        With ``block``, waits until at least one group is free (or the runner stops),
        queued by ``priority`` (higher first), then arrival, behind earlier waiters of
        this book and of other processes.

        Raises:
            ClusterError: waited ``lease_timeout`` seconds for devices other processes lease.
        """
        wanted = {d.address for g in groups for d in g}
        me: dict[str, Any] = {
            "profile": owner, "priority": int(priority), "arrived": time.time(), "addresses": sorted(wanted),
            "local": True,
        }
        waiter: leases.Waiter | None = None
        waited_since = time.monotonic()
        foreign_since: float | None = None
        last_log: float | None = None
        last_yield_log: float | None = None
        try:
            while True:
                with self.cond:
                    free, foreign, first = self._take_free(owner, groups, n, me)
                    if free or not block or n <= 0:
                        if free and time.monotonic() - waited_since > 0.5:
                            logger.info("profile %r: got devices after waiting %.1fs", owner,
                                        time.monotonic() - waited_since)
                        return free
                    self.waiting[id(me)] = me
                    held_by = {self.holders[a] for a in wanted if self.holders.get(a) not in (None, owner)}
                if self.stop.is_set():
                    raise ClusterError(f"profile {owner!r}: the runner stopped while waiting for devices")
                if waiter is None:
                    waiter = self._enqueue(owner, me)
                now = time.monotonic()
                # the lease timeout runs while only other processes stand in the way
                if not foreign or held_by or any(w.get("local") for w in first):
                    foreign_since = None
                elif foreign_since is None:
                    foreign_since = now
                if foreign_since is not None and now - foreign_since >= self.lease_timeout:
                    raise ClusterError(self._timeout_message(owner, sorted(wanted), now - foreign_since, first))
                if self.reclaim is not None:
                    self.reclaim(wanted, owner)
                if first and (last_yield_log is None or now - last_yield_log >= self.log_every):
                    last_yield_log = now
                    logger.info(
                        "profile %r (priority %d): letting waiter(s) that rank before it have devices first: %s",
                        owner, priority, self._waiters_text(first),
                    )
                if last_log is None or now - last_log >= self.log_every:
                    last_log = now
                    if held_by:
                        logger.info(
                            "profile %r: waiting for devices %s, held by busy profile(s) %s; they are "
                            "released when those clusters go idle", owner, ",".join(sorted(wanted)),
                            ", ".join(repr(h) for h in sorted(held_by)),
                        )
                    if foreign:
                        logger.info(
                            "profile %r: waiting for devices leased by other processes on this host: %s; "
                            "giving up after %gs (GPU_TASKS_LEASE_TIMEOUT)", owner,
                            self._holders_text(sorted(foreign)), self.lease_timeout,
                        )
                with self.cond:
                    self.cond.wait(timeout=0.5)
        finally:
            if id(me) in self.waiting:
                with self.cond:
                    del self.waiting[id(me)]
                    self.cond.notify_all()  # waiters that let this one go first may go now
            leases.dequeue(waiter)

    def release(self, owner: str, devices: Any) -> None:
        """Give back ``devices`` held by ``owner`` (and this process's leases on them)."""
        with self.cond:
            for address in devices:
                if self.holders.get(address) == owner:
                    del self.holders[address]
                    leases.release(self.leases.pop(address, None), [address])
            self.cond.notify_all()

    def _take_free(
        self, owner: str, groups: list[tuple[Device, ...]], n: int, me: dict[str, Any],
    ) -> tuple[list[int], set[str], list[dict[str, Any]]]:
        """Hold up to ``n`` groups free in this book whose new devices lease now (under ``cond``).

        A group that a waiter ranking before ``me`` wants is left to that waiter.
        Returns the groups' indexes, the devices other processes (their leases or their
        first-ranked waiters) kept from us, and the waiters we let go first.
        """
        free: list[int] = []
        foreign: set[str] = set()
        first: dict[int, dict[str, Any]] = {}
        rivals: list[dict[str, Any]] | None = None
        try:
            for i, g in enumerate(groups):
                if len(free) >= n:
                    break
                held = [self.holders.get(d.address) for d in g]
                if any(h not in (None, owner) for h in held) or all(h == owner for h in held):
                    continue
                if rivals is None:
                    rivals = self._rivals(owner)
                before = leases.ahead(me, rivals, [d.address for d in g])
                if before:
                    first.update((id(w), w) for w in before)
                    foreign.update(d.address for d in g if any(not w.get("local") for w in before))
                    continue
                new = [d.address for d in g if d.address not in self.holders]
                lease = leases.take(new, leases.owner_info(owner), self.lease_dir) if new else None
                if new and lease is None:
                    foreign.update(new)
                    continue
                for address in new:
                    self.leases[address] = lease  # type: ignore[assignment]
                for d in g:
                    self.holders[d.address] = owner
                free.append(i)
        except OSError as exc:
            for i in free:
                for d in groups[i]:
                    self.holders.pop(d.address, None)
                    leases.release(self.leases.pop(d.address, None), [d.address])
            raise self._lease_error(owner, exc) from exc
        return free, foreign, sorted(first.values(), key=leases.rank)

    def _rivals(self, owner: str) -> list[dict[str, Any]]:
        """Other profiles' waiters in this book, and the live waiters of other books (processes)."""
        local = [w for w in self.waiting.values() if w["profile"] != owner]
        mine = {w.get("file") for w in self.waiting.values()}
        return local + [w for w in leases.waiters(self.lease_dir) if w["file"] not in mine]

    def _enqueue(self, owner: str, me: dict[str, Any]) -> leases.Waiter:
        """Register ``me`` as a waiter file, so other processes let it go first when it ranks first."""
        try:
            waiter = leases.enqueue(me["addresses"], leases.owner_info(owner), me["priority"], me["arrived"],
                                    self.lease_dir)
        except OSError as exc:
            raise self._lease_error(owner, exc) from exc
        with self.cond:
            me["file"] = waiter.name
        return waiter

    def _lease_error(self, owner: str, exc: OSError) -> ClusterError:
        return ClusterError(
            f"profile {owner!r}: cannot lease devices in {str(self.lease_dir)!r}: {exc}; set "
            "GPU_TASKS_LEASE_DIR to a directory this user can write"
        )

    @staticmethod
    def _waiters_text(waiters: list[dict[str, Any]]) -> str:
        """``profile 'x' of this flow run (priority 5, waiting 3.0s for devices 0,1); ...``."""
        now = time.time()
        parts = []
        for w in waiters:
            who = f"profile {w.get('profile')!r} of this flow run" if w.get("local") else leases.describe(w)
            waited = max(0.0, now - float(w.get("arrived", now)))
            parts.append(f"{who} (priority {w.get('priority', 0)}, waiting {waited:.1f}s for devices "
                         f"{','.join(w.get('addresses') or ())})")
        return "; ".join(parts)

    def _holders_text(self, addresses: list[str]) -> str:
        """``device 0: flow run 'x' (id ...), pid 12`` for each of ``addresses``."""
        foreign = leases.holders(self.lease_dir, [a for a in addresses if a not in self.holders])
        return "; ".join(
            f"device {a}: profile {self.holders[a]!r} of this flow run" if a in self.holders
            else f"device {a}: {leases.describe(foreign[a])}"
            for a in addresses
        )

    def _timeout_message(self, owner: str, wanted: list[str], waited: float, first: list[dict[str, Any]]) -> str:
        queued = f"; waiters that rank before it: {self._waiters_text(first)}" if first else ""
        return (
            f"profile {owner!r}: waited {waited:.1f}s for devices other processes on this host lease "
            f"({self._holders_text(wanted)}{queued}). Stop those flow runs or wait longer: raise "
            f"GPU_TASKS_LEASE_TIMEOUT (now {self.lease_timeout:g}s); leases are in {str(self.lease_dir)!r} "
            "(GPU_TASKS_LEASE_DIR)"
        )


class ProfileCluster:
    """The live Dask cluster of one profile within one flow run."""

    def __init__(
        self,
        profile: ResourceProfile,
        inventory: Inventory,
        worker_env: dict[str, str],
        provision_timeout: float,
        dashboard: bool = False,
        book: DeviceBook | None = None,
    ) -> None:
        self.profile = profile
        self.book = book or DeviceBook()
        self.inventory = inventory
        self.worker_env = worker_env
        self.provision_timeout = provision_timeout
        self.dashboard = dashboard
        self.groups: list[tuple[Device, ...]] = (
            device_groups(profile, matching_devices(profile, inventory)) if profile.is_gpu else []
        )
        self.limit = max_worker_count(profile, len(self.groups))
        self.specs: list[WorkerSpec] = []
        self.cluster: Any = None
        self.client: Any = None
        self.provisioned_at: float | None = None
        self._worker_started: dict[str, float] = {}
        self._busy: dict[str, list[tuple[float, float]]] = {}
        self._tasks = 0
        self._lock = threading.Lock()
        self._cuda_next: list[str] = []  # devices leased for the next dask-cuda workers
        # seconds the last start() spent waiting for devices and starting workers
        self.startup: dict[str, float] = {}

    # ------------------------------------------------------------ properties
    @property
    def running(self) -> bool:
        """Whether the cluster is up."""
        return self.cluster is not None

    @property
    def worker_count(self) -> int:
        """Workers started so far."""
        return len(self.specs)

    @property
    def devices(self) -> tuple[str, ...]:
        """Device addresses the cluster holds now."""
        return tuple(d.address for spec in self.specs for d in spec.devices)

    @property
    def dashboard_link(self) -> str | None:
        """The Dask dashboard URL, when dashboards are on."""
        if not (self.dashboard and self.client is not None):  # no dashboard for thread workers
            return None
        return self.client.dashboard_link

    # ------------------------------------------------------------ lifecycle
    def start(self, n_workers: int) -> None:
        """Start the cluster with ``n_workers`` workers and wait until they are up.

        Raises:
            ClusterError: naming the profile and devices when workers do not start.
        """
        n_workers = max(1, min(n_workers, self.limit))
        asked = time.monotonic()
        if self.profile.is_gpu and self.profile.gang:
            indexes = self._acquire_gang(n_workers)
        elif self.profile.is_gpu:
            indexes = self.book.acquire(self.profile.name, self.groups, n_workers, block=True,
                                         priority=self.profile.priority)
        else:
            indexes = list(range(n_workers))
        n_workers = len(indexes)
        specs = [self._spec(i) for i in indexes]
        acquired = time.time()  # devices are held from here: start-up time counts as held
        t0 = time.monotonic()
        try:
            if self.profile.uses_processes:
                from distributed import Client

                with _non_daemon_workers():
                    self.cluster = _within(self.provision_timeout, lambda: self._make_cluster(specs),
                                           f"cluster of profile {self.profile.name!r}")
                self.client = Client(self.cluster, set_as_default=False, timeout=self.provision_timeout)
                self.client.wait_for_workers(n_workers, timeout=self.provision_timeout)
            else:
                # Threads in the flow process: a Dask scheduler round trip costs about as
                # much as Prefect's whole task engine (bench/overhead.py), so a plain
                # executor sized by the profile runs these tasks.
                # A slot pool, not a plain thread pool: a task that waits for a child task of
                # this profile gives its slot to the child (gpu_tasks._slots).
                self.cluster = SlotPool(specs[0].nthreads, name=f"gpu-tasks-{self.profile.name}")
        except Exception as exc:
            self._teardown()
            self.book.release(self.profile.name, [d.address for s in specs for d in s.devices])
            devices = ",".join(d.address for s in specs for d in s.devices) or "none"
            raise ClusterError(
                f"profile {self.profile.name!r}: could not start {n_workers} worker(s) "
                f"(devices: {devices}) within {self.provision_timeout:g}s: {type(exc).__name__}: {exc}"
            ) from exc
        self.specs = specs
        self.provisioned_at = acquired
        for s in specs:
            self._worker_started[s.name] = acquired
        self.startup = {"wait_devices_s": t0 - asked, "start_workers_s": time.monotonic() - t0}
        logger.info(
            "profile %r: provisioned %d worker(s) on %s in %.2fs",
            self.profile.name, n_workers, self._where(), self.startup["start_workers_s"],
        )

    def _acquire_gang(self, n_workers: int) -> list[int]:
        """All ``n_workers`` device groups at once, or none: a gang never starts partly."""
        deadline = time.monotonic() + self.book.lease_timeout
        while True:
            indexes = self.book.acquire(self.profile.name, self.groups, n_workers, block=True,
                                        priority=self.profile.priority)
            if len(indexes) >= n_workers:
                return indexes
            # give back the part we got, so two gangs never each hold half of what they need
            self.book.release(self.profile.name, [d.address for i in indexes for d in self.groups[i]])
            if time.monotonic() >= deadline:
                raise ClusterError(
                    f"profile {self.profile.name!r} is a gang of {n_workers} workers but only "
                    f"{len(indexes)} device group(s) came free within {self.book.lease_timeout:g}s "
                    "(GPU_TASKS_LEASE_TIMEOUT); it starts all of them or none"
                )
            time.sleep(0.25)

    def scale_to(self, n_workers: int) -> int:
        """Grow to ``n_workers`` (never shrinks while running); returns the new count."""
        n_workers = min(n_workers, self.limit)
        if not self.running or n_workers <= len(self.specs):
            return len(self.specs)
        if self.profile.is_gpu:
            indexes = self.book.acquire(self.profile.name, self.groups, n_workers - len(self.specs), block=False,
                                         priority=self.profile.priority)
            if not indexes:
                return len(self.specs)  # other profiles hold the rest: tasks queue on the workers we have
        else:
            indexes = list(range(len(self.specs), n_workers))
        n_workers = len(self.specs) + len(indexes)
        new = [self._spec(i) for i in indexes]
        acquired = time.time()
        if self._is_cuda():
            self._cuda_next.extend(s.devices[0].address for s in new)
            with _non_daemon_workers():
                self.cluster.scale(n_workers)
        else:
            for s in new:
                self.cluster.worker_spec[s.name] = self._dask_spec(s)
            with _non_daemon_workers():
                self.cluster.sync(self.cluster._correct_state)
        try:
            self.client.wait_for_workers(n_workers, timeout=self.provision_timeout)
        except Exception as exc:
            self.book.release(self.profile.name, [d.address for s in new for d in s.devices])
            raise ClusterError(
                f"profile {self.profile.name!r}: could not grow to {n_workers} workers within "
                f"{self.provision_timeout:g}s: {exc}"
            ) from exc
        self.specs.extend(new)
        for s in new:
            self._worker_started[s.name] = acquired
        logger.info(
            "profile %r: scaled up to %d worker(s) (%s) because tasks were waiting",
            self.profile.name, n_workers, self._where(),
        )
        return n_workers

    def submit(self, fn: Any, *args: Any, key: str, resources: dict[str, float] | None) -> Any:
        """Submit ``fn(*args)``; returns a future with ``add_done_callback`` and ``result``."""
        if self.client is not None:
            return self.client.submit(fn, *args, key=key, pure=False, resources=resources)
        return self.cluster.submit(fn, *args)

    def record(self, worker: str, start: float, end: float) -> None:
        """Record that a task ran on ``worker`` (see :func:`worker_key`) from ``start`` to ``end``."""
        with self._lock:
            self._busy.setdefault(worker, []).append((start, end))
            self._tasks += 1

    def close(self, reason: str, hurry: bool = False) -> LedgerRow | None:
        """Close the cluster and return its ledger row (``None`` if it was not running).

        Args:
            hurry: terminate worker processes first (the flow was interrupted): Dask's
                graceful close waits 4 s for each worker busy in a task.
        """
        if not self.running:
            return None
        closed = time.time()
        row = self._ledger(closed, reason)
        if hurry:
            self._terminate_workers()
        self._teardown()
        self.book.release(self.profile.name, self.devices)
        logger.info(
            "profile %r: closed cluster (%s); held %.1f device-s, busy %.1f device-s",
            self.profile.name, reason, row.held_seconds, row.busy_seconds,
        )
        self.specs = []
        self._worker_started.clear()
        self._busy.clear()
        self._tasks = 0
        self.provisioned_at = None
        return row

    def worker_devices(self, name: str) -> tuple[str, ...] | None:
        """Device addresses of the worker called ``name`` (``None``: no such worker of ours)."""
        spec = next((s for s in self.specs if s.name == name), None)
        return None if spec is None else tuple(d.address for d in spec.devices)

    def retire(self, name: str, reason: str) -> LedgerRow | None:
        """Remove the worker ``name`` (its process died) and give its devices back.

        The whole cluster closes when that was its last worker, or when the worker is
        not one of ours by name (dask-cuda names its own). Returns the ledger row for
        what was given back, ``None`` when nothing was running.
        """
        spec = next((s for s in self.specs if s.name == name), None)
        if not self.running:
            return None
        if spec is None or len(self.specs) == 1:
            return self.close(reason)
        row = self._ledger(time.time(), reason, only=[spec])
        try:
            self.cluster.worker_spec.pop(name, None)
            self.cluster.sync(self.cluster._correct_state)  # stops that worker's nanny
        except Exception:
            logger.warning("profile %r: error while removing worker %r", self.profile.name, name, exc_info=True)
        self.specs.remove(spec)
        self._worker_started.pop(spec.name, None)
        self._busy.pop(worker_key(d.address for d in spec.devices), None)
        self.book.release(self.profile.name, [d.address for d in spec.devices])
        logger.info(
            "profile %r: removed worker %r (%s); held %.1f device-s, busy %.1f device-s",
            self.profile.name, name, reason, row.held_seconds, row.busy_seconds,
        )
        return row

    # ------------------------------------------------------------ internals
    def _where(self) -> str:
        if not self.profile.is_gpu:
            mode = "processes" if self.profile.uses_processes else "threads in the flow process"
            return f"CPU ({mode})"
        kind = "emulated devices" if self.inventory.emulated else "devices"
        return f"{kind} {','.join(d.address for s in self.specs or [] for d in s.devices) or '?'}"

    def _spec(self, index: int) -> WorkerSpec:
        devices = self.groups[index] if self.profile.is_gpu else ()
        return worker_spec(self.profile, index, devices, self.inventory.emulated, extra_env=self.worker_env)

    def _is_cuda(self) -> bool:
        return self.profile.is_gpu and not self.inventory.emulated and self.profile.devices_per_worker == 1

    def _dask_spec(self, spec: WorkerSpec) -> dict[str, Any]:
        from gpu_tasks._crash import WatchedNanny
        from gpu_tasks._worker_guard import preload_options

        return {
            "cls": WatchedNanny,
            "options": {
                "nthreads": spec.nthreads,
                "resources": spec.resources or None,
                "env": spec.env,
                "host": LOCALHOST,
                "memory_limit": spec.memory_limit or "auto",
                "dashboard_address": f"{LOCALHOST}:0",
                "silence_logs": logging.WARNING,
                "name": spec.name,
                **preload_options(),  # workers exit with the flow process (gpu_tasks._worker_guard)
            },
        }

    def _make_cluster(self, specs: list[WorkerSpec]) -> Any:
        from distributed import Scheduler, SpecCluster

        dash = f"{LOCALHOST}:0"
        if self._is_cuda():
            return self._cuda_cluster(specs)
        scheduler = {
            "cls": Scheduler,
            # no silent re-run of a task whose worker died: the runner reports the crash (gpu_tasks._crash)
            "options": {"host": LOCALHOST, "dashboard": self.dashboard, "dashboard_address": dash,
                        "allowed_failures": 0},
        }
        workers = {s.name: self._dask_spec(s) for s in specs}
        return SpecCluster(
            workers=workers, scheduler=scheduler, name=f"gpu-tasks:{self.profile.name}",
            silence_logs=logging.WARNING,
        )

    def _cuda_cluster(self, specs: list[WorkerSpec]) -> Any:
        """dask-cuda's LocalCUDACluster, each worker seeing only its own device."""
        from gpu_tasks._worker_guard import preload_options

        try:
            dask_cuda = _gpu.load("dask_cuda")
        except _gpu.GpuLibraryUnavailable as exc:
            raise ClusterError(
                f"profile {self.profile.name!r} needs dask-cuda on real GPUs: {exc.reason}"
            ) from exc
        by_address = {spec.devices[0].address: spec for spec in (self._spec(i) for i in range(len(self.groups)))}
        cuda = self.profile.cuda
        self._cuda_next[:] = [s.devices[0].address for s in specs]
        next_devices = self._cuda_next

        import dask
        from distributed import Nanny

        from gpu_tasks._crash import WatchedNanny

        class OwnDeviceCUDACluster(dask_cuda.LocalCUDACluster):  # type: ignore[misc,name-defined]
            """dask-cuda shows each worker every device (its own first); gpu-tasks shows only its own."""

            def new_worker_spec(self) -> dict[str, Any]:
                spec = super().new_worker_spec()
                for worker in spec.values():
                    # the device the book leased to this worker, not dask-cuda's next in line
                    own = next_devices.pop(0) if next_devices else worker["options"]["env"]["CUDA_VISIBLE_DEVICES"].split(",")[0]
                    worker["options"]["env"] = dict(by_address[own].env)
                    worker["options"]["resources"] = dict(by_address[own].resources)
                    if worker.get("cls") is Nanny:
                        worker["cls"] = WatchedNanny
                    worker["options"].update(preload_options(worker["options"].get("preload", []),
                                                             worker["options"].get("preload_argv", [])))
                return spec

        # no silent re-run of a task whose worker died: the runner reports the crash (gpu_tasks._crash)
        with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
            return OwnDeviceCUDACluster(
                CUDA_VISIBLE_DEVICES=list(by_address),
                n_workers=len(specs),
                threads_per_worker=specs[0].nthreads,
                host=LOCALHOST,
                dashboard_address=f"{LOCALHOST}:0" if self.dashboard else None,
                memory_limit=specs[0].memory_limit or "auto",
                rmm_pool_size=cuda.rmm_pool_size,
                rmm_async=cuda.rmm_async,
                enable_cudf_spill=cuda.enable_cudf_spill,
                protocol=cuda.protocol,
                silence_logs=logging.WARNING,
            )

    def _ledger(self, closed: float, reason: str, only: list[WorkerSpec] | None = None) -> LedgerRow:
        specs = self.specs if only is None else only
        held = busy = 0.0
        tasks = self._tasks
        if only is not None:
            tasks = sum(len(self._busy.get(worker_key(d.address for d in s.devices), [])) for s in only)
        for i, spec in enumerate(specs):
            weight = max(1, len(spec.devices))
            held += (closed - self._worker_started.get(spec.name, closed)) * weight
            if not spec.devices and i > 0:
                continue  # CPU workers share one "cpu" timeline
            busy += _union_seconds(self._busy.get(worker_key(d.address for d in spec.devices), [])) * weight
        return LedgerRow(
            profile=self.profile.name, workers=len(specs), devices=tuple(d.address for s in specs for d in s.devices),
            emulated=self.inventory.emulated and self.profile.is_gpu,
            provisioned_at=self.provisioned_at or closed, closed_at=closed,
            held_seconds=held, busy_seconds=min(busy, held), tasks=tasks, reason=reason,
        )

    def _terminate_workers(self) -> None:
        """SIGTERM every worker process of this cluster (they end their own children first)."""
        for nanny in list(getattr(self.cluster, "workers", {}).values()):
            pid = getattr(getattr(nanny, "process", None), "pid", None)
            if pid:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGTERM)

    def _teardown(self) -> None:
        client, cluster = self.client, self.cluster
        self.client = self.cluster = None
        for thing in (client, cluster):
            if thing is None:
                continue
            try:
                if isinstance(thing, concurrent.futures.Executor):
                    thing.shutdown(wait=True, cancel_futures=True)
                else:
                    thing.close()
            except Exception:
                logger.warning("profile %r: error while closing %r", self.profile.name, thing, exc_info=True)
        if cluster is not None and not isinstance(cluster, concurrent.futures.Executor):
            _forget_closed_schedulers()


def _forget_closed_schedulers() -> None:
    """Let closed Dask schedulers be freed.

    distributed 2026.7.1 memoizes ``distributed.core._expects_comm`` with an unbounded
    ``functools.cache`` keyed by bound handler methods, so every Scheduler that ever
    handled a request stays alive (its state, deques and HTTP routes) after it closes:
    one per provisioned cluster in a long-lived flow process. Clearing the cache after a
    close drops them; live servers only recompute a signature check.
    """
    try:
        from distributed import core

        core._expects_comm.cache_clear()
    except Exception:  # another distributed version: nothing to clear
        logger.debug("no distributed.core._expects_comm cache to clear", exc_info=True)
