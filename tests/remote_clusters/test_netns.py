"""Address profiles across hosts that are hosts: network namespaces on a private bridge
(``infra/netns``; ``remote_clusters/netns.py``). The flow runs on its own host, with its
Prefect API there; the scheduler and each GPU worker on theirs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from remote_clusters.hosts import overlaps
from remote_clusters.netns import ADDRESS, NOBODY, NetHosts, clean_env

# a test's setup may wait for another test process's share of this module to end (the namespaces
# are one set per host: conftest.net_hosts): more than the suite's 300 s
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

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


def _wait_files(
    where: Path, pattern: str, n: int, proc: subprocess.Popen, timeout: float = 120
) -> list[Path]:
    deadline = time.monotonic() + timeout
    while len(found := sorted(where.glob(pattern))) < n:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.1)
    return found


def _stamp(path: Path) -> float:
    return float(path.name.rsplit("-", 1)[1])


def test_a_flow_process_killed_frees_the_shared_workers_gpus_for_another_flow_run(
    net_hosts: NetHosts, tmp_path: Path
):
    """SIGKILL of the flow process (in the flow namespace) under two 60 s tasks, one per GPU host."""
    first, second = tmp_path / "killed", tmp_path / "next"
    first.mkdir()
    second.mkdir()
    proc = _flow(net_hosts, "fault_script.py", [net_hosts.address, "2", "60", str(first)])
    _wait_files(first, "start-*", 2, proc)
    time.sleep(1.0)
    os.kill(int((first / "flow.pid").read_text()), signal.SIGKILL)
    killed_at = time.time()
    proc.wait(10)
    _finish(_flow(net_hosts, "fault_script.py", [net_hosts.address, "2", "0.5", str(second)]))
    result = json.loads((second / "out.json").read_text())
    waits = {r["host"]: round(r["start"] - killed_at, 2) for r in result["results"]}
    print(
        f"kill -> the next flow run's tasks started {waits} s later; its flow function began "
        f"{result['began'] - killed_at:.1f} s after the kill"
    )
    assert sorted(waits) == ["gtn-gpu1", "gtn-gpu2"], waits  # on the same two workers, GPU=1 each
    assert max(waits.values()) < 20, waits  # not the 60 s the killed tasks would have held them
    assert all(r["state"] == "COMPLETED" for r in result["runs"]), result["runs"]
    killed_ids = json.loads((first / "ids.json").read_text())
    deadline = time.monotonic() + 20  # the server records the crash reports from their events
    while True:
        killed_runs = [net_hosts.query("task-run", i) for i in killed_ids]
        if all(r["state"] == "CRASHED" for r in killed_runs) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    print(f"the killed flow run's task runs on the API: {killed_runs}")
    assert [r["state"] for r in killed_runs] == ["CRASHED", "CRASHED"], killed_runs
    assert list(first.glob("done-*")) == []  # they never complete: interrupted, not left to run
    assert set(net_hosts.query("workers", net_hosts.address)) == {"gpu1", "gpu2"}  # the workers stay up


def test_the_api_stopped_for_30_s_mid_run_loses_no_result(net_hosts: NetHosts, tmp_path: Path):
    """No packet filter here (no nft, no iptables, no tc actions): the flow host's Prefect server
    is stopped for 30 s while two of four 10 s tasks run, the others queued, then started again."""
    proc = _flow(net_hosts, "fault_script.py", [net_hosts.address, "4", "10", str(tmp_path)])
    _wait_files(tmp_path, "start-*", 2, proc)
    time.sleep(2.0)
    asked = time.time()
    net_hosts.stop_api()
    stopped_at = time.time()
    time.sleep(30)
    net_hosts.start_api()
    print(f"API stopped in {stopped_at - asked:.1f} s, started again {time.time() - stopped_at:.1f} s later")
    log = _finish(proc, timeout=240)
    print("\n".join(line for line in log.splitlines() if "WARNING" in line or "ERROR" in line)[-4000:])
    for host in ("gpu1", "gpu2"):
        lines = net_hosts.log(host, 400).splitlines()
        said = [ln for ln in lines if "Prefect API" in ln or "Unable to" in ln]
        print(f"--- {host}: {len(said)} line(s) about the API, the last:\n" + "\n".join(said[-2:]))
    result = json.loads((tmp_path / "out.json").read_text())
    starts = sorted(_stamp(p) - stopped_at for p in tmp_path.glob("start-*"))
    print(
        f"tasks started {starts} s after the stop; flow run {result['seconds']:.1f} s; runs {result['runs']}"
    )
    assert sorted(r["i"] for r in result["results"]) == [0, 1, 2, 3]
    assert len(list(tmp_path.glob("done-*"))) == 4
    assert all(r["state"] == "COMPLETED" for r in result["runs"]), result["runs"]


def test_a_gpu_hosts_link_cut_mid_task_then_restored_the_task_completes_once(
    net_hosts: NetHosts, tmp_path: Path
):
    """Last in this module. The first attempt sleeps 45 s: its link is cut 1 s in, the retry
    completes on the other host, then the link comes back before the first attempt's sleep ends."""
    marker, out = tmp_path / "running-on", tmp_path / "cut.json"
    proc = _flow(net_hosts, "cut_script.py", [net_hosts.address, str(marker), str(out), "45"])
    deadline = time.monotonic() + 120
    while not marker.exists() or not marker.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.1)
    first_end = time.time() + 45
    time.sleep(1.0)
    host = marker.read_text().removeprefix("gtn-")  # the GPU host its first attempt runs on
    subprocess.run(["ip", "-n", f"gtn-{host}", "link", "set", "eth0", "down"], check=True)
    cut_at = time.time()
    try:
        _finish(proc, timeout=240)
    finally:
        subprocess.run(["ip", "-n", f"gtn-{host}", "link", "set", "eth0", "up"], check=True)
    restored_at = time.time()
    result = json.loads(out.read_text())
    done = result["result"]
    print(f"link of {host} cut: the retry completed on {done['host']} {done['end'] - cut_at:.1f} s later")
    assert result["result"]["host"] != f"gtn-{host}"
    assert result["state"] == "COMPLETED" and result["run_count"] == 2, result
    assert "CRASHED" in result["states"], result["states"]
    assert result["running"] == [], result
    # the link is back: watch the scheduler's workers until the first attempt's sleep has ended
    seen: list[tuple[float, dict]] = []
    while time.time() < first_end + 3:
        workers = net_hosts.query("workers", net_hosts.address)
        if not seen or workers != seen[-1][1]:
            seen.append((round(time.time() - restored_at, 1), workers))
        time.sleep(1.0)
    after = net_hosts.query("task-run", result["task_run_id"])
    completions = sorted(p.name for p in tmp_path.glob("running-on.done-*"))
    print(f"link restored {restored_at - cut_at:.1f} s after the cut; scheduler's workers since: {seen}")
    print(f"completions: {completions}; task run now {after}")
    print(f"--- {host}'s worker log\n{net_hosts.log(host, 12)}")
    assert completions == [f"running-on.done-{done['host']}-{done['end']:.3f}"]  # the retry's, once
    assert set(seen[-1][1]) == {"gpu1", "gpu2"} - {host}  # the cut host's worker left for good
    # its `dask worker` process ends: the attempt's 45 s sleep is interrupted only when it returns,
    # then the worker closes and its nanny exits, seconds later on a loaded machine (hang guard 60 s)
    try:
        net_hosts.procs[host].wait(60)
    except subprocess.TimeoutExpired:
        log = net_hosts.log(host, 30)
        raise AssertionError(f"{host}'s `dask worker` still runs 60 s on:\n{log}") from None
    assert after["state"] == "COMPLETED" and after["run_count"] == 2, after
