"""The one place that builds Dask workers and clusters (threads, a ``SpecCluster``, dask-cuda's
``LocalCUDACluster``), chosen by :func:`start`, and a task's :func:`per_device_client`."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from gpu_tasks import _gpu
from gpu_tasks.allocation import Allocation
from gpu_tasks.cluster.within import dask_client, within
from gpu_tasks.errors import ClusterError
from gpu_tasks.policy import GPU_RESOURCE, WorkerSpec
from gpu_tasks.profiles import ResourceProfile
from gpu_tasks.worker.slots import SlotPool

logger = logging.getLogger(__name__)
PROCESSING_TRIES = 3  # asks of the scheduler which tasks workers run, before a preemption stops them all

LOCALHOST = "127.0.0.1"
_ANY_PORT = f"{LOCALHOST}:0"


# ---------------------------------------------------------------- specs
def dask_log_level() -> int:
    """The level of Dask's loggers in the processes gpu-tasks starts (GPU_TASKS_TUNE_DASK_LOG_LEVEL)."""
    from gpu_tasks.settings import get_settings

    return logging.getLevelName(get_settings().dask_log_level)  # type: ignore[no-any-return]


def nanny_spec(
    spec: WorkerSpec,
    watched: bool = True,
    pool: Any = None,
    timeout: float = 120.0,
    cuda: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``SpecCluster`` entry of one worker: a nanny (``watched``: one that ends with the flow process),
    or a process of the warm ``pool``, which applies ``cuda`` (``CudaOptions``) once bound to its device."""
    from distributed import Nanny

    from gpu_tasks.worker.exits import WatchedNanny
    from gpu_tasks.worker.guard import preload_options

    options: dict[str, Any] = {
        "nthreads": spec.nthreads,
        "resources": spec.resources or None,
        "env": spec.env,
        "host": LOCALHOST,
        "memory_limit": spec.memory_limit or "auto",
        "dashboard_address": _ANY_PORT,
        "silence_logs": dask_log_level(),
        "name": spec.name,
    }
    if watched:
        options.update(preload_options())  # workers exit with the flow process
    if pool is not None:
        from gpu_tasks.worker.pooled import PooledWorker

        if cuda is not None:  # as dask-cuda does: no RAPIDS library creates a context on import
            options["env"] = {**spec.env, "RAPIDS_NO_INITIALIZE": "True"}
        return {"cls": PooledWorker, "options": {**options, "pool": pool, "timeout": timeout, "cuda": cuda}}
    return {"cls": WatchedNanny if watched else Nanny, "options": options}


def scheduler_spec(
    dashboard: bool, rerun_lost: bool = False, pool: Any = None, timeout: float = 60.0
) -> dict[str, Any]:
    """The ``SpecCluster`` scheduler entry: in the flow process, or forked from the warm ``pool``. A
    profile's does not ``rerun_lost`` tasks (Dask's default): the runner reports the crash."""
    from distributed import Scheduler

    options: dict[str, Any] = {"host": LOCALHOST, "dashboard": dashboard, "dashboard_address": _ANY_PORT}
    if not rerun_lost:
        options["allowed_failures"] = 0
    if pool is not None:
        from gpu_tasks.worker.pooled import PooledScheduler

        return {
            "cls": PooledScheduler,
            "options": {**options, "pool": pool, "timeout": timeout, "silence_logs": dask_log_level()},
        }
    return {"cls": Scheduler, "options": options}


_SHARED_CONFIG_LOCK = threading.Lock()
_SHARED_CONFIG: dict[tuple[str, Any], list[Any]] = {}  # (key, value) -> [users, its dask.config.set]


@contextmanager
def shared_config(key: str, value: Any) -> Iterator[None]:
    """Dask's config ``key`` set to ``value`` while any thread is inside: two threads' own
    ``dask.config.set`` blocks would restore each other's values, leaving one cluster without it."""
    import dask
    import distributed  # noqa: F401  (its defaults first, or leaving drops the "distributed" section)

    with _SHARED_CONFIG_LOCK:
        entry = _SHARED_CONFIG.get((key, value))
        if entry is None:
            block = dask.config.set({key: value})
            block.__enter__()
            entry = _SHARED_CONFIG[(key, value)] = [0, block]
        entry[0] += 1
    try:
        yield
    finally:
        with _SHARED_CONFIG_LOCK:
            entry[0] -= 1
            if entry[0] == 0:
                del _SHARED_CONFIG[(key, value)]
                entry[1].__exit__(None, None, None)


