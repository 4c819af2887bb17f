"""A real dask-gateway server for tests: ``python -m dask_gateway_server`` with its local backend
(``UnsafeLocalBackend``: schedulers and workers are local processes of this user), its Go proxy on a
free port of 127.0.0.1, and the simple authenticator with a fixed password.

Each gateway worker advertises ``GPU=1`` and sees one emulated H100 (``CUDA_VISIBLE_DEVICES=0``), as
a one-GPU host would: the worker command and environment come from the server's config here; a real
deployment would set them the same way (``c.ClusterConfig.worker_cmd`` / ``environment``).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from faults._procs import free_port

PASSWORD = "gateway-s3cret"
USER = "gpu-tasks"

TESTS = Path(__file__).resolve().parent.parent  # on the workers' path

CONFIG = """\
c.DaskGateway.address = "127.0.0.1:0"  # the private API: a port the server picks
c.Proxy.address = "127.0.0.1:{port}"  # HTTP API and scheduler (TLS/SNI) routes on one port
c.DaskGateway.backend_class = "dask_gateway_server.backends.local.UnsafeLocalBackend"
c.DaskGateway.authenticator_class = "dask_gateway_server.auth.SimpleAuthenticator"
c.SimpleAuthenticator.password = {password!r}
c.UnsafeLocalBackend.clusters_directory = {clusters!r}
c.UnsafeLocalBackend.sigint_timeout = 5
c.ClusterConfig.scheduler_cmd = [{python!r}, "-m", "distributed.cli.dask_scheduler"]
c.ClusterConfig.worker_cmd = [{python!r}, "-m", "distributed.cli.dask_worker", "--resources", "GPU=1"]
c.ClusterConfig.worker_memory = "1 G"
c.ClusterConfig.scheduler_memory = "1 G"
c.ClusterConfig.environment = {{
    "CUDA_VISIBLE_DEVICES": "0",
    "GPU_TASKS_EMULATED_GPUS": "H100:80GiB",
    # a task whose worker died is reported by gpu-tasks, not re-run by the gateway's scheduler
    "DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": "0",
    # the tests' own modules (the tasks are functions of a test module): as a deployment's image
    # would carry the flow's code
    "PYTHONPATH": {pythonpath!r},
}}
"""


def clusters(address: str) -> dict[str, str]:
    """The gateway's clusters that are pending or running, by name, with their status: the server's
    own report over its HTTP API (no dask-gateway client object: with distributed 2026.7 a closed
    ``Gateway`` raises again in ``__del__``)."""
    import base64
    import json

    token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    request = urllib.request.Request(
        f"{address}/api/v1/clusters/?status=pending,running", headers={"Authorization": f"Basic {token}"}
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        return {name: c["status"] for name, c in json.loads(r.read()).items()}


def processes_under(pid: int, marker: str = "") -> list[psutil.Process]:
    """The live descendants of ``pid`` whose command line contains ``marker``."""
    out = []
    with contextlib.suppress(psutil.Error):
        for p in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if p.status() != psutil.STATUS_ZOMBIE and marker in " ".join(p.cmdline()):
                    out.append(p)
    return out


@dataclass
class GatewayServer:
    """A running dask-gateway server: its public address and the process that serves it."""

    address: str
    process: subprocess.Popen
    log: Path

    def auth(self) -> Any:
        from dask_gateway import BasicAuth

        return BasicAuth(USER, PASSWORD)

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self, timeout: float = 20.0) -> list[str]:
        """SIGTERM the server (it stops its clusters and proxy first); kill what is left. Returns the
        command lines of the processes that outlived the server's own shutdown (none is a pass)."""
        children = processes_under(self.process.pid)
        self.process.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
        _, alive = psutil.wait_procs(children, timeout=10)
        left = []
        for p in alive:
            with contextlib.suppress(psutil.Error):
                left.append(" ".join(p.cmdline())[:200])
                p.kill()
        return left


def start_gateway(directory: Path, timeout: float = 60.0) -> GatewayServer:
    """Write a config into ``directory`` and start a gateway server from it; return once its
    ``/api/health`` answers (raises with the server's log otherwise)."""
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = directory / "dask_gateway_config.py"
    config.write_text(
        CONFIG.format(
            port=port,
            password=PASSWORD,
            clusters=str(directory / "clusters"),
            python=sys.executable,
            pythonpath=os.pathsep.join(
                [str(TESTS), str(TESTS.parent), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        )
    )
    log = directory / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "dask_gateway_server", "-f", str(config)],
            cwd=directory,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    server = GatewayServer(f"http://127.0.0.1:{port}", process, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{server.address}/api/health", timeout=2) as r:
                if r.status == 200:
                    return server
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"dask-gateway server did not answer on {server.address}:\n{server.tail()}")
