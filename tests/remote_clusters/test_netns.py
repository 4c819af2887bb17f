"""Address profiles across hosts that are hosts: network namespaces on a private bridge
(``infra/netns``; ``remote_clusters/netns.py``). The flow runs on its own host, with its
Prefect API there; the scheduler and each GPU worker on theirs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from remote_clusters.hosts import overlaps
from remote_clusters.netns import ADDRESS, NOBODY, NetHosts, clean_env

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent


def _flow(hosts: NetHosts, script: str, args: list[str], api: str | None = None) -> subprocess.Popen:
    """A flow-run process on the flow host, reporting to ``api`` (the flow host's bridge address)."""
    env = clean_env(PREFECT_API_URL=api or hosts.api_url)
    return subprocess.Popen(
        [
            str(Path(__file__).parents[2] / "infra" / "netns" / "exec.sh"),
            "flow",
            sys.executable,
            str(HERE / script),
            *args,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=hosts.logdir,
    )


def _finish(proc: subprocess.Popen, timeout: float = 180) -> str:
    log = proc.communicate(timeout=timeout)[0].decode(errors="replace")
    assert proc.returncode == 0, log[-3000:]
    return log


def _reach(hosts: NetHosts, address: str, tmp_path: Path, n: int = 1, api: str | None = None) -> dict:
    out = tmp_path / "reach.json"
    _finish(_flow(hosts, "reach_script.py", [address, str(n), "0.2", str(out)], api))
    result: dict = json.loads(out.read_text())
    print(f"flow run took {result['seconds']:.1f} s, its tasks {result['tasks_s']:.1f} s")
    return result


def test_two_flow_runs_share_two_gpu_hosts_one_task_per_device(net_hosts: NetHosts, tmp_path: Path):
    outs = [tmp_path / f"run{i}.json" for i in range(2)]
    procs = [_flow(net_hosts, "flow_script.py", [net_hosts.address, "1", "3", "1.0", str(o)]) for o in outs]
    for p in procs:
        _finish(p)
    tasks = [t for o in outs for t in json.loads(o.read_text())["tasks"]]
    assert len(tasks) == 6
    by_device: dict[str, list[tuple[float, float]]] = {}
    for t in tasks:
        assert t["devices"] == [f"{t['host']}:0"] and t["emulated"] is True, t
        by_device.setdefault(t["devices"][0], []).append((t["start"], t["end"]))
    assert set(by_device) == {"gtn-gpu1:0", "gtn-gpu2:0"}  # both hosts, by their own names
    for device, intervals in by_device.items():
        assert overlaps(intervals) == 1, (device, sorted(intervals))  # never two tasks on one device


def test_an_api_on_the_flow_hosts_loopback_is_refused_in_seconds_naming_the_workers(
    net_hosts: NetHosts, tmp_path: Path
):
    # a different server at 127.0.0.1:4200 of one GPU host must not pass for the flow run's API
    net_hosts.spawn("decoy", "gpu1", [sys.executable, "-m", "http.server", "4200", "--bind", "127.0.0.1"])
    try:
        result = _reach(net_hosts, net_hosts.address, tmp_path, n=2, api="http://127.0.0.1:4200/api")
    finally:
        net_hosts.kill("decoy")
    errors = [r.get("error", "") for r in result["results"]]
    assert all(e.startswith("ClusterError") for e in errors), errors
    first = errors[0]
    assert "cannot reach this flow run's Prefect API at http://127.0.0.1:4200/api" in first, first
    assert "gpu1 on gtn-gpu1: a server answered but knows no flow run" in first, first
    assert "gpu2 on gtn-gpu2: connection refused" in first, first
    assert "PREFECT_API_URL" in first
    assert result["tasks_s"] < 30  # not the 120 s provision timeout


def test_a_scheduler_on_the_flow_hosts_own_address_works_with_a_loopback_api(
    net_hosts: NetHosts, tmp_path: Path
):
    """Scheduler and worker on the flow's host at its bridge address: they reach its 127.0.0.1."""
    address = net_hosts.scheduler("flow", 8786, "flow-scheduler")
    net_hosts.worker("flow", address, name="flow-worker")
    try:
        net_hosts.wait(address, 1, api=False)
        result = _reach(net_hosts, address, tmp_path, n=2, api="http://127.0.0.1:4200/api")
    finally:
        net_hosts.kill("flow-worker")
        net_hosts.kill("flow-scheduler")
    assert [r.get("devices") for r in result["results"]] == [["gtn-flow:0"]] * 2, result


@pytest.mark.parametrize(
    ("address", "cause"),
    [
        (f"tcp://{ADDRESS['sched']}:8799", "connection refused"),  # the host is up, no scheduler
        (f"tcp://{NOBODY}:8786", "no route to host"),  # no such host on the network
    ],
    ids=["refused", "host-gone"],
)
def test_a_scheduler_that_cannot_be_reached_fails_the_profile_in_seconds(
    net_hosts: NetHosts, tmp_path: Path, address: str, cause: str
):
    result = _reach(net_hosts, address, tmp_path, n=3)
    errors = [r.get("error", "") for r in result["results"]]
    assert all(e.startswith("ClusterError") and address in e and cause in e for e in errors), errors
    assert "__main__" not in errors[0]  # no advice about worker processes: none is started
    assert sum("fails with it instead of trying again" in e for e in errors) == 2, errors  # the queued two
    assert result["tasks_s"] < 20, result  # not 120 s, nor 120 s per queued task


def test_a_gpu_hosts_link_cut_mid_task_crashes_it_and_the_retry_completes_on_the_other(
    net_hosts: NetHosts, tmp_path: Path
):
    """Last in this module: the cut host stays cut off until the module's hosts are torn down."""
    marker, out = tmp_path / "running-on", tmp_path / "cut.json"
    proc = _flow(net_hosts, "cut_script.py", [net_hosts.address, str(marker), str(out)])
    deadline = time.monotonic() + 120
    while not marker.exists() or not marker.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.1)
    time.sleep(1.0)
    host = marker.read_text().removeprefix("gtn-")  # the GPU host its first attempt runs on
    subprocess.run(["ip", "-n", f"gtn-{host}", "link", "set", "eth0", "down"], check=True)
    cut_at = time.time()
    _finish(proc, timeout=240)
    result = json.loads(out.read_text())
    done = result["result"]
    print(f"link of {host} cut: the retry completed on {done['host']} {done['end'] - cut_at:.1f} s later")
    assert result["result"]["host"] != f"gtn-{host}"
    assert result["state"] == "COMPLETED" and result["run_count"] == 2, result
    assert "CRASHED" in result["states"], result["states"]
    assert result["running"] == [], result