# Worker processes start non-daemonic, so tasks may start processes of their own (a training
# cluster, a dask-cuDF cluster); the nanny still stops them when the cluster closes.
_non_daemon_workers = functools.partial(shared_config, "distributed.worker.daemon", False)


def apply_worker_spec(cluster: Any) -> None:
    """Make a ``SpecCluster`` match its edited ``worker_spec``, and wait (``scale`` only adds copies of
    ``new_spec``; each of ours has its own devices)."""

    async def applied() -> None:
        await cluster

    cluster.sync(applied)


# ---------------------------------------------------------------- backends
class Backend:
    """A running set of workers of one profile: submit to it, grow it, close it."""

    dashboard_link: str | None = None
    client: Any = None  # a Dask client, where it has one

    def submit(self, fn: Callable[..., Any], *args: Any, key: str, resources: dict[str, float] | None) -> Any:
        raise NotImplementedError

    def submit_many(
        self,
        fn: Callable[..., Any],
        argss: list[tuple[Any, ...]],
        keys: list[str],
        resources: dict[str, float] | None,
    ) -> list[Any]:
        """``submit`` for each of ``argss``; a Dask client gets one graph, paying its cost once."""
        if self.client is not None and len(argss) > 1:
            return list(
                self.client.map(fn, *zip(*argss, strict=True), key=keys, pure=False, resources=resources)
            )
        return [
            self.submit(fn, *args, key=key, resources=resources)
            for args, key in zip(argss, keys, strict=True)
        ]

    def add(self, specs: list[WorkerSpec], total: int) -> None:
        """Start the workers of ``specs`` and wait until ``total`` are up."""
        raise ClusterError(f"{type(self).__name__} does not add workers")

    def remove(self, name: str) -> None:
        """Stop the worker called ``name`` (its process died)."""

    def drain(self, wait: bool = True) -> None:
        """Let running tasks finish (``wait``: and wait for them), start no queued one (before the
        runner closes)."""

    def worker_names(self) -> set[str]:
        """Names of the workers it can stop one by one."""
        return set()

    def lost(self, grace: float) -> list[tuple[str, str | None]]:
        """``(name, address)`` of workers whose process ended ``grace`` s ago unclosed (missed a TTL)."""
        return []

    def scheduler_gone(self) -> bool:
        """Whether its scheduler's process ended unclosed (killed while the profile waited for devices)."""
        return bool(getattr(getattr(getattr(self, "cluster", None), "scheduler", None), "gone", False))

    def processing(self, names: list[str]) -> set[str] | None:
        """Keys of the tasks handed to the workers ``names`` (``None``: cannot tell)."""
        return None

    def terminate(self, names: list[str] | None = None, planned: set[str] | None = None) -> None:
        """SIGTERM the worker processes ``names`` (all: the flow was interrupted); ``planned``: the keys
        they run, which the runner re-runs."""

    def close(self) -> None:
        raise NotImplementedError


class ThreadBackend(Backend):
    """Threads in the flow process: a Dask round trip costs as much as Prefect's task engine. A slot
    pool, so a task waiting for a child task of this profile gives the child its slot."""

    def __init__(self, nthreads: int, name: str) -> None:
        self.pool = SlotPool(nthreads, name=name)

    def submit(self, fn: Callable[..., Any], *args: Any, key: str, resources: dict[str, float] | None) -> Any:
        return self.pool.submit(fn, *args)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def drain(self, wait: bool = True) -> None:
        # running tasks finish (as Prefect's thread pool runner) before the runner closes
        self.pool.shutdown(wait=wait, cancel_futures=True)


