"""Test hosts that are hosts: one network namespace per host on a private bridge
(``infra/netns/up.sh``), each process started in its host's namespace with a host name of its
own (``infra/netns/exec.sh``).

- ``sched`` (10.213.77.2): ``dask scheduler`` on port 8786;
- ``gpu1``, ``gpu2`` (.11, .12): one ``dask worker --resources GPU=1`` each, device 0 of two
  emulated H100s (``CUDA_VISIBLE_DEVICES=0``, ``GPU_TASKS_EMULATED_GPUS``);
- ``flow`` (.10): a Prefect server on 0.0.0.0:4200 of that namespace only, and the flow runs.

Every address is in 10.213.77.0/24, which exists only inside these namespaces. Needs root;
:func:`unavailable` says why not. ``python netns.py wait ADDRESS API N TIMEOUT`` (run on the
flow host) waits until the scheduler has N workers and the API answers; ``python netns.py
workers ADDRESS`` prints the scheduler's workers, ``python netns.py task-run ID`` a task run's
state, run count and state history (JSON).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

INFRA = Path(__file__).resolve().parents[2] / "infra" / "netns"
NET = "10.213.77"
ADDRESS = {"sched": f"{NET}.2", "flow": f"{NET}.10", "gpu1": f"{NET}.11", "gpu2": f"{NET}.12"}
NOBODY = f"{NET}.99"  # an address of the network that no host has
HOST_GPUS = "H100:80GiB,H100:80GiB"


def unavailable() -> str | None:
    """Why namespace hosts cannot be built here, or ``None``."""
    if os.geteuid() != 0:
        return "hosts in network namespaces need root (infra/netns/up.sh)"
    for tool in ("ip", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"hosts in network namespaces need `{tool}`"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip()}"
    return None


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without what a host must not inherit (its API, devices)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("CUDA_VISIBLE_DEVICES", "GPU_TASKS_EMULATED_GPUS") and not k.startswith("PREFECT_API")
    }
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def _exe(name: str) -> str:
    cand = Path(sys.executable).parent / name
    return str(cand) if cand.exists() else name


@dataclass
class NetHosts:
    logdir: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    address: str = f"tcp://{ADDRESS['sched']}:8786"
    api_url: str = f"http://{ADDRESS['flow']}:4200/api"

    def spawn(
        self, name: str, host: str, argv: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        """Start ``argv`` on ``host`` in a session of its own; its output goes to ``<name>.log``."""
        with open(self.logdir / f"{name}.log", "wb") as out:
            proc = subprocess.Popen(
                [str(INFRA / "exec.sh"), host, *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env or clean_env(),
                cwd=self.logdir,
                start_new_session=True,
            )
        self.procs[name] = proc
        return proc

    def run(
        self, host: str, argv: list[str], env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` on ``host`` to its end (a flow script)."""
        return subprocess.run(
            [str(INFRA / "exec.sh"), host, *argv],
            env=env,
            capture_output=True,
            timeout=timeout,
            cwd=self.logdir,
        )

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)

    def log(self, name: str, n: int = 30) -> str:
        lines = (self.logdir / f"{name}.log").read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def worker(self, host: str, address: str, name: str | None = None) -> subprocess.Popen:
        """A ``dask worker --resources GPU=1`` on ``host`` owning device 0 of two emulated H100s."""
        name = name or host
        env = clean_env(CUDA_VISIBLE_DEVICES="0", GPU_TASKS_EMULATED_GPUS=HOST_GPUS)
        argv = [_exe("dask"), "worker", address, "--resources", "GPU=1", "--nthreads", "2"]
        argv += ["--host", ADDRESS[host], "--no-dashboard", "--name", name]
        return self.spawn(name, host, [*argv, "--local-directory", str(self.logdir / f"{name}-space")], env)

    def scheduler(self, host: str, port: int, name: str) -> str:
        argv = [_exe("dask"), "scheduler", "--host", ADDRESS[host], "--port", str(port), "--no-dashboard"]
        self.spawn(name, host, argv)
        return f"tcp://{ADDRESS[host]}:{port}"

    def start_api(self) -> None:
        """The flow host's Prefect server on 0.0.0.0:4200 (again, on the same database)."""
        from faults._procs import seed_prefect_home  # not at the top: this file also runs as a script

        home = self.logdir / "prefect-home"
        seed_prefect_home(home)  # (again: kept)
        server_env = clean_env(
            PREFECT_HOME=str(home),
            PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{home}/prefect.db",
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            PREFECT_UI_ENABLED="false",
        )
        argv = [_exe("prefect"), "server", "start", "--host", "0.0.0.0", "--port", "4200", "--no-ui"]
        self.spawn("api", "flow", argv, server_env)

    def stop_api(self) -> None:
        """Stop the Prefect server as an operator would (SIGTERM), keeping its log."""
        proc = self.procs.pop("api")
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
        os.rename(self.logdir / "api.log", self.logdir / f"api-{time.time():.0f}.log")

    def query(self, what: str, arg: str) -> object:
        """``workers`` (the scheduler at ``arg``: name -> address) or ``task-run`` (id ``arg``),
        asked from the flow host."""
        import json

        done = self.run(
            "flow", [sys.executable, __file__, what, arg], clean_env(PREFECT_API_URL=self.api_url), 60
        )
        if done.returncode != 0:
            raise RuntimeError(f"{what} {arg}: {done.stderr.decode()[-2000:]}")
        return json.loads(done.stdout)

    def wait(self, address: str, workers: int, api: bool = True, timeout: float = 60) -> None:
        """Wait (from the flow host) until ``address`` has ``workers`` workers and the API answers."""
        argv = [
            sys.executable,
            __file__,
            "wait",
            address,
            self.api_url if api else "",
            str(workers),
            str(timeout),
        ]
        done = self.run("flow", argv, clean_env(), timeout + 30)
        if done.returncode != 0:
            # enough lines for the cause of a failed start, not only its last frames
            tails = "\n".join(f"--- {n}\n{self.log(n, 120)}" for n in self.procs)
            raise RuntimeError(f"namespace hosts not ready: {done.stdout.decode()[-2000:]}\n{tails}")

    def stop(self) -> None:
        for name in list(self.procs):
            self.kill(name)
        subprocess.run([str(INFRA / "down.sh")], check=False)


