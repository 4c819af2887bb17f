"""prefect-ray's RayTaskRunner as the benchmarks' Ray peer: a local Ray cluster per flow run,
kept on this machine, and checked to be gone afterwards.

Imported only once :func:`bench.common.ray_missing` has found Ray and prefect-ray (the
``bench`` extra); without them the benchmarks report their Ray case skipped.

A flow on :class:`LocalRayTaskRunner` starts its own Ray cluster when the runner is
entered (``ray.init``, at the flow's start, before any task is submitted) and shuts it
down at the flow's end, exactly as prefect-ray's runner does. This class adds what a
benchmark on a shared machine needs:

- nothing phones home and nothing listens beyond this machine: usage stats off, no
  dashboard, Ray's node on the loopback address, token authentication with a token made
  for this process (Ray's default writes one to ``~/.ray/auth_token``), the session's
  logs and sockets in a temporary directory removed afterwards, a small object store;
- checks of both, every flow: at the flow's end every listening socket of the Ray
  processes (and of this one) must be on a loopback address, and after ``ray.shutdown()``
  none of the processes Ray started may be left (any left are killed, and the case fails);
- when ``ray.init`` started and how long it took (cold start, held-versus-busy).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import shutil
import tempfile
import time
from typing import Any

import psutil

OBJECT_STORE_BYTES = 100 * 2**20  # tiny results only; Ray's default reserves 30% of RAM in /dev/shm
GONE_TIMEOUT_S = 15.0


def _local_only_env() -> None:
    """Environment of the driver and of every Ray process it starts.

    Set before Ray is first imported: Ray reads some of it (the authentication mode) then,
    and a driver that read "no token" cannot talk to a cluster that wants one.
    """
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    # Ray's switch for clusters that span machines. Off, Ray puts its node on the loopback
    # address; on (Linux's default), its servers listen on every interface and it names the
    # node by the machine's outward address, even given _node_ip_address="127.0.0.1"
    # (ray._private.services.resolve_ip_for_localhost turns that back into the outward one).
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))  # in memory: no ~/.ray/auth_token


_local_only_env()  # this module exists to run Ray; it is imported only where Ray will run

import ray  # noqa: E402  (after the environment: see above)
from prefect_ray import RayTaskRunner  # noqa: E402
from prefect_ray.context import remote_options  # noqa: E402

__all__ = ["LocalRayTaskRunner", "local_ray", "remote_options"]


def local_ray(num_cpus: int, num_gpus: int) -> LocalRayTaskRunner:
    """A RayTaskRunner whose local cluster has ``num_cpus`` CPUs and ``num_gpus`` GPUs.

    The GPUs are Ray's logical resources: Ray hands them out to tasks that ask with
    ``remote_options(num_gpus=...)`` and sets each such task's ``CUDA_VISIBLE_DEVICES``,
    whether or not a device is there (on this machine, emulated devices).
    """
    return LocalRayTaskRunner(
        init_kwargs={
            "num_cpus": num_cpus,
            "num_gpus": num_gpus,
            "include_dashboard": False,
            "object_store_memory": OBJECT_STORE_BYTES,
            "log_to_driver": False,  # the benchmarks' tasks print nothing; Prefect records their states
            "logging_level": "warning",
        }
    )


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped  # Ray's gRPC servers listen on ::ffff:127.0.0.1
    return addr.is_loopback


def _exposed(procs: list[psutil.Process]) -> list[str]:
    """Listening sockets of ``procs`` that are not on a loopback address."""
    out = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN and not _is_loopback(conn.laddr.ip):
                    out.append(f"{proc.pid} {proc.name()}: {conn.laddr.ip}:{conn.laddr.port}")
    return out


def _left(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those of ``procs`` still running (zombies count as gone) after waiting up to ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


class LocalRayTaskRunner(RayTaskRunner):  # type: ignore[misc]  # prefect-ray ships no complete types
    """prefect-ray's runner on a local cluster kept on this machine, timed and checked.

    ``init_started`` (epoch seconds, just before ``ray.init``) and ``init_s`` (how long
    it took) are set on the instance the flow run enters: read them through
    ``FlowRunContext.get().task_runner``.
    """

    init_started: float | None = None
    init_s: float | None = None
    _driver = False  # this instance started the cluster (and checks it on exit)

    def __enter__(self) -> LocalRayTaskRunner:
        if ray.is_initialized():
            # in a Ray worker: Prefect's task engine enters a copy of the flow's runner there
            # (for tasks the task submits), which joins the running cluster; nothing to set up
            super().__enter__()
            return self
        self._driver = True
        self._temp_dir = tempfile.mkdtemp(prefix="ray-bench-")  # short: Ray's socket paths live below
        self.init_kwargs["_temp_dir"] = self._temp_dir
        # what already runs below this process (the Prefect server) is not Ray's to check
        self._before = {p.pid for p in psutil.Process().children(recursive=True)}
        self.init_started = time.time()
        super().__enter__()
        self.init_s = time.time() - self.init_started
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if not self._driver:
            super().__exit__(*exc_info)
            return
        ours = [p for p in psutil.Process().children(recursive=True) if p.pid not in self._before]
        exposed = _exposed([psutil.Process(), *ours])
        try:
            super().__exit__(*exc_info)  # ray.shutdown()
        finally:
            left = _left(ours, GONE_TIMEOUT_S)
            lines = []
            for proc in left:
                with contextlib.suppress(psutil.Error):
                    lines.append(f"{proc.pid}: {' '.join(proc.cmdline())[:150]}")
                    proc.kill()
            psutil.wait_procs(left, timeout=5)
            shutil.rmtree(self._temp_dir, ignore_errors=True)
        problems = ([f"listening beyond this machine: {exposed}"] if exposed else []) + (
            [f"Ray processes left {GONE_TIMEOUT_S:g}s after ray.shutdown() (killed): {lines}"]
            if lines
            else []
        )
        if problems:
            raise RuntimeError("RayTaskRunner: " + "; ".join(problems))
