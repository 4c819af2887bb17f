"""Stand-ins for GPU hosts: a real ``dask scheduler`` and ``dask worker --resources GPU=1``
processes (tcp or TLS), each worker with its own ``CUDA_VISIBLE_DEVICES``, on 127.0.0.1.

Every process runs in a session of its own; ``Hosts.stop`` ends the groups and checks
that none is left.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

HOST = "127.0.0.1"


# --------------------------------------------------------------------------- TLS
def make_tls_files(directory) -> dict:
    """CA + one leaf cert (127.0.0.1 / localhost) usable as server and client.

    Returns {"ca_file", "cert", "key"} as str paths (PEM).
    """
    import trustme

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    paths = {"ca_file": d / "ca.pem", "cert": d / "cert.pem", "key": d / "key.pem"}
    ca.cert_pem.write_to_path(str(paths["ca_file"]))
    # the chain (leaf + any intermediates) is what the server should present
    with open(paths["cert"], "wb") as f:
        for blob in leaf.cert_chain_pems:
            f.write(blob.bytes())
    leaf.private_key_pem.write_to_path(str(paths["key"]))
    os.chmod(paths["key"], 0o600)
    return {k: str(v) for k, v in paths.items()}


def make_security(tls: dict | None):
    """Client-side Security for the files from make_tls_files (None -> plain tcp)."""
    from distributed import Security

    if tls is None:
        return Security()  # no TLS, require_encryption False
    return Security(
        tls_ca_file=tls["ca_file"],
        tls_client_cert=tls["cert"],
        tls_client_key=tls["key"],
        require_encryption=True,
    )


# --------------------------------------------------------------------------- hosts
def _dask_exe() -> str:
    cand = Path(sys.executable).parent / "dask"
    if cand.exists():
        return str(cand)
    exe = shutil.which("dask")
    if exe is None:
        raise RuntimeError("`dask` CLI not found next to sys.executable or on PATH")
    return exe


def _tail(path: Path, n: int = 25) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "<no output file>"
    return "\n".join(lines[-n:])


@dataclass
class Hosts:
    address: str
    procs: list  # [scheduler Popen, worker(nanny) Popen, ...]
    tls: dict | None
    logdir: Path
    security: object = None
    _stopped: bool = field(default=False, repr=False)

    @property
    def scheduler(self) -> subprocess.Popen:
        return self.procs[0]

    @property
    def workers(self) -> list:
        return self.procs[1:]

    def client(self, **kw):
        from distributed import Client

        kw.setdefault("timeout", 10)
        return Client(self.address, security=self.security, **kw)

    def worker_pids(self, client=None) -> dict:
        """{worker_address: pid of the real Worker process}.

        The `dask worker` CLI process is the *nanny*; the Worker runs in a child
        process it spawns (multiprocessing), so Popen.pid is NOT the worker pid.
        """
        if client is None:
            with self.client() as c:
                return c.run(os.getpid)
        return client.run(os.getpid)

    def nanny_of(self, worker_pid: int) -> int | None:
        """Popen index of the nanny whose descendant is worker_pid (None if none)."""
        for i, p in enumerate(self.workers):
            try:
                kids = {c.pid for c in psutil.Process(p.pid).children(recursive=True)}
            except psutil.NoSuchProcess:
                continue
            if worker_pid in kids:
                return i
        return None

    def stderr_tails(self, n: int = 25) -> str:
        out = []
        for name in ["scheduler"] + [f"worker{i}" for i in range(len(self.workers))]:
            out.append(f"----- {name} stderr (tail) -----\n{_tail(self.logdir / f'{name}.err', n)}")
        return "\n".join(out)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every process group (workers first), then SIGKILL; verify none left."""
        if self._stopped:
            return
        self._stopped = True
        # Snapshot all descendants now: once a nanny dies its worker is re-parented
        # and can no longer be found through the tree.
        tracked: dict[int, psutil.Process] = {}
        for p in self.procs:
            try:
                root = psutil.Process(p.pid)
                tracked[root.pid] = root
                for c in root.children(recursive=True):
                    tracked[c.pid] = c
            except psutil.NoSuchProcess:
                pass
        pgids = [p.pid for p in self.procs]  # start_new_session => pgid == pid

        def signal_groups(groups, sig):
            for g in groups:
                try:
                    os.killpg(g, sig)
                except (ProcessLookupError, PermissionError):
                    pass

        signal_groups(pgids[1:], signal.SIGTERM)  # workers/nannies first
        _wait_popen(self.workers, timeout / 2)
        signal_groups(pgids[:1], signal.SIGTERM)
        _wait_popen(self.procs, timeout / 2)
        # anything still alive in those groups (incl. orphaned worker processes)
        signal_groups(pgids, signal.SIGKILL)
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        _, alive = psutil.wait_procs(list(tracked.values()), timeout=5)
        left = [a for a in alive if a.is_running() and a.status() != psutil.STATUS_ZOMBIE]
        left += _procs_in_groups(pgids, exclude={a.pid for a in left})
        if left:
            raise RuntimeError(f"processes survived stop(): {[(a.pid, a.name()) for a in left]}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _wait_popen(procs, timeout):
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


def _procs_in_groups(pgids, exclude=()):
    res = []
    for pr in psutil.process_iter(["pid"]):
        if pr.pid in exclude:
            continue
        try:
            if os.getpgid(pr.pid) in pgids and pr.status() != psutil.STATUS_ZOMBIE:
                res.append(pr)
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            pass
    return res


def start_hosts(
    tmpdir,
    tls: dict | None = None,
    n_workers: int = 2,
    worker_env: list[dict] | None = None,
    *,
    use_scheduler_file: bool = False,
    timeout: float = 60.0,
    extra_worker_args: list[str] | None = None,
    gpus: int = 1,
) -> Hosts:
    """Start `dask scheduler` + n_workers `dask worker` processes on 127.0.0.1.

    Each process runs in its own session (so its own process group); stdout/stderr go
    to files in tmpdir (never PIPE: a full pipe would block the process).
    """
    from distributed import Client

    tmpdir = Path(tmpdir)
    tmpdir.mkdir(parents=True, exist_ok=True)
    worker_env = list(worker_env or [{} for _ in range(n_workers)])
    if len(worker_env) != n_workers:
        raise ValueError("worker_env must have one dict per worker")
    dask = _dask_exe()
    sched_file = tmpdir / "scheduler.json"
    sched_file.unlink(missing_ok=True)

    tls_args: list[str] = []
    proto_args: list[str] = []
    if tls:
        tls_args = ["--tls-ca-file", tls["ca_file"], "--tls-cert", tls["cert"], "--tls-key", tls["key"]]
        proto_args = ["--protocol", "tls"]

    base_env = dict(os.environ)
    base_env.pop("CUDA_VISIBLE_DEVICES", None)
    base_env.setdefault("PYTHONUNBUFFERED", "1")

    procs: list[subprocess.Popen] = []
    hosts = Hosts(address="", procs=procs, tls=tls, logdir=tmpdir, security=make_security(tls))

    def spawn(name, argv, env):
        with open(tmpdir / f"{name}.out", "wb") as out, open(tmpdir / f"{name}.err", "wb") as err:
            procs.append(
                subprocess.Popen(
                    argv,
                    stdout=out,
                    stderr=err,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    cwd=tmpdir,
                    start_new_session=True,
                )
            )

    def fail(msg):
        text = f"{msg}\n{hosts.stderr_tails()}"
        try:
            hosts.stop()
        finally:
            raise RuntimeError(text)

    deadline = time.monotonic() + timeout
    spawn(
        "scheduler",
        [
            dask,
            "scheduler",
            "--host",
            HOST,
            "--port",
            "0",
            *proto_args,
            *tls_args,
            "--scheduler-file",
            str(sched_file),
            "--no-dashboard",
        ],
        base_env,
    )

    # 1) scheduler file (written after the scheduler is listening)
    address = None
    while time.monotonic() < deadline:
        if procs[0].poll() is not None:
            fail(f"dask scheduler exited early with rc={procs[0].returncode}")
        if sched_file.exists():
            try:
                address = json.loads(sched_file.read_text())["address"]
                break
            except (json.JSONDecodeError, KeyError):
                pass  # partially written
        time.sleep(0.05)
    if address is None:
        fail(f"scheduler file {sched_file} not written within {timeout}s")
    hosts.address = address

    # 2) workers
    target = ["--scheduler-file", str(sched_file)] if use_scheduler_file else [address]
    for i, extra in enumerate(worker_env):
        env = dict(base_env)
        env.update({k: str(v) for k, v in extra.items()})
        spawn(
            f"worker{i}",
            [
                dask,
                "worker",
                *target,
                "--resources",
                f"GPU={gpus}",
                "--nthreads",
                "2",
                "--host",
                HOST,
                "--no-dashboard",
                "--name",
                f"w{i}",
                "--local-directory",
                str(tmpdir / f"w{i}-space"),
                *proto_args,
                *tls_args,
                *(extra_worker_args or []),
            ],
            env,
        )

    # 3) wait until every worker joined (checked through a real Client)
    try:
        remaining = max(1.0, deadline - time.monotonic())
        with Client(address, security=hosts.security, timeout=remaining) as c:
            while True:
                dead = [p for p in procs if p.poll() is not None]
                if dead:
                    fail(f"process(es) exited early: {[(p.args[1], p.returncode) for p in dead]}")
                if len(c.scheduler_info(n_workers=-1)["workers"]) >= n_workers:
                    break
                if time.monotonic() > deadline:
                    fail(
                        f"only {len(c.scheduler_info(n_workers=-1)['workers'])}/{n_workers} "
                        f"workers joined {address} within {timeout}s"
                    )
                time.sleep(0.1)
    except RuntimeError:
        raise
    except Exception as e:  # connection errors etc.
        fail(f"could not verify cluster at {address}: {type(e).__name__}: {e}")
    return hosts


def kill_when_written(marker: Path, timeout: float = 60.0) -> threading.Thread:
    """A thread that SIGKILLs the pid a task writes to ``marker`` (its worker process), once written."""

    def kill() -> None:
        deadline = time.monotonic() + timeout
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        os.kill(int(marker.read_text()), signal.SIGKILL)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


PRIORITY_SCRIPT = Path(__file__).with_name("priority_script.py")


def prioritized_run(
    hosts: Hosts,
    name: str,
    n: int,
    seconds: float,
    tmp_path: Path,
    priority: int,
    env_extra: dict[str, str] | None = None,
    **profile: object,
) -> subprocess.Popen:
    """A flow-run process of ``n`` tasks of ``seconds`` on ``hosts`` (priority_script.py); its
    results land in ``tmp_path/<name>.json`` and each task start in ``tmp_path/starts``."""
    from prefect.settings import get_current_settings

    env = {**os.environ, "PREFECT_API_URL": str(get_current_settings().api.url)}
    env.pop("GPU_TASKS_EMULATED_GPUS", None)  # the flow's host has no devices: the workers do
    env["GPU_TASKS_PRIORITY"] = str(priority)
    env.update(env_extra or {})
    (tmp_path / "starts").mkdir(exist_ok=True)
    args = [hosts.address, str(n), str(seconds), str(tmp_path / f"{name}.json"), str(tmp_path / "starts")]
    return subprocess.Popen(
        [sys.executable, str(PRIORITY_SCRIPT), *args, json.dumps(profile)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def tasks_at_scheduler(hosts: Hosts) -> int:
    """How many tasks the shared scheduler holds now that have not finished (queued, waiting for a
    worker, or on one)."""
    with hosts.client() as client:
        return int(
            client.run_on_scheduler(
                lambda dask_scheduler: sum(
                    1
                    for ts in dask_scheduler.tasks.values()
                    if ts.state in ("queued", "no-worker", "processing")
                )
            )
        )


def overlaps(intervals: list[tuple[float, float]]) -> int:
    """The most intervals that overlap at one instant."""
    points = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    most = now = 0
    for _, step in points:
        now += step
        most = max(most, now)
    return most


def started_marks(hosts: Hosts) -> list[str]:
    """The Dask keys whose started mark (metadata under the key, set while gpu-tasks' task runs and
    cleared as it ends; gpu_tasks.worker.engine) the shared scheduler holds now, cleared or not."""
    with hosts.client() as client:
        return sorted(
            client.run_on_scheduler(
                lambda dask_scheduler: [
                    str(key)
                    for key, meta in dask_scheduler.task_metadata.items()
                    if isinstance(meta, dict) and "gpu-tasks-started" in meta
                ]
            )
        )