def start_net_hosts(logdir: Path) -> NetHosts:
    """Build the network and start the scheduler, the two GPU workers and the flow host's API."""
    logdir.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(INFRA / "up.sh")], check=True, capture_output=True)
    hosts = NetHosts(logdir)
    try:
        hosts.start_api()
        hosts.scheduler("sched", 8786, "scheduler")
        for host in ("gpu1", "gpu2"):
            hosts.worker(host, hosts.address)
        hosts.wait(hosts.address, 2)
    except BaseException:
        hosts.stop()
        raise
    return hosts


def _wait(address: str, api: str, workers: int, timeout: float) -> int:
    import urllib.request

    from distributed import Client

    deadline = time.monotonic() + timeout
    while api:
        try:
            urllib.request.urlopen(f"{api}/health", timeout=2).close()
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                print(f"API {api} not up: {exc}")
                return 1
            time.sleep(0.5)
    with Client(address, timeout=max(1.0, deadline - time.monotonic())) as client:
        while len(client.scheduler_info(n_workers=-1)["workers"]) < workers:
            if time.monotonic() > deadline:
                print(f"fewer than {workers} workers joined {address}")
                return 1
            time.sleep(0.2)
    return 0


def _workers(address: str) -> dict[str, str]:
    from distributed import Client

    with Client(address, timeout=10) as client:
        return {str(w["name"]): a for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}


def recorded(client: Any, task_run_id: str) -> Any:
    """The task run as the server has recorded it so far, or ``None`` while it has none: the
    server writes task runs from their events, later still when its recorder batches its writes or
    catches up after the API was down (Prefect answers 404 until then)."""
    from prefect.exceptions import ObjectNotFound

    try:
        return client.read_task_run(task_run_id)
    except ObjectNotFound:
        return None


def summary(client: Any, run: Any) -> dict:
    """A recorded task run's state, run count and state history (``None``, 0, [] when unrecorded)."""
    if run is None:
        return {"state": None, "run_count": 0, "states": []}
    return {
        "state": run.state_type.value if run.state_type else None,
        "run_count": run.run_count,
        "states": [s.type.value for s in client.read_task_run_states(run.id)],
    }


def _task_run(task_run_id: str) -> dict:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return summary(client, recorded(client, task_run_id))


if __name__ == "__main__" and sys.argv[1] == "wait":
    sys.exit(_wait(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])))
if __name__ == "__main__" and sys.argv[1] in ("workers", "task-run"):
    import json

    print(json.dumps((_workers if sys.argv[1] == "workers" else _task_run)(sys.argv[2])))