class DaskBackend(Backend):
    """A Dask cluster of worker processes and the flow's client to it."""

    def __init__(
        self,
        cluster: Any,
        n_workers: int,
        timeout: float,
        dashboard: bool,
        pool: Any = None,
        cuda: dict[str, Any] | None = None,
    ) -> None:
        self.cluster = cluster
        self.timeout = timeout
        self.pool = pool  # warm processes for the workers it adds (gpu_tasks.worker.warm)
        self.cuda = cuda  # dask-cuda's worker setup for them (real GPUs), as nanny_spec takes it
        self.client = None
        try:
            self.client = dask_client(cluster, set_as_default=False, timeout=timeout)
            if n_workers:  # none yet: a warm pool's workers come with add(), after their lease
                self.client.wait_for_workers(n_workers, timeout=timeout)
        except BaseException:
            self.close()
            raise
        self.dashboard_link = self.client.dashboard_link if dashboard else None

    def submit(self, fn: Callable[..., Any], *args: Any, key: str, resources: dict[str, float] | None) -> Any:
        return self.client.submit(fn, *args, key=key, pure=False, resources=resources)

    def add(self, specs: list[WorkerSpec], total: int) -> None:
        for s in specs:
            self.cluster.worker_spec[s.name] = nanny_spec(
                s, pool=self.pool, timeout=self.timeout, cuda=self.cuda
            )
        with _non_daemon_workers():
            apply_worker_spec(self.cluster)
        self.client.wait_for_workers(total - self._absent({s.name for s in specs}), timeout=self.timeout)

    def _absent(self, exclude: set[str]) -> int:
        """Workers of the spec (less ``exclude``) the scheduler no longer lists: dropped, not yet
        ended, they would never arrive, and waiting for them would take the whole timeout."""
        spec = {str(n) for n in self.cluster.worker_spec} - exclude
        if not spec:
            return 0
        listed = {str(w.get("name")) for w in self.client.scheduler_info(n_workers=-1)["workers"].values()}
        return len(spec - listed)

    def remove(self, name: str) -> None:
        self.cluster.worker_spec.pop(name, None)
        apply_worker_spec(self.cluster)  # stops that worker's nanny

    def worker_names(self) -> set[str]:
        return {str(n) for n in self.cluster.workers}

    def lost(self, grace: float) -> list[tuple[str, str | None]]:
        now = time.monotonic()
        return [
            (str(name), getattr(w, "worker_address", None))
            for name, w in list(self.cluster.workers.items())
            if (ended := getattr(w, "ended_at", None)) is not None and now - ended >= grace
        ]

    def processing(self, names: list[str]) -> set[str] | None:
        for attempt in range(PROCESSING_TRIES):  # a loaded scheduler's slow answer is not "cannot tell"
            try:
                info = self.client.scheduler_info(n_workers=-1)["workers"]
                addresses = [a for a, w in info.items() if str(w.get("name")) in set(names)]
                return {str(k) for keys in self.client.processing(addresses).values() for k in keys}
            except Exception:
                if attempt + 1 == PROCESSING_TRIES:
                    logger.warning(
                        "could not read which tasks workers %s run (%d tries): the whole cluster stops",
                        names,
                        PROCESSING_TRIES,
                        exc_info=True,
                    )
                    return None
                time.sleep(0.5)
        return None

    def terminate(self, names: list[str] | None = None, planned: set[str] | None = None) -> None:
        if planned:
            try:
                self.client.run_on_scheduler(expect_stopped, sorted(planned))
            except Exception:  # Dask's error line then shows: nothing else depends on it
                logger.debug("could not tell the scheduler of the planned stop", exc_info=True)
        for name, nanny in list(self.cluster.workers.items()):
            if names is not None and name not in names:
                continue
            pid = getattr(getattr(nanny, "process", None), "pid", None)
            if pid:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGTERM)  # they end their own children first

    def close(self) -> None:
        scheduler: Any = getattr(self.cluster, "scheduler", None)
        # a scheduler process that ended unasked (a Prefect worker's cancel sends SIGTERM to the flow
        # run's whole process group): Dask's close would ask it to terminate, retrying the connection
        # for distributed.comm.timeouts.connect (30 s, then Prefect's SIGKILL): its entry is closed here
        gone = bool(getattr(scheduler, "gone", False))
        for thing in (self.client, self.cluster):
            if thing is None:
                continue
            try:
                if gone and thing is self.cluster:
                    self.cluster.shutdown_scheduler = False
                    with contextlib.suppress(Exception):
                        self.cluster.sync(scheduler.close)
                thing.close()
            except Exception:
                logger.warning("error while closing %r", thing, exc_info=True)
        self.client = None


class CudaBackend(DaskBackend):
    """dask-cuda's ``LocalCUDACluster``, each worker shown only the device it was leased."""

    def __init__(
        self, cluster: Any, next_devices: list[str], n_workers: int, timeout: float, dashboard: bool
    ):
        self.next_devices = next_devices  # devices leased for the next workers dask-cuda starts
        super().__init__(cluster, n_workers, timeout, dashboard)

    def add(self, specs: list[WorkerSpec], total: int) -> None:
        self.next_devices.extend(s.devices[0].address for s in specs)
        with _non_daemon_workers():
            self.cluster.scale(total)
        self.client.wait_for_workers(total, timeout=self.timeout)


def uses_dask_cuda(profile: ResourceProfile, emulated: bool) -> bool:
    """Whether ``profile``'s workers are dask-cuda's (real GPUs, one device per worker)."""
    return profile.is_gpu and not emulated and profile.devices_per_worker == 1


