"""Fixtures for profiles on clusters the runner does not own: stand-in GPU hosts (a ``dask
scheduler`` and ``dask worker --resources GPU=1`` processes), a job-queue cluster and a dask-gateway
server."""

from __future__ import annotations

import fcntl
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from remote_clusters.gateway import GatewayServer, start_gateway
from remote_clusters.hosts import Hosts, make_tls_files, start_hosts
from remote_clusters.netns import NetHosts, start_net_hosts, unavailable

# what each stand-in host says it has: two H100s, one of them visible to its worker
HOST_GPUS = "H100:80GiB,H100:80GiB"


def host_env(n: int = 2) -> list[dict[str, str]]:
    """One environment per worker: its own device, emulated H100s announced as such."""
    return [{"CUDA_VISIBLE_DEVICES": str(i), "GPU_TASKS_EMULATED_GPUS": HOST_GPUS} for i in range(n)]


def _hosts(tmp: Path, tls: dict[str, str] | None = None) -> Iterator[Hosts]:
    hosts = start_hosts(tmp, tls, n_workers=2, worker_env=host_env())
    try:
        yield hosts
    finally:
        hosts.stop()


@pytest.fixture(scope="module")
def gpu_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    """Two stand-in GPU hosts on one tcp scheduler, shared by a module's tests."""
    yield from _hosts(tmp_path_factory.mktemp("hosts"))


@pytest.fixture
def own_gpu_hosts(tmp_path: Path) -> Iterator[Hosts]:
    """Two stand-in GPU hosts for one test (it may kill a worker)."""
    yield from _hosts(tmp_path / "hosts")


@pytest.fixture
def strict_gpu_hosts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Hosts]:
    """Two stand-in GPU hosts whose scheduler allows no failure (``allowed-failures`` 0): the first
    worker death ends a task there (``KilledWorker``), as a ``cluster_class`` scheduler's does."""
    monkeypatch.setenv("DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES", "0")
    yield from _hosts(tmp_path / "hosts")


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A CA and a certificate for 127.0.0.1, made for this test module."""
    return make_tls_files(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls_hosts(tmp_path_factory: pytest.TempPathFactory, tls_files: dict[str, str]) -> Iterator[Hosts]:
    """Two stand-in GPU hosts on a tls:// scheduler that requires those certificates."""
    yield from _hosts(tmp_path_factory.mktemp("tls-hosts"), tls_files)


@pytest.fixture(scope="module")
def net_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetHosts]:
    """Hosts in network namespaces (infra/netns): a scheduler host, two GPU hosts and the flow's
    host with its Prefect API. Skipped, with the reason, where root and ``ip netns`` are missing."""
    why = unavailable()
    if why is not None:
        pytest.skip(why)
    # One set of namespaces on the host at a time: the suite's processes may split this module's
    # tests between them (--dist worksteal), and building the namespaces removes what exists of
    # them first. Another process's share of the module waits here until this one's ends.
    with open(Path(tempfile.gettempdir()) / "gpu-tasks-test-netns.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        hosts = start_net_hosts(tmp_path_factory.mktemp("net-hosts"))
        try:
            yield hosts
        finally:
            hosts.stop()


@pytest.fixture(scope="module")
def gateway_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    """A dask-gateway server with its local backend on 127.0.0.1 (remote_clusters/gateway.py), shared
    by a module's tests; stopped at the end, and no process of it may outlive it. Skipped, with the
    reason, where dask-gateway-server is not installed."""
    try:
        import dask_gateway  # noqa: F401
        import dask_gateway_server  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"dask-gateway / dask-gateway-server cannot be imported ({exc}): install the dev extra")
    server = start_gateway(tmp_path_factory.mktemp("gateway"))
    try:
        yield server
    finally:
        left = server.stop()
    assert left == [], f"processes of the dask-gateway server outlived it: {left}"
