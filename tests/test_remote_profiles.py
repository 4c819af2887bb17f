"""address / cluster_class profiles: validation, the TOML file, the loopback-API rule, worker fit."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest

from gpu_tasks import ProfileTaskRunner, ResourceProfile, TlsOptions
from gpu_tasks.cluster.address import scheduler_unreachable
from gpu_tasks.cluster.managed import load_cluster_class
from gpu_tasks.cluster.remote_workers import RemoteWorker, is_leaving
from gpu_tasks.errors import ClusterError, ProfileError
from gpu_tasks.prefect_api.api import unreachable_api_error
from gpu_tasks.profiles import load_profiles_file
from gpu_tasks.worker.api_probe import probe_api


def test_kinds_and_what_they_imply():
    local = ResourceProfile(name="l", gpus=1)
    shared = ResourceProfile(name="s", gpus=1, address="tls://gpu-scheduler:8786")
    managed = ResourceProfile(
        name="m",
        gpus=1,
        cluster_class="dask_jobqueue.SLURMCluster",
        cluster_kwargs={"queue": "gpu"},
        max_workers=8,
    )
    cpu_remote = ResourceProfile(name="c", address="10.0.0.5:8786")
    assert (local.kind, shared.kind, managed.kind) == ("local", "address", "cluster_class")
    assert local.is_local and not shared.is_local and not managed.is_local
    assert cpu_remote.uses_processes  # a CPU profile on a cluster runs on its worker processes


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"address": "gpu-scheduler"}, "address must be a Dask scheduler address"),
        ({"address": "tcp://host:99999"}, "address must be a Dask scheduler address"),
        ({"address": "http://host:8786"}, "address must be a Dask scheduler address"),
        ({"cluster_class": "SLURMCluster", "max_workers": 1}, "must be the import path"),
        ({"cluster_class": "a.B"}, "cluster_class needs max_workers"),
        ({"address": "tcp://h:1", "cluster_class": "a.B", "max_workers": 1}, "exclude each other"),
        (
            {"cluster_kwargs": {"queue": "gpu"}},
            "cluster_kwargs applies to cluster_class profiles, not to this local",
        ),
        (
            {"security": {"ca_file": "ca.pem"}},
            "security applies to address profiles, not to this local profile",
        ),
        (
            {"address": "tcp://h:1", "fallback": "cpu"},
            "fallback applies to local profiles, not to this address",
        ),
        ({"address": "tcp://h:1", "gang": True, "max_workers": 2}, "cannot be started as a gang"),
        ({"address": "tcp://h:1", "security": {"ca": "x"}}, "security.ca is not a profile field"),
    ],
)
def test_bad_placement_fields_name_the_field_and_the_fix(fields, says):
    with pytest.raises(ProfileError, match="profile 'p'") as info:
        ResourceProfile(name="p", gpus=1, **fields)
    assert says in str(info.value)


def test_processes_is_refused_on_a_cluster():
    for value in (False, True):
        with pytest.raises(ProfileError, match="processes applies to local profiles, not to this address"):
            ResourceProfile(name="p", processes=value, address="tcp://h:1")


def test_the_issue_examples_load_from_a_toml_file(tmp_path: Path):
    path = tmp_path / "profiles.toml"
    path.write_text(
        textwrap.dedent(
            """
            [profiles.gpu-shared]
            gpus = 1
            address = "tls://gpu-scheduler:8786"
            [profiles.gpu-shared.security]
            ca_file = "/etc/dask/ca.pem"
            cert = "/etc/dask/client.pem"
            key = "/etc/dask/client.key"

            [profiles.gpu-slurm]
            gpus = 1
            cluster_class = "dask_jobqueue.SLURMCluster"
            max_workers = 8
            idle_timeout = 120
            [profiles.gpu-slurm.cluster_kwargs]
            queue = "gpu"
            job_extra_directives = ["--gres=gpu:1"]
            cores = 8
            memory = "64GiB"
            worker_extra_args = ["--resources", "GPU=1"]
            """
        )
    )
    profiles, _ = load_profiles_file(path)
    shared, slurm = profiles["gpu-shared"], profiles["gpu-slurm"]
    assert shared.address == "tls://gpu-scheduler:8786"
    assert shared.security == TlsOptions(
        ca_file="/etc/dask/ca.pem", cert="/etc/dask/client.pem", key="/etc/dask/client.key"
    )
    assert slurm.cluster_kwargs["job_extra_directives"] == ["--gres=gpu:1"] and slurm.max_workers == 8
    assert slurm == ResourceProfile(
        name="gpu-slurm",
        gpus=1,
        cluster_class="dask_jobqueue.SLURMCluster",
        cluster_kwargs={
            "queue": "gpu",
            "job_extra_directives": ["--gres=gpu:1"],
            "cores": 8,
            "memory": "64GiB",
            "worker_extra_args": ["--resources", "GPU=1"],
        },
        max_workers=8,
        idle_timeout=120,
    )


def test_a_runner_with_remote_profiles_pickles_and_compares():
    import cloudpickle

    runner = ProfileTaskRunner(
        profiles=[
            ResourceProfile(name="s", gpus=1, address="tcp://h:8786"),
            ResourceProfile(name="m", gpus=1, cluster_class="a.B", cluster_kwargs={"x": [1]}, max_workers=2),
        ]
    )
    assert cloudpickle.loads(cloudpickle.dumps(runner)) == runner
    assert runner.duplicate() == runner


@pytest.fixture
def api_stub():
    """An HTTP server on 127.0.0.1 that knows one flow run: ``(base URL, its id)``."""
    import http.server
    import json
    import threading

    run_id = "5b1c0e4e-0000-4000-8000-000000000001"

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            known = self.path == f"/api/flow_runs/{run_id}"
            body = json.dumps({"id": run_id} if known else {"detail": "Not Found"}).encode()
            self.send_response(200 if known else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/api", run_id
    server.shutdown()
    server.server_close()


def test_the_api_probe_asks_for_the_flow_run_so_another_server_cannot_pass(api_stub):
    url, run_id = api_stub
    assert probe_api(url, run_id, {}, 2.0) is None
    other = probe_api(url, "5b1c0e4e-0000-4000-8000-000000000002", {}, 2.0)
    assert other is not None and "not this flow run's API" in other
    port = url.split(":")[2].split("/")[0]
    refused = probe_api(url.replace(port, str(_free_port())), run_id, {}, 2.0)
    assert refused == "connection refused"


def test_the_unreachable_api_message_names_the_api_the_workers_and_the_fix():
    why = unreachable_api_error(
        "p", "http://127.0.0.1:4200/api", "tcp://sched:8786", {"w1 on gpu1": "connection refused"}
    )
    assert "http://127.0.0.1:4200/api" in why and "w1 on gpu1: connection refused" in why
    assert "its own host" in why and "PREFECT_API_URL" in why and "--host 0.0.0.0" in why


def test_a_scheduler_address_that_refuses_connections_is_named_at_once():
    started = time.monotonic()
    why = scheduler_unreachable(f"tcp://127.0.0.1:{_free_port()}", 1.0)
    assert why is not None and why.startswith("connection refused"), why
    assert time.monotonic() - started < 3
    assert scheduler_unreachable("ucx://127.0.0.1:1", 1.0) is None  # not TCP: the client finds out


def test_a_ucx_address_without_ucx_installed_fails_saying_so_before_any_client():
    import importlib.util

    from gpu_tasks.cluster.address import AddressCluster

    if importlib.util.find_spec("distributed_ucxx") is not None:
        pytest.skip("UCX is installed here (distributed-ucxx)")
    cluster = AddressCluster(ResourceProfile(name="u", gpus=1, address="ucx://127.0.0.1:1"), {}, 5.0)
    with pytest.raises(ClusterError, match=r"'u': cannot use ucx://127.0.0.1:1: the ucx protocol needs UCX"):
        cluster.start(1)
    assert cluster.client is None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(**kw) -> RemoteWorker:
    return RemoteWorker(**{"address": "tcp://h:1", "name": "w", "host": "h", "gpus": 1.0, **kw})


def test_which_remote_workers_fit_a_profile():
    h100 = _worker(devices=("0",), names=("NVIDIA H100 80GB HBM3",), memory=(80 * 2**30,))
    assert h100.why_not(ResourceProfile(name="p", gpus=1)) is None
    assert h100.why_not(ResourceProfile(name="p", gpus=0.25)) is None
    assert h100.why_not(ResourceProfile(name="p", gpus=2)) == "GPU=1 < 2"
    assert h100.why_not(ResourceProfile(name="p", gpus=1, gpu_model="h100")) is None
    assert "do not match" in h100.why_not(ResourceProfile(name="p", gpus=1, gpu_model="A100"))
    assert "below gpu_memory_total" in h100.why_not(
        ResourceProfile(name="p", gpus=1, gpu_memory_total="96GiB")
    )
    silent = _worker()  # a worker without gpu-tasks cannot describe its devices
    assert "publishes no device names" in silent.why_not(ResourceProfile(name="p", gpus=1, gpu_model="H100"))
    assert _worker(gpus=0).why_not(ResourceProfile(name="p", gpus=0.5)) == "GPU=0 < 0.5"
    assert h100.device_keys == ("h:0",)
    # a worker that owns two devices (GPU=2) runs gpus=2 tasks; gpus=1 and gpus=0.5 tasks would run
    # side by side there, each seeing both devices and told it holds them (found by a new-user pass)
    two = _worker(gpus=2.0, devices=("0", "1"))
    assert two.why_not(ResourceProfile(name="p", gpus=2)) is None
    for gpus in (1, 0.5):
        why = two.why_not(ResourceProfile(name="p", gpus=gpus)) or ""
        assert "GPU=2 is more devices than a task of this profile holds (1)" in why, why
        assert "--resources GPU=1" in why, why


def test_a_worker_that_is_closing_is_not_mistaken_for_one_without_gpu_tasks():
    # what Client.run(on_error="return") gives for a worker being scaled down, and for one without gpu-tasks
    from distributed.comm.core import CommClosedError

    assert is_leaving(CommClosedError("in <TCP (closed) Scheduler Broadcast>: ConnectionResetError"))
    assert is_leaving(TimeoutError("timed out")) and is_leaving(ConnectionResetError(104, "reset"))
    assert not is_leaving(ModuleNotFoundError("No module named 'gpu_tasks'"))
    assert not is_leaving({"host": "h", "devices": ["0"]})


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("no_such_package_xyz.Cluster", "cannot be imported"),
        ("distributed.NoSuchCluster", "has no 'NoSuchCluster'"),
        ("collections.OrderedDict", "is not a Dask cluster class"),
        ("os.path.join", "is not a Dask cluster class"),
    ],
)
def test_load_cluster_class_errors(path, says):
    prof = ResourceProfile(name="p", gpus=1, cluster_class=path, max_workers=1)
    with pytest.raises(ClusterError, match="profile 'p'") as info:
        load_cluster_class(prof)
    assert says in str(info.value)


def test_load_cluster_class_keeps_signal_handlers():
    import signal

    before = signal.getsignal(signal.SIGINT)
    prof = ResourceProfile(name="p", gpus=1, cluster_class="dask_jobqueue.SLURMCluster", max_workers=1)
    from distributed.deploy.cluster import Cluster

    assert issubclass(load_cluster_class(prof), Cluster)
    assert signal.getsignal(signal.SIGINT) is before  # dask_jobqueue.runner sets one at import


def test_the_shipped_distributed_profiles_file_loads():
    from gpu_tasks.profiles import resolve_profiles

    path = Path(__file__).parents[1] / "infra" / "profiles-distributed.toml"
    profiles, default = resolve_profiles(path=path)
    assert default == "cpu"
    kinds = {name: p.kind for name, p in profiles.items()}
    assert kinds == {
        "cpu": "local",
        "gpu-shared": "address",
        "gpu-slurm": "cluster_class",
        "gpu-k8s": "cluster_class",
    }
    slurm = profiles["gpu-slurm"].cluster_kwargs
    assert slurm["job_extra_directives"] == ["--gres=gpu:1"] and slurm["processes"] == 1
    assert slurm["worker_extra_args"] == ["--resources", "GPU=1"]


class ActsAsCluster:
    """Like dask-gateway's GatewayCluster: no distributed Cluster subclass, but scale/close/address (an
    instance attribute, set once started: the class has none)."""

    def __init__(self) -> None:
        self.scheduler_address = "tcp://127.0.0.1:1"

    def scale(self, n: int) -> None: ...

    def close(self) -> None: ...


def test_a_class_that_acts_as_a_dask_cluster_is_accepted():
    prof = ResourceProfile(name="p", gpus=1, cluster_class=f"{__name__}.ActsAsCluster", max_workers=1)
    assert load_cluster_class(prof) is ActsAsCluster


class NeverStartedCluster(ActsAsCluster):
    """Acts as a cluster on the class, but its instance never got a scheduler_address."""

    closed = False

    def __init__(self) -> None:
        pass

    def close(self) -> None:
        NeverStartedCluster.closed = True


def test_a_cluster_without_a_scheduler_address_is_closed_with_a_clear_error():
    from gpu_tasks.cluster.managed import ManagedCluster

    prof = ResourceProfile(name="p", cluster_class=f"{__name__}.NeverStartedCluster", max_workers=1)
    cluster = ManagedCluster(prof, {}, 5.0)
    with pytest.raises(ClusterError, match="profile 'p': .* gave a cluster without a scheduler_address"):
        cluster._create()
    assert NeverStartedCluster.closed and cluster.manager is None and cluster.client is None


def test_dask_gateways_cluster_class_is_accepted():
    pytest.importorskip("dask_gateway", reason="dask-gateway is not installed (the dev extra)")
    prof = ResourceProfile(name="p", cluster_class="dask_gateway.GatewayCluster", max_workers=1)
    assert load_cluster_class(prof).__name__ == "GatewayCluster"


def test_a_closed_gateway_clients_stopped_loop_runner_is_dropped_and_a_running_one_kept():
    """dask-gateway's Gateway.__del__ closes again while it has a _loop_runner, and reading a stopped
    one's loop raises with distributed 2026.7: after close, a stopped runner is dropped."""
    from types import SimpleNamespace

    from distributed.utils import LoopRunner

    from gpu_tasks.compat.dask_gateway import drop_stopped_loop_runner as _closed_loop_runner_dropped

    stopped = SimpleNamespace(gateway=SimpleNamespace(_loop_runner=LoopRunner(asynchronous=False)))
    _closed_loop_runner_dropped(stopped)
    assert not hasattr(stopped.gateway, "_loop_runner")
    running = LoopRunner(asynchronous=False)
    running.start()
    try:
        started = SimpleNamespace(gateway=SimpleNamespace(_loop_runner=running))
        _closed_loop_runner_dropped(started)
        assert started.gateway._loop_runner is running
        _closed_loop_runner_dropped(SimpleNamespace())  # no gateway: nothing to do
    finally:
        running.stop()