def start(
    profile: ResourceProfile,
    specs: list[WorkerSpec],
    every_spec: Callable[[], list[WorkerSpec]],
    emulated: bool,
    timeout: float,
    dashboard: bool,
    pool: Any = None,
) -> Backend:
    """Start ``profile``'s workers for ``specs`` and wait until all are up. dask-cuda needs ``every_spec``
    up front; with a warm ``pool``, ``specs`` may be empty (workers come with :meth:`DaskBackend.add`)."""
    if not profile.uses_processes:
        return ThreadBackend(specs[0].nthreads, name=f"gpu-tasks-{profile.name}")
    what = f"cluster of profile {profile.name!r}"
    cuda = None
    if uses_dask_cuda(profile, emulated) and pool is not None:
        cuda = _dask_cuda_for_warm_workers(profile)
    elif uses_dask_cuda(profile, emulated):  # dask-cuda starts the workers
        next_devices = [s.devices[0].address for s in specs]
        with _non_daemon_workers():
            cluster = within(
                timeout, lambda: _cuda_cluster(profile, specs, every_spec(), next_devices, dashboard), what
            )
        return CudaBackend(cluster, next_devices, len(specs), timeout, dashboard)
    from distributed import SpecCluster

    with _non_daemon_workers():
        cluster = within(
            timeout,
            lambda: SpecCluster(
                workers={s.name: nanny_spec(s, pool=pool, timeout=timeout, cuda=cuda) for s in specs},
                scheduler=scheduler_spec(dashboard, pool=pool, timeout=timeout),
                name=f"gpu-tasks:{profile.name}",
                silence_logs=dask_log_level(),
            ),
            what,
        )
    return DaskBackend(cluster, len(specs), timeout, dashboard, pool=pool, cuda=cuda)


def uses_warm_pool(profile: ResourceProfile, emulated: bool) -> bool:
    """Whether ``profile``'s workers can come from a warm pool (over UCX dask-cuda starts its own)."""
    if not (profile.is_local and profile.uses_processes):
        return False
    return not uses_dask_cuda(profile, emulated) or profile.cuda.protocol == "tcp"


def _load(profile: ResourceProfile, module: str, needs: str) -> Any:
    """``module`` (:mod:`gpu_tasks._gpu`), or a ``ClusterError`` saying why ``profile`` ``needs`` it."""
    try:
        return _gpu.load(module)
    except _gpu.GpuLibraryUnavailable as exc:
        raise ClusterError(f"profile {profile.name!r} {needs}: {exc.reason}") from exc


def _dask_cuda_for_warm_workers(profile: ResourceProfile) -> dict[str, Any]:
    """Apply in this process what ``LocalCUDACluster`` would; the options its warm workers use."""
    _load(profile, "dask_cuda", "needs dask-cuda on real GPUs")
    if profile.cuda.enable_cudf_spill:  # as dask-cuda does: spilling on in the client process too
        cudf = _load(profile, "cudf", "sets cuda.enable_cudf_spill, which needs cuDF")
        cudf.set_option("spill", True)
        cudf.set_option("spill_stats", False)
    os.environ["RAPIDS_NO_INITIALIZE"] = "True"  # as LocalCUDACluster sets it
    return profile.cuda.model_dump()


def _cuda_cluster(
    profile: ResourceProfile,
    specs: list[WorkerSpec],
    every_spec: list[WorkerSpec],
    next_devices: list[str],
    dashboard: bool,
) -> Any:
    """dask-cuda's LocalCUDACluster over every device of the profile, starting ``specs``'s workers."""
    dask_cuda = _load(profile, "dask_cuda", "needs dask-cuda on real GPUs")
    by_address = {spec.devices[0].address: spec for spec in every_spec}
    cls = _own_device_cluster_class(dask_cuda.LocalCUDACluster)
    cuda = profile.cuda
    # no silent re-run of a task whose worker died: the runner reports it (prefect_api.states)
    with shared_config("distributed.scheduler.allowed-failures", 0):
        return cls(
            by_address,
            next_devices,
            CUDA_VISIBLE_DEVICES=list(by_address),
            n_workers=len(specs),
            threads_per_worker=specs[0].nthreads,
            host=LOCALHOST,
            dashboard_address=_ANY_PORT if dashboard else None,
            memory_limit=specs[0].memory_limit or "auto",
            rmm_pool_size=cuda.rmm_pool_size,
            rmm_async=cuda.rmm_async,
            enable_cudf_spill=cuda.enable_cudf_spill,
            protocol=cuda.protocol,
            silence_logs=dask_log_level(),
        )


