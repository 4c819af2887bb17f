"""``cluster_class=`` profiles: any Dask cluster class (dask-jobqueue, dask-gateway, ...) created on
the first task, scaled to the queue, to zero when idle, and closed when the flow run ends."""

from __future__ import annotations

import contextlib
import importlib
import logging
import re
import time
from typing import Any

from gpu_tasks.cluster.backends import _non_daemon_workers, shared_config
from gpu_tasks.cluster.remote import RemoteCluster
from gpu_tasks.cluster.remote_workers import RemoteWorker, read_workers
from gpu_tasks.cluster.within import dask_client, within
from gpu_tasks.compat import warn_if_changed
from gpu_tasks.compat.cpython import signal_handlers_kept
from gpu_tasks.compat.dask_gateway import drop_stopped_loop_runner
from gpu_tasks.errors import ClusterError
from gpu_tasks.policy import GPU_RESOURCE
from gpu_tasks.profiles import ResourceProfile
from gpu_tasks.reporting.ledger import LedgerRow

RETIRE_WAIT_S = 30.0  # how long scaling to zero waits for the workers to leave

logger = logging.getLogger("gpu_tasks.runner")


def load_cluster_class(profile: ResourceProfile) -> type:
    """The class ``profile.cluster_class`` names, checked to be a Dask cluster (else ``ClusterError``)."""
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
    # dask-gateway's GatewayCluster is no Cluster subclass but acts as one; its scheduler_address is
    # set once the gateway started the cluster, so ManagedCluster._create checks that on the instance
    acts_as_one = all(callable(getattr(cls, m, None)) for m in ("scale", "close"))
    if not (isinstance(cls, type) and (issubclass(cls, Cluster) or acts_as_one)):
        raise ClusterError(
            f"profile {profile.name!r}: cluster_class {path!r} is not a Dask cluster class (a subclass of "
            "distributed.deploy.Cluster such as dask_jobqueue.SLURMCluster, or a class with scale(), close() "
            "and scheduler_address such as dask_gateway.GatewayCluster); fix cluster_class"
        )
    warn_if_changed()  # the private names of the library just imported (dask-gateway's)
    return cls


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
        self._ask(n_workers)
        try:
            self._await_workers(t0 + self.provision_timeout)
            workers = self._connected_workers(
                n_workers if self.profile.gang else 1, t0 + self.provision_timeout, f"scaled to {n_workers}"
            )
            self._check_resources(workers)
            self._check_api(self._check_workers(workers), every=True)  # once per start
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
            n_workers,
            len(workers),
            self.startup["start_workers_s"],
            "; ".join(w.describe() for w in workers.values()),
        )

    def _create(self) -> None:
        cls = load_cluster_class(self.profile)
        name = self.profile.cluster_class

        def make() -> Any:
            # a task whose worker died is reported, not re-run (schedulers in this process: dask-jobqueue)
            with _non_daemon_workers(), shared_config("distributed.scheduler.allowed-failures", 0):
                return cls(**self.profile.cluster_kwargs)

        try:
            manager = within(self.provision_timeout, make, f"cluster of profile {self.profile.name!r}")
        except Exception as exc:
            raise self._kwargs_error(exc, f"{name}(**cluster_kwargs)") from exc
        self.manager = manager
        if not isinstance(getattr(manager, "scheduler_address", None), str):
            self.shutdown()
            raise ClusterError(
                f"profile {self.profile.name!r}: {name}(**cluster_kwargs) gave a cluster without a "
                "scheduler_address, so no client can connect to it; cluster_class must name a Dask cluster "
                "class (a subclass of distributed.deploy.Cluster, or one with scale(), close() and "
                "scheduler_address such as dask_gateway.GatewayCluster)"
            )
        try:
            self.client = dask_client(manager, set_as_default=False, timeout=self.provision_timeout)
        except BaseException:
            self.shutdown()
            raise

    def _kwargs_error(self, exc: BaseException, what: str) -> ClusterError:
        # TypeError or ValueError for arguments the class (or its workers) do not take, naming the
        # unexpected ones where the error does; anything else its own
        name, kwargs = self.profile.cluster_class, self.profile.cluster_kwargs
        if isinstance(exc, (TypeError, ValueError)):
            unexpected = set(re.findall(r"unexpected keyword argument '(\w+)'", str(exc)))
            named = sorted(unexpected & set(kwargs)) or sorted(kwargs)
            return ClusterError(
                f"profile {self.profile.name!r}: {what} rejected cluster_kwargs {named}: "
                f"{type(exc).__name__}: {exc}; fix cluster_kwargs to match {name}'s arguments"
            )
        from distributed import LocalCluster

        spawns = self.manager is not None and isinstance(self.manager, LocalCluster)
        with contextlib.suppress(ClusterError):
            spawns = spawns or issubclass(load_cluster_class(self.profile), LocalCluster)
        return ClusterError(
            f"profile {self.profile.name!r}: {what} failed: {type(exc).__name__}: {exc}; "
            + (f"{self.guard_hint}, else " if spawns else "")
            + f"fix cluster_kwargs to match {name}'s arguments or the cluster manager's configuration"
        )

    guard_hint = (
        "a class that starts its workers in this process (LocalCluster) spawns them, and each re-imports "
        'the script that started the flow: call the flow under `if __name__ == "__main__":`'
    )
    no_workers_hint = (
        "its workers may have failed to start: the cluster manager logs why (a class that starts them in "
        "this process, such as LocalCluster, in the flow run's output; dask-jobqueue in the jobs' output "
        f"files), else check that they can reach the scheduler. {guard_hint[0].upper()}{guard_hint[1:]}"
    )

    def _await_workers(self, deadline: float) -> None:
        """Await a SpecCluster's (LocalCluster's, dask-jobqueue's) workers: one that cannot be created
        or started raises its error at once, rather than never joining until the provision timeout."""
        from distributed import SpecCluster
        from distributed.core import Status

        manager = self.manager
        if not isinstance(manager, SpecCluster):
            return

        async def started() -> None:
            await manager  # creates the workers asked for, and starts them
            for worker in list(manager.workers.values()):
                if worker.status == Status.failed:
                    await worker  # raises why it failed to start

        try:
            with _non_daemon_workers():
                manager.sync(started, callback_timeout=max(0.1, deadline - time.monotonic()))
        except Exception as exc:
            if time.monotonic() < deadline:  # (else the wait for them says how many joined in time)
                cause: BaseException = exc
                while cause.__cause__ is not None:  # RuntimeError: Nanny failed to start: its cause
                    cause = cause.__cause__
                raise self._kwargs_error(cause, f"{self.profile.cluster_class}'s worker") from exc

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
        if self.manager is None or not self._asked or n_workers <= len(self._asked):
            return len(self._asked)
        self._ask(n_workers)
        with contextlib.suppress(Exception):
            self._note(read_workers(self.client))
        logger.info(
            "profile %r: asked %s for %d worker(s) because tasks were waiting",
            self.profile.name,
            self.profile.cluster_class,
            n_workers,
        )
        return n_workers

    def close(self, reason: str, hurry: bool = False) -> LedgerRow | None:
        """Scale to zero (the cluster object stays for the next task) and write the ledger row."""
        if self.manager is None or not self._asked:
            return None
        closed = time.time()
        with contextlib.suppress(Exception):
            self._note(read_workers(self.client))
        per = max(1, self.profile.devices_per_worker) if self._seen else 0  # none ever joined: none held
        held = sum(closed - t for t in self._asked) * per
        row = self._busy_row(held, len(self._asked), reason, closed)
        if not row.devices:
            row.devices = tuple(k for w in self._seen.values() for k in w.device_keys)
        try:
            with _non_daemon_workers():
                self.manager.scale(0)
        except Exception:
            logger.warning("profile %r: error while scaling to zero", self.profile.name, exc_info=True)
        else:
            if not hurry:  # the flow run is ending (hurry): the cluster is shut down next anyway
                self._wait_until_gone(min(RETIRE_WAIT_S, self.provision_timeout))
        self._asked = []
        self.remote = {}
        self._seen = {}
        self.usage.reset()
        self._log_given_back(f"scaled {self.profile.cluster_class} to zero", reason, row)
        return row

    def _wait_until_gone(self, seconds: float) -> None:
        """Wait until the scheduler has no worker left: a task of the next start handed to a worker
        still retiring would die with it."""
        deadline = time.monotonic() + seconds
        left: dict[str, RemoteWorker] = {}
        while time.monotonic() < deadline:
            try:
                left = read_workers(self.client)
            except Exception:
                return  # the scheduler is gone too: nothing can be handed to its workers
            if not left:
                return
            time.sleep(0.1)
        logger.warning(
            "profile %r: %d worker(s) of %s still connected %.0fs after scaling to zero (%s); a task "
            "handed to one of them before it leaves would crash",
            self.profile.name,
            len(left),
            self.profile.cluster_class,
            seconds,
            ", ".join(sorted(left)),
        )

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
            drop_stopped_loop_runner(manager)  # dask-gateway's, through gpu_tasks.compat

    def _where(self) -> str:
        return f"{self.profile.cluster_class} at {self.scheduler_address}"
