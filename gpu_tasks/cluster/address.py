"""``address=`` profiles: an existing Dask cluster. The runner connects a client and never starts
or closes the cluster; the shared scheduler's ``GPU`` resources arbitrate between flow runs and
hosts. An idle close closes the client."""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

from gpu_tasks.cluster.backends import _within
from gpu_tasks.cluster.board import SharedBoard
from gpu_tasks.cluster.remote import RemoteCluster, security_for
from gpu_tasks.errors import ClusterError
from gpu_tasks.policy import GPU_RESOURCE, task_resources
from gpu_tasks.reporting.ledger import LedgerRow

logger = logging.getLogger("gpu_tasks.runner")


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