@functools.cache
def _own_device_cluster_class(base: type) -> type:
    """A ``LocalCUDACluster`` subclass whose workers see only their leased device (built on first use)."""
    from distributed import Nanny

    from gpu_tasks.compat.dask_cuda import without_cpu_affinity
    from gpu_tasks.worker import affinity
    from gpu_tasks.worker.exits import WatchedNanny
    from gpu_tasks.worker.guard import preload_options

    class OwnDeviceCUDACluster(base):  # type: ignore[misc]  # base is a class known at run time (dask-cuda's)
        """dask-cuda shows each worker every device (its own first); gpu-tasks shows only its own."""

        def __init__(self, by_address: dict[str, WorkerSpec], next_devices: list[str], **kwargs: Any) -> None:
            self._gpu_tasks_specs = by_address
            self._gpu_tasks_next = next_devices
            super().__init__(**kwargs)

        def new_worker_spec(self) -> dict[str, Any]:
            spec: dict[str, Any] = super().new_worker_spec()
            for worker in spec.values():
                options = worker["options"]
                # the device the book leased to this worker, not dask-cuda's next in line
                own = (
                    self._gpu_tasks_next.pop(0)
                    if self._gpu_tasks_next
                    else options["env"]["CUDA_VISIBLE_DEVICES"].split(",")[0]
                )
                options["env"] = dict(self._gpu_tasks_specs[own].env)
                options["resources"] = dict(self._gpu_tasks_specs[own].resources)
                options["nthreads"] = self._gpu_tasks_specs[own].nthreads  # gpu_memory_per_task: per device
                if affinity.ENV in options["env"]:  # gpu-tasks pins the worker's CPUs, dask-cuda does not
                    options["plugins"] = without_cpu_affinity(options.get("plugins"))
                if worker.get("cls") is Nanny:
                    worker["cls"] = WatchedNanny
                options.update(preload_options(options.get("preload", []), options.get("preload_argv", [])))
            return spec

    return OwnDeviceCUDACluster


# ---------------------------------------------------------------- a task's own cluster
@contextmanager
def per_device_client(alloc: Allocation, timeout: float = 120.0) -> Iterator[Any]:
    """A Dask client over one worker per device of ``alloc`` (a task's devices), once all are up.

    For distributed training inside one task (``xgboost.dask``); the cluster closes with the block.
    """
    from distributed import SpecCluster

    if len(alloc.devices) < 2:
        raise ClusterError(
            f"a per-device cluster needs at least two devices; this task holds {list(alloc.devices)}"
        )
    specs = [
        WorkerSpec(
            name=f"device-{dev}",
            devices=(),
            nthreads=1,
            resources={GPU_RESOURCE: 1.0},
            env={"CUDA_VISIBLE_DEVICES": dev},
        )
        for dev in alloc.devices
    ]
    try:
        cluster = SpecCluster(
            workers={s.name: nanny_spec(s, watched=False) for s in specs},
            scheduler=scheduler_spec(dashboard=False, rerun_lost=True),
            name="gpu-tasks-per-device",
            silence_logs=dask_log_level(),
        )
        backend = DaskBackend(cluster, len(specs), timeout, dashboard=False)  # closes both if not up
    except Exception as exc:
        raise ClusterError(
            f"cluster of {len(specs)} workers on devices {','.join(alloc.devices)} did not all start "
            f"within {timeout:g}s; released all of them: {exc}"
        ) from exc
    logger.info("%d workers up on devices %s", len(specs), ",".join(alloc.devices))
    try:
        # current: xgboost.dask's distributed.wait() would find the worker's own client and block forever
        with backend.client.as_current():
            yield backend.client
    finally:
        backend.close()


class _PlannedStops(logging.Filter):
    """Drops Dask's "Task K marked as failed because N workers died while trying to run it" ERROR for
    the keys whose workers gpu-tasks stopped on purpose (a preemption: the runner logged why at
    WARNING and runs the task again), for a few minutes after the stop."""

    MESSAGE = "Task %s marked as failed because %d workers died"

    def __init__(self) -> None:
        super().__init__()
        self.until: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (str(record.msg).startswith(self.MESSAGE) and args and args[0] in self.until)


def expect_stopped(keys: list[str]) -> None:
    """Run in a profile's scheduler process (``Client.run_on_scheduler``) before its workers running
    ``keys`` are stopped on purpose: Dask's error line for them is left out (:class:`_PlannedStops`)."""
    log = logging.getLogger("distributed.scheduler")
    planned = next((f for f in log.filters if isinstance(f, _PlannedStops)), None)
    if planned is None:
        planned = _PlannedStops()
        log.addFilter(planned)
    now = time.monotonic()
    planned.until = {k: t for k, t in planned.until.items() if t > now} | dict.fromkeys(keys, now + 300.0)
