"""``address=`` profiles: a client to an existing Dask cluster, never started or closed here; the
shared scheduler's ``GPU`` resources arbitrate between flow runs and hosts."""

from __future__ import annotations

import logging
import time
from typing import Any

from gpu_tasks.cluster.board import SharedBoard
from gpu_tasks.cluster.remote import RemoteCluster, security_for
from gpu_tasks.cluster.within import dask_client, within
from gpu_tasks.errors import ClusterError
from gpu_tasks.policy import GPU_RESOURCE, task_resources
from gpu_tasks.reporting.ledger import LedgerRow

logger = logging.getLogger("gpu_tasks.runner")

SCHEDULER_PROBE_S = 5.0  # how long a scheduler that refuses connections is tried before its profile fails


def scheduler_unreachable(address: str, within: float, connect_timeout: float | None = None) -> str | None:
    """Why nothing accepts a TCP connection at Dask ``address``, in words (``None``: something does, or
    not TCP). A refusal is retried for ``within`` s (a scheduler starting); other errors fail at once.
    Each try waits ``connect_timeout`` s (``None``: what is left of ``within``, at least 0.5 s)."""
    import socket

    from distributed.comm.addressing import parse_address, parse_host_port

    protocol, location = parse_address(address)
    if protocol not in ("tcp", "tls", "ws", "wss"):
        return None
    host, port = parse_host_port(location)
    deadline = time.monotonic() + within
    while True:
        left = max(0.5, deadline - time.monotonic()) if connect_timeout is None else connect_timeout
        try:
            socket.create_connection((host, port), timeout=left).close()
            return None
        except ConnectionRefusedError:
            if time.monotonic() + 0.5 >= deadline:
                tried = f"; tried for {within:g}s" if within > 0 else ""
                return f"connection refused (nothing listens on port {port} of {host}{tried})"
            time.sleep(0.5)
        except socket.gaierror as exc:
            return f"cannot resolve the host name {host!r} ({exc.strerror})"
        except TimeoutError:
            return f"connecting timed out after {left:.1f}s (the host is down, or a firewall drops packets)"
        except OSError as exc:
            return f"{(exc.strerror or str(exc)).lower()} ({host}, port {port})"


def ucx_missing(address: str) -> str | None:
    """Why this Python cannot speak the ucx/ucxx protocol of Dask ``address`` (``None``: another
    protocol, or it can): without distributed-ucxx, Dask has only a stub that cannot connect."""
    from distributed.comm.registry import get_backend

    scheme = address.partition("://")[0]
    if scheme not in ("ucx", "ucxx"):
        return None
    try:
        get_backend(scheme).get_connector()
    except Exception:
        return (
            f"the {scheme} protocol needs UCX installed (distributed-ucxx; on PyPI distributed-ucxx-cu12 or "
            "-cu13): install it, or give the scheduler's tcp:// address"
        )
    return None


class AddressCluster(RemoteCluster):
    """A client to an existing Dask cluster."""

    stopped_note = (
        "the runner interrupted it on the shared cluster (cancelled it there if it had not started)"
    )

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

    def start(self, n_workers: int) -> None:
        t0 = time.monotonic()
        deadline = t0 + self.provision_timeout
        address = self.scheduler_address
        if (missing := ucx_missing(address)) is not None:
            raise ClusterError(f"profile {self.profile.name!r}: cannot use {address}: {missing}")
        why = scheduler_unreachable(address, min(SCHEDULER_PROBE_S, self.provision_timeout))
        if why is not None:
            raise ClusterError(
                f"profile {self.profile.name!r}: cannot connect to the Dask scheduler at {address}: {why}. "
                "Check that the scheduler runs and that this host can reach it (address, port, firewall)"
            )
        security = security_for(self.profile) if address.startswith("tls://") else None
        try:
            client = within(
                self.provision_timeout,
                lambda: dask_client(
                    address,
                    security=security,
                    timeout=self.provision_timeout,
                    set_as_default=False,
                    name=f"gpu-tasks:{self.profile.name}",
                ),
                f"client of profile {self.profile.name!r}",
                hint=f"The scheduler at {address} accepts connections but did not answer as a Dask scheduler",
            )
        except Exception as exc:
            hint = (
                "check the scheduler's certificates and the profile's security (or GPU_TASKS_TLS_*)"
                if address.startswith("tls://")
                else "if the scheduler uses TLS, use a tls:// address with security"
            )
            raise ClusterError(
                f"profile {self.profile.name!r}: cannot connect to the Dask scheduler at {address}: "
                f"{type(exc).__name__}: {exc}. Check that the scheduler runs and this host can reach it "
                f"(address, port, firewall); {hint}"
            ) from exc
        self.client = client
        try:
            workers = self._connected_workers(1, deadline, "waiting for workers")
            self._check_workers(workers)
            self._no_api = {}
            self._place(workers)
            self._check_api(list(self._fit))  # once per start: the workers that fit ask the API
            if self._no_api:
                self._place(workers)
        except BaseException:
            self.shutdown()
            raise
        self.usage.provisioned_at = time.time()
        self.startup = {"wait_devices_s": 0.0, "start_workers_s": time.monotonic() - t0}
        busy = [w for w in self._fit if w.gpus]
        logger.info(
            "profile %r: connected to %s; %d worker(s) can run its tasks (%s); tasks wait in that "
            "scheduler's queue while other work uses their %s",
            self.profile.name,
            address,
            len(self._fit),
            "; ".join(w.describe() for w in (busy or self._fit)),
            "GPU resources" if self.profile.is_gpu else "threads",
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
            "profile %r: closed its client of %s (%s); its tasks used %.1f %s",
            self.profile.name,
            self.scheduler_address,
            reason,
            row.busy_seconds,
            self.unit,
        )
        self.usage.reset()
        return row

    def _where(self) -> str:
        return f"the cluster at {self.scheduler_address}"
