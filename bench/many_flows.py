"""Many flow runs: N flow-run processes at once, each mapping M ``gpus=0.25`` tasks on two emulated devices.

    python -m bench.many_flows [--flows 10] [--tasks 1000] [--sleep 0] [--check] [--server production]
                               [--json F] [--logs DIR]

One Prefect server (the embedded one, or ``PREFECT_API_URL`` when set) and one device
lease directory (``GPU_TASKS_LEASE_DIR``, a temporary one) serve every flow run; each
flow run is a process of its own (``python -m bench.many_flows --child ...``), started
all at once with ``GPU_TASKS_EMULATED_GPUS=2``. Each maps M trivial tasks tagged
``profile("quarter")`` (a ``gpus=0.25`` profile: four tasks per device at a time) on a
``ProfileTaskRunner``; every task returns its input, the devices it ran on and when its
body ran. The parent then checks, from those reports, the runners' ledgers and the
Prefect server:

- every result came back (M per flow run, each the value its input gives);
- no device was over-packed: at no instant more than 4 tasks (1 / 0.25) on one device,
  counted over all flow runs, and no device held (leased) by two flow runs at once;
- the server recorded every task run: M task runs per flow run, all ``Completed``
  (after waiting for its writes to catch up);
- the lease queue was fair: when each flow run began waiting for a device (its first
  lease less its wait) against when it got one (first come, first served: pairs served
  out of arrival order are counted), and the spread of the flow runs' finish times.

Leases are exclusive per flow run (docs/leases.md): flow runs take the two devices in
turn, so the finish times spread over the whole run by design; the figures say how
evenly. ``--check`` exits 1 when a check fails (the suite reports them as met or
missed instead). Devices are always EMULATED here (worker processes, compute on the CPU):
scheduling figures, never GPU ones.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, machine, setup, write_json
from bench.production import SERVERS, server
from gpu_tasks.reporting.ledger import merge_intervals

PROFILE = "quarter"
FRACTION = 0.25
PER_DEVICE = round(1 / FRACTION)  # tasks of the profile one device may run at once
EMULATED = "2"  # GPU_TASKS_EMULATED_GPUS of every flow run
SERVED_AFTER_S = 1.0  # a flow run that began waiting this much earlier must not be served later


# ---------------------------------------------------------------- one flow run (child process)
def run_child(index: int, tasks: int, sleep: float) -> dict[str, Any]:
    """One flow run in this process: ``tasks`` mapped ``gpus=0.25`` tasks; its reports and ledger."""
    from prefect import flow, task, unmapped
    from prefect.context import FlowRunContext

    from gpu_tasks import ProfileTaskRunner, ResourceProfile, current_allocation, profile

    @task(name="quarter-task", tags=[profile(PROFILE)])
    def work(x: int, flow_index: int, seconds: float) -> dict[str, Any]:
        a = current_allocation()
        start = time.time()
        if seconds:
            time.sleep(seconds)
        return {
            "flow": flow_index,
            "x": x,
            "devices": list(a.devices),
            "fraction": a.fraction,
            "start": start,
            "end": time.time(),
        }

    runner = ProfileTaskRunner(profiles=[ResourceProfile(name=PROFILE, gpus=FRACTION, idle_timeout=60)])
    entered: list[Any] = []

    @flow(task_runner=runner, name="many-flows", flow_run_name=f"many-flows-{index}")
    def many(n: int) -> dict[str, Any]:
        ctx = FlowRunContext.get()
        assert ctx is not None and ctx.flow_run is not None
        entered.append(ctx.task_runner)
        begun = time.time()
        futures = work.map(range(n), flow_index=unmapped(index), seconds=unmapped(sleep))
        submitted = time.time()
        return {
            "flow_run_id": str(ctx.flow_run.id),
            "flow_start": begun,
            "submitted": submitted,
            "results": [f.result() for f in futures],
        }

    out = many(tasks)
    out["flow_end"] = time.time()  # the runner has closed its clusters: the devices are given back
    out["index"] = index
    out["pid"] = os.getpid()
    out["holds"] = [
        {
            "device": span.device,
            "start": span.start,
            "end": span.end,
            "wait_devices_s": row.wait_devices_seconds,
            "tasks": span.tasks,
            "reason": row.reason,
        }
        for row in entered[0].ledger
        for span in row.spans
    ]
    out["machine"] = machine()
    return out


# ---------------------------------------------------------------- the checks (pure, tested alone)
def most_at_once(intervals: list[tuple[float, float]]) -> int:
    """The most ``(start, end)`` intervals open at one instant (touching ones do not overlap)."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])  # ends first on a tie
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def packing(flows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per device: the most tasks running at once over all flow runs, and the most flow runs that
    ran tasks on it, or held its lease, at once."""
    by_device: dict[str, list[tuple[float, float]]] = {}
    runs: dict[str, list[tuple[float, float]]] = {}  # each flow run's task intervals, merged per device
    for fl in flows:
        mine: dict[str, list[tuple[float, float]]] = {}
        for r in fl["results"]:
            for d in r["devices"]:
                by_device.setdefault(d, []).append((r["start"], r["end"]))
                mine.setdefault(d, []).append((r["start"], r["end"]))
        for d, intervals in mine.items():
            runs.setdefault(d, []).extend(merge_intervals(intervals))
    holds: dict[str, list[tuple[float, float]]] = {}
    for fl in flows:
        for h in fl["holds"]:
            holds.setdefault(h["device"], []).append((h["start"], h["end"]))
    return {
        "tasks_at_once": {d: most_at_once(v) for d, v in sorted(by_device.items())},
        "tasks": {d: len(v) for d, v in sorted(by_device.items())},
        "flow_runs_at_once": {d: most_at_once(v) for d, v in sorted(runs.items())},
        "holders_at_once": {d: most_at_once(v) for d, v in sorted(holds.items())},
    }


def results_ok(fl: dict[str, Any], tasks: int) -> list[str]:
    """What is wrong with one flow run's results (empty: all ``tasks`` came back, each correct)."""
    got = fl.get("results") or []
    wrong = []
    if len(got) != tasks:
        wrong.append(f"{len(got)} results, not {tasks}")
    for x, r in enumerate(got):
        if r.get("flow") != fl["index"] or r.get("x") != x:
            wrong.append(f"result {x}: {r.get('flow')}/{r.get('x')}")
        elif len(r.get("devices") or []) != 1 or r.get("fraction") != FRACTION:
            wrong.append(f"result {x}: devices {r.get('devices')}, fraction {r.get('fraction')}")
    return wrong[:5]


def queue_order(flows: list[dict[str, Any]]) -> dict[str, Any]:
    """When each flow run began waiting for its first device and when it got it, and the pairs of
    flow runs served out of their arrival order (one began waiting ``SERVED_AFTER_S`` or more
    before another but got its device later)."""
    rows = []
    for fl in flows:
        if not fl["holds"]:
            continue
        first = min(fl["holds"], key=lambda h: h["start"])
        rows.append(
            {
                "index": fl["index"],
                "arrived": first["start"] - first["wait_devices_s"],
                "served": first["start"],
            }
        )
    overtaken = [
        (a["index"], b["index"])
        for a in rows
        for b in rows
        if a["arrived"] + SERVED_AFTER_S <= b["arrived"] and b["served"] < a["served"]
    ]
    return {
        "arrival_order": [r["index"] for r in sorted(rows, key=lambda r: r["arrived"])],
        "service_order": [r["index"] for r in sorted(rows, key=lambda r: r["served"])],
        "out_of_order": overtaken,
    }


# ---------------------------------------------------------------- the server's records
def server_records(
    api_url: str, flows: list[dict[str, Any]], tasks: int, timeout: float, quiet_s: float = 90.0
) -> dict[str, Any]:
    """Task runs per flow run on the server (all, and ``Completed``), once it has recorded all of
    them, or their count has not moved for ``quiet_s``, or after ``timeout``; and each flow run's
    state and start/end as the server has them."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from gpu_tasks.prefect_api.server import count_task_runs

    ids = {fl["index"]: fl["flow_run_id"] for fl in flows if fl.get("flow_run_id")}
    completed_only = {"state": {"type": {"any_": ["COMPLETED"]}}}
    t0 = time.monotonic()
    counts: dict[int, dict[str, int]] = {}
    with temporary_settings(updates={PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        last, moved = None, time.monotonic()
        while True:
            counts = {
                i: {
                    "task_runs": count_task_runs(client, {"flow_runs": {"id": {"any_": [fid]}}}),
                    "completed": count_task_runs(
                        client, {"flow_runs": {"id": {"any_": [fid]}}, "task_runs": completed_only}
                    ),
                }
                for i, fid in ids.items()
            }
            if all(c["completed"] == tasks for c in counts.values()):
                break
            now = time.monotonic()
            if counts != last:
                last, moved = counts, now
            if now - t0 >= timeout or now - moved >= quiet_s:
                break
            time.sleep(0.5)
        waited = time.monotonic() - t0
        runs = {}
        for i, fid in ids.items():
            fr = client.read_flow_run(fid)
            runs[i] = {
                "state": fr.state_type.value if fr.state_type else None,
                "start_time": fr.start_time.timestamp() if fr.start_time else None,
                "end_time": fr.end_time.timestamp() if fr.end_time else None,
            }
    return {"counts": counts, "flow_runs": runs, "waited_s": round(waited, 1)}


# ---------------------------------------------------------------- the parent
def _child_env(api_url: str, lease_dir: Path) -> dict[str, str]:
    env = {
        **os.environ,
        "PREFECT_API_URL": api_url,
        "GPU_TASKS_LEASE_DIR": str(lease_dir),
        "GPU_TASKS_EMULATED_GPUS": EMULATED,
    }
    env.pop("GPU_TASKS_DISCOVERY_COMMAND", None)
    env.pop("GPU_TASKS_PROFILES_FILE", None)
    # the last of many flow runs waits for all those before it: more than the 600 s default at 10 x 1,000
    env.setdefault("GPU_TASKS_LEASE_TIMEOUT", "3600")
    env.setdefault("PREFECT_CLIENT_MAX_RETRIES", "10")  # as the suite gives its benchmarks
    env.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    return env


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Kill a flow-run process left running, with the group it leads (its workers)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run(
    flows: int,
    tasks: int,
    sleep: float = 0.0,
    timeout: float = 3600.0,
    logs: str | None = None,
    api_url: str | None = None,
) -> dict[str, Any]:
    """``flows`` flow-run processes at once against one Prefect server and lease directory; the checks.
    ``logs``: a folder to keep each flow-run process's output in (``flow-<i>.log``). ``api_url``: that
    server (the production one); ``None``: the embedded one, started here (this process's Prefect
    settings were read when Prefect was imported: a ``PREFECT_API_URL`` set in its environment
    afterwards is not seen by them)."""
    from gpu_tasks.prefect_api.server import embedded_server

    given = contextlib.nullcontext(api_url) if api_url else embedded_server()
    with tempfile.TemporaryDirectory(prefix="gpu-tasks-many-flows-") as tmp, given as url:
        env = _child_env(url, Path(tmp) / "leases")
        procs: list[tuple[subprocess.Popen[bytes], float, Path, Path]] = []
        t0 = time.time()
        try:
            for i in range(flows):
                out, log = Path(tmp) / f"flow-{i}.json", Path(tmp) / f"flow-{i}.log"
                cmd = [sys.executable, "-m", "bench.many_flows", "--child", str(i), "--tasks", str(tasks)]
                cmd += ["--sleep", str(sleep), "--json", str(out)]
                with log.open("wb") as sink:
                    proc = subprocess.Popen(
                        cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
                    )
                procs.append((proc, time.time(), out, log))
            done: list[dict[str, Any]] = []
            failed: list[str] = []
            for i, (proc, launched, out, log) in enumerate(procs):
                try:
                    rc = proc.wait(timeout=max(1.0, t0 + timeout - time.time()))
                except subprocess.TimeoutExpired:
                    rc = None
                exited = time.time()
                if rc == 0 and out.exists():
                    fl = json.loads(out.read_text())
                    fl.update(launched=launched, exited=exited)
                    done.append(fl)
                else:
                    tail = log.read_text(errors="replace")[-2000:]
                    failed.append(f"flow {i}: exit {rc}\n{tail}")
                    print(f"  flow run {i} FAILED (exit {rc}):\n{tail}", file=sys.stderr, flush=True)
        finally:
            for proc, *_ in procs:
                _stop(proc)
            if logs:
                Path(logs).mkdir(parents=True, exist_ok=True)
                for *_, log in procs:
                    shutil.copy(log, Path(logs) / log.name)
        records = server_records(url, done, tasks, timeout=max(60.0, 0.05 * flows * tasks))
    return summarize(done, failed, records, flows, tasks, sleep, t0)


def summarize(
    done: list[dict[str, Any]],
    failed: list[str],
    records: dict[str, Any],
    flows: int,
    tasks: int,
    sleep: float,
    t0: float,
) -> dict[str, Any]:
    """The per-flow-run rows and the checks, times in seconds from the first launch (``t0``)."""
    pack = packing(done)
    order = queue_order(done)
    counts, server_runs = records["counts"], records["flow_runs"]
    rows = []
    for fl in sorted(done, key=lambda f: f["index"]):
        i = fl["index"]
        starts = [r["start"] for r in fl["results"]] or [fl["flow_start"]]
        ends = [r["end"] for r in fl["results"]] or [fl["flow_end"]]
        first = min(fl["holds"], key=lambda h: h["start"]) if fl["holds"] else None
        c = counts.get(i) or {"task_runs": 0, "completed": 0}
        srv = server_runs.get(i) or {}
        rows.append(
            {
                "index": i,
                "flow_run_id": fl["flow_run_id"],
                "launched_s": round(fl["launched"] - t0, 3),
                "flow_start_s": round(fl["flow_start"] - t0, 3),
                "wait_devices_s": round(first["wait_devices_s"], 3) if first else None,
                "first_lease_s": round(first["start"] - t0, 3) if first else None,
                "first_task_s": round(min(starts) - t0, 3),
                "last_task_end_s": round(max(ends) - t0, 3),
                "finished_s": round(fl["flow_end"] - t0, 3),
                "flow_s": round(fl["flow_end"] - fl["flow_start"], 3),
                "process_s": round(fl["exited"] - fl["launched"], 3),
                "results": len(fl["results"]),
                "wrong_results": results_ok(fl, tasks),
                "devices": sorted({h["device"] for h in fl["holds"]}),
                "leases": len(fl["holds"]),
                "task_runs_recorded": c["task_runs"],
                "task_runs_completed": c["completed"],
                "server_state": srv.get("state"),
                "server_flow_s": (
                    round(srv["end_time"] - srv["start_time"], 3)
                    if srv.get("end_time") and srv.get("start_time")
                    else None
                ),
            }
        )
    finished = [r["finished_s"] for r in rows]
    checks = {
        "all_flow_runs_finished": not failed and len(done) == flows,
        "all_results": len(rows) == flows
        and all(r["results"] == tasks and not r["wrong_results"] for r in rows),
        "no_device_over_packed": all(v <= PER_DEVICE for v in pack["tasks_at_once"].values())
        and all(v <= 1 for v in pack["flow_runs_at_once"].values())
        and all(v <= 1 for v in pack["holders_at_once"].values()),
        "all_task_runs_recorded": len(rows) == flows
        and all(r["task_runs_recorded"] == tasks and r["task_runs_completed"] == tasks for r in rows),
        "served_in_arrival_order": not order["out_of_order"],
    }
    return {
        "flows": flows,
        "tasks": tasks,
        "sleep_s": sleep,
        "profile": {"name": PROFILE, "gpus": FRACTION, "per_device": PER_DEVICE},
        "emulated_gpus": EMULATED,
        "machine": done[0]["machine"] if done else machine(),
        "rows": rows,
        "failed_flow_runs": failed,  # not "failed": the suite reads that as the benchmark failing
        "packing": pack,
        "queue": order,
        "records": {"waited_s": records["waited_s"]},
        "finish_spread_s": round(max(finished) - min(finished), 3) if finished else None,
        "wall_s": round(max(finished), 3) if finished else None,
        "flow_s": {
            "min": min((r["flow_s"] for r in rows), default=None),
            "max": max((r["flow_s"] for r in rows), default=None),
        },
        "checks": checks,
        "ok": all(checks.values()),
    }


def print_summary(res: dict[str, Any]) -> None:
    m = res["machine"]
    print(
        f"many flow runs: {res['flows']} x {res['tasks']} gpus={FRACTION} tasks on {len(m['devices'])} "
        f"{'EMULATED ' if m['emulated'] else ''}devices ({m['cpus']} cores); seconds from the first launch"
    )
    print(
        f"  {'flow':>4} {'waited':>7} {'1st lease':>9} {'1st task':>8} {'finished':>8} {'flow s':>7} "
        f"{'results':>7} {'recorded':>8} devices"
    )
    for r in res["rows"]:
        print(
            f"  {r['index']:>4} {r['wait_devices_s'] or 0:>7.2f} {r['first_lease_s'] or 0:>9.2f} "
            f"{r['first_task_s']:>8.2f} {r['finished_s']:>8.2f} {r['flow_s']:>7.2f} {r['results']:>7} "
            f"{r['task_runs_completed']:>8} {','.join(r['devices'])}"
        )
    p = res["packing"]
    print(
        f"  finish spread {res['finish_spread_s']} s, last finished at {res['wall_s']} s; most tasks at once "
        f"per device {p['tasks_at_once']} (limit {PER_DEVICE}); most flow runs on a device at once "
        f"{p['flow_runs_at_once']}; served in order {res['queue']['service_order']}, arrived in order "
        f"{res['queue']['arrival_order']}"
    )
    print("  checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in res["checks"].items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flows", type=int, default=10)
    parser.add_argument("--tasks", type=int, default=1000, help="tasks mapped per flow run")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds each task body sleeps (0: trivial)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for all flow runs to end")
    parser.add_argument("--check", action="store_true", help="exit 1 when a check fails")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None)
    parser.add_argument("--logs", default=None, help="a folder to keep each flow-run process's output in")
    parser.add_argument(
        "--server",
        choices=SERVERS,
        default="embedded",
        help="embedded: one SQLite server for all flow runs; production: PostgreSQL and Redis (as root)",
    )
    args = parser.parse_args()
    if args.child is not None:
        setup()
        write_json(args.json, run_child(args.child, args.tasks, args.sleep))
        return
    if not os.environ.get("PREFECT_API_URL"):  # the embedded server's database: a temporary one
        os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="gpu-tasks-bench-prefect-"))
        os.environ.setdefault("PREFECT_CLIENT_MAX_RETRIES", "10")
    setup()
    with server(args.server) as url:  # None: the embedded server, which run() starts
        res = run(args.flows, args.tasks, args.sleep, args.timeout, args.logs, url) | {"server": args.server}
    write_json(args.json, res)
    print_summary(res)
    if args.check and not res["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
