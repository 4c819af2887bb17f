"""Two teams sharing two devices: strict quotas against borrowing + reclaim + fair share, in one run.

    python -m bench.sharing [--duration 60] [--task-seconds 4] [--bursts 10 35] [--burst-tasks 2]
                            [--grace 2] [--modes strict borrowing] [--json out.json]

Two emulated devices (``GPU_TASKS_EMULATED_GPUS=2``), one Prefect server (the embedded one) and one
device lease directory per mode. Two teams, each a quota of 1 device (``gpu-tasks quotas set``):

- team A is busy all the time: one flow-run process whose ``preemptible`` profile (``gpus=1``,
  ``quota="team-a"``, up to 2 workers) keeps three tasks of ``--task-seconds`` outstanding until
  ``--duration`` has passed (a new task as soon as one ends);
- team B arrives in bursts: one flow-run process whose profile (``gpus=1``, ``quota="team-b"``, not
  preemptible, idle timeout 2 s) submits ``--burst-tasks`` tasks at each of ``--bursts`` seconds
  and waits for them.

The modes, the same load each:

- ``strict``: quotas as caps (borrowing limit 0): A never uses the second device, even while B is idle;
- ``borrowing``: A may borrow B's idle device (borrowing limit 1, preemptible profile only); when B
  arrives the borrowed device is reclaimed (A's task preempted after ``--grace`` seconds and
  re-queued); fair share orders equal-priority waiters by decayed usage.

Every task body appends what it does to one events file (start, every 0.5 s alive, end, with its
devices), so the parent sees the work a preemption threw away (start to last sign of life of an
attempt that never ended). Reported per mode: device-seconds busy and useful (attempts that ended)
over those available (2 devices x the window), work lost to preemption, each team's wait (a task's
submit to the start of its attempt that ended) p50 / p95, and for each of B's bursts the time from
its submit to B's first task body. Devices are always EMULATED here: scheduling figures, never GPU
ones.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, machine, write_json
from gpu_tasks.reporting.ledger import union_seconds

EMULATED = "2"
MODES = ("strict", "borrowing")
A, B = "team-a", "team-b"
OUTSTANDING_A = 3  # team A keeps this many tasks submitted and not done: more than its quota runs
ALIVE_EVERY_S = 0.5


def _quota_settings(mode: str) -> dict[str, int]:
    """Each team's borrowing limit in ``mode`` (devices beyond its quota it may borrow)."""
    return {A: 1, B: 0} if mode == "borrowing" else {A: 0, B: 0}


# ---------------------------------------------------------------- one team's flow run (child process)
def _record(events: str, team: str, index: int, kind: str, devices: list[str]) -> None:
    line = json.dumps(
        {"team": team, "task": index, "pid": os.getpid(), "kind": kind, "t": time.time(), "devices": devices}
    )
    fd = os.open(events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())  # one write of a short line: whole on O_APPEND
    finally:
        os.close(fd)


def run_child(
    team: str,
    events: str,
    t0: float,
    duration: float,
    task_seconds: float,
    bursts: list[float],
    burst_tasks: int,
) -> dict[str, Any]:
    """One team's flow run in this process; the submit time of each of its tasks."""
    import concurrent.futures

    from prefect import flow, task

    from gpu_tasks import ProfileTaskRunner, ResourceProfile, current_allocation, profile_tag

    @task(name=f"{team}-work", tags=[profile_tag(team)], retries=0)
    def work(index: int, seconds: float) -> dict[str, Any]:
        devices = list(current_allocation().devices)
        _record(events, team, index, "start", devices)
        end = time.time() + seconds
        while (left := end - time.time()) > 0:
            time.sleep(min(ALIVE_EVERY_S, left))
            _record(events, team, index, "alive", devices)
        _record(events, team, index, "end", devices)
        return {"task": index, "devices": devices}

    if team == A:
        prof = ResourceProfile(name=team, gpus=1, quota=team, preemptible=True, max_workers=2, idle_timeout=2)
    else:
        prof = ResourceProfile(name=team, gpus=1, quota=team, max_workers=1, idle_timeout=2)
    submitted: dict[int, float] = {}

    @flow(task_runner=ProfileTaskRunner(profiles=[prof]), name=f"sharing-{team}")
    def team_flow() -> int:
        futures: list[Any] = []
        time.sleep(max(0.0, t0 - time.time()))  # both teams' clocks start together
        if team == A:
            index = 0
            while time.time() < t0 + duration:
                pending = [f for f in futures if not f.wrapped_future.done()]
                while len(pending) < OUTSTANDING_A:
                    submitted[index] = time.time()
                    pending.append(work.submit(index, task_seconds))
                    futures.append(pending[-1])
                    index += 1
                concurrent.futures.wait(
                    [f.wrapped_future for f in pending],
                    timeout=max(0.05, t0 + duration - time.time()),
                    return_when=concurrent.futures.FIRST_COMPLETED,
                )
        else:
            for burst, at in enumerate(bursts):
                time.sleep(max(0.0, t0 + at - time.time()))
                for k in range(burst_tasks):
                    index = burst * burst_tasks + k
                    submitted[index] = time.time()
                    futures.append(work.submit(index, task_seconds))
                for f in futures:
                    f.result()
        for f in futures:  # team A: what it started before the deadline runs to its end
            f.result()
        return len(futures)

    done = team_flow()
    return {"team": team, "tasks": done, "submitted": {str(k): v for k, v in submitted.items()}}


# ---------------------------------------------------------------- the figures (pure, tested alone)
def attempts(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each attempt at a task body: team, task, devices, start, end (its last sign of life) and
    whether it ended (an attempt that did not was cut short: preempted, its work lost)."""
    out: dict[tuple[str, int, int], dict[str, Any]] = {}
    for ev in sorted(lines, key=lambda e: e["t"]):
        key = (ev["team"], ev["task"], ev["pid"])
        if ev["kind"] == "start" or key not in out:
            if key in out and not out[key]["ended"]:
                out[(*key[:2], -len(out))] = out.pop(key)  # an earlier attempt in the same process
            out[key] = {
                "team": ev["team"],
                "task": ev["task"],
                "devices": ev["devices"],
                "start": ev["t"],
                "end": ev["t"],
                "ended": False,
            }
        out[key]["end"] = max(out[key]["end"], ev["t"])
        if ev["kind"] == "end":
            out[key]["ended"] = True
    return sorted(out.values(), key=lambda a: a["start"])


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return round(values[0], 3)
    return round(statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1], 3)


def figures(
    lines: list[dict[str, Any]],
    submitted: dict[str, dict[str, float]],
    t0: float,
    t_end: float,
    devices: int,
    bursts: list[float],
    burst_tasks: int,
) -> dict[str, Any]:
    """One mode's figures from its events and the teams' submit times (seconds since the epoch)."""
    runs = attempts(lines)
    clip = [(max(a["start"], t0), min(a["end"], t_end), a) for a in runs]
    by_device: dict[str, list[tuple[float, float]]] = {}
    for s, e, a in clip:
        for d in a["devices"]:
            if e > s:
                by_device.setdefault(d, []).append((s, e))
    available = devices * (t_end - t0)
    busy = sum(union_seconds(iv) for iv in by_device.values())
    useful = sum(max(0.0, e - s) * len(a["devices"]) for s, e, a in clip if a["ended"])
    lost = [a["end"] - a["start"] for a in runs if not a["ended"]]
    teams: dict[str, Any] = {}
    for team in (A, B):
        waits = []
        for a in runs:
            if a["team"] == team and a["ended"] and str(a["task"]) in submitted.get(team, {}):
                waits.append(a["start"] - submitted[team][str(a["task"])])
        done = [a for a in runs if a["team"] == team and a["ended"]]
        teams[team] = {
            "tasks_done": len(done),
            "device_s": round(sum(a["end"] - a["start"] for a in done), 1),
            "wait_p50_s": _pct(waits, 50),
            "wait_p95_s": _pct(waits, 95),
            "preempted": sum(1 for a in runs if a["team"] == team and not a["ended"]),
        }
    to_running = []
    for burst in range(len(bursts)):
        ids = [str(burst * burst_tasks + k) for k in range(burst_tasks)]
        subs = [submitted.get(B, {})[i] for i in ids if i in submitted.get(B, {})]
        starts = [a["start"] for a in runs if a["team"] == B and str(a["task"]) in ids]
        if subs and starts:
            to_running.append(round(min(starts) - min(subs), 3))
    return {
        "window_s": round(t_end - t0, 1),
        "available_device_s": round(available, 1),
        "busy_device_s": round(busy, 1),
        "useful_device_s": round(useful, 1),
        "busy_share": round(busy / available, 3) if available else None,
        "useful_share": round(useful / available, 3) if available else None,
        "lost_device_s": round(sum(lost), 1),
        "attempts_cut_short": len(lost),
        "teams": teams,
        "b_arrival_to_running_s": to_running,
    }


# ---------------------------------------------------------------- the parent
def _child_env(api_url: str, lease_dir: Path, grace: float) -> dict[str, str]:
    env = {
        **os.environ,
        "PREFECT_API_URL": api_url,
        "GPU_TASKS_LEASE_DIR": str(lease_dir),
        "GPU_TASKS_EMULATED_GPUS": EMULATED,
        "GPU_TASKS_TUNE_PREEMPTION_GRACE": str(grace),
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    for name in ("GPU_TASKS_DISCOVERY_COMMAND", "GPU_TASKS_PROFILES_FILE", "GPU_TASKS_PREEMPTION_GRACE"):
        env.pop(name, None)
    return env


def _configure(mode: str) -> None:
    """Both teams' quotas (1 device each) and, in ``mode``, their borrowing limits."""
    from gpu_tasks.prefect_api import quotas

    for team, borrow in _quota_settings(mode).items():
        quotas.set_limit(team, 1)
        quotas.set_sharing(team, borrowing_limit=borrow)


def run_mode(mode: str, api_url: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """One mode: both teams' flow-run processes at once; their events turned into figures."""
    _configure(mode)
    lease_dir, events = tmp / f"leases-{mode}", tmp / f"events-{mode}.jsonl"
    env = _child_env(api_url, lease_dir, args.grace)
    t0 = time.time() + args.start_slack
    procs = []
    for team in (A, B):
        out, log = tmp / f"{mode}-{team}.json", tmp / f"{mode}-{team}.log"
        cmd = [
            sys.executable,
            "-m",
            "bench.sharing",
            "--child",
            team,
            "--events",
            str(events),
            "--t0",
            str(t0),
            "--duration",
            str(args.duration),
            "--task-seconds",
            str(args.task_seconds),
            "--burst-tasks",
            str(args.burst_tasks),
            "--bursts",
            *map(str, args.bursts),
            "--json",
            str(out),
        ]
        with log.open("wb") as sink:
            procs.append(
                (
                    team,
                    subprocess.Popen(
                        cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
                    ),
                    out,
                    log,
                )
            )
    submitted: dict[str, dict[str, float]] = {}
    failed = []
    try:
        for team, proc, out, log in procs:
            try:
                rc = proc.wait(timeout=args.duration + 600)
            except subprocess.TimeoutExpired:
                rc = None
            if rc == 0 and out.exists():
                submitted[team] = json.loads(out.read_text())["submitted"]
            else:
                tail = log.read_text(errors="replace")[-3000:]
                failed.append(f"{team}: exit {rc}\n{tail}")
                print(f"  {mode}: {team}'s flow run FAILED (exit {rc}):\n{tail}", file=sys.stderr, flush=True)
    finally:
        for _, proc, _, _ in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    lines = [json.loads(x) for x in events.read_text().splitlines()] if events.exists() else []
    t_end = max([t0 + args.duration, *(e["t"] for e in lines)])
    res = figures(lines, submitted, t0, t_end, int(EMULATED), args.bursts, args.burst_tasks)
    res.update(mode=mode, failed_flow_runs=failed, borrowing_limits=_quota_settings(mode))
    return res


def run(args: argparse.Namespace) -> dict[str, Any]:
    from gpu_tasks.prefect_api import quotas
    from gpu_tasks.prefect_api.server import embedded_server

    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu-tasks-sharing-") as tmp, embedded_server() as url:
        os.environ["PREFECT_API_URL"] = url
        try:
            for mode in args.modes:
                print(f"  {mode}: two teams, {args.duration:g} s ...", flush=True)
                rows.append(run_mode(mode, url, args, Path(tmp)))
                print_row(rows[-1])
        finally:
            for team in (A, B):
                with contextlib.suppress(Exception):
                    quotas.delete_limit(team)
    return {
        "duration_s": args.duration,
        "task_seconds": args.task_seconds,
        "bursts_s": args.bursts,
        "burst_tasks": args.burst_tasks,
        "grace_s": args.grace,
        "emulated_gpus": EMULATED,
        "machine": machine(),
        "modes": rows,
    }


def print_row(r: dict[str, Any]) -> None:
    a, b = r["teams"][A], r["teams"][B]
    print(
        f"  {r['mode']:>9}: busy {r['busy_share']:.0%} useful {r['useful_share']:.0%} of "
        f"{r['available_device_s']:g} device-s; lost {r['lost_device_s']:g} s "
        f"({r['attempts_cut_short']} cut); "
        f"A {a['tasks_done']} tasks, wait p50/p95 {a['wait_p50_s']}/{a['wait_p95_s']} s; "
        f"B {b['tasks_done']} tasks, wait p50/p95 {b['wait_p50_s']}/{b['wait_p95_s']} s; "
        f"B arrival to running {r['b_arrival_to_running_s']} s",
        flush=True,
    )


def report(res: dict[str, Any], img: Path) -> list[str]:
    """The section of docs/benchmarks.md (bench/report.py's SECTIONS)."""
    rows = {r["mode"]: r for r in res["modes"]}
    lines = [
        "## Two teams sharing two devices: strict quotas against borrowing and reclaim",
        "",
        f"Two emulated devices, two teams with a quota of 1 device each, one flow-run process each, "
        f"started together. Team A is busy all the time (a `preemptible` profile, up to 2 workers, three "
        f"{res['task_seconds']:g} s tasks outstanding for {res['duration_s']:g} s); team B arrives in "
        f"bursts of {res['burst_tasks']} such tasks at {', '.join(f'{b:g}' for b in res['bursts_s'])} s "
        f"(not preemptible, idle timeout 2 s). `strict`: quotas as caps (today without limits); "
        f"`borrowing`: A may borrow 1 device (`--borrowing-limit 1`), reclaimed for B after the "
        f"{res['grace_s']:g} s grace, fair share on. Waits: a task's submit to the start of its attempt "
        "that ended; work lost: attempts cut short by a reclaim, start to last sign of life "
        "(bench/sharing.py).",
        "",
        "| mode | device-s busy / available | useful | lost to preemption | A tasks done "
        "| A wait p50 / p95 s | B tasks done | B wait p50 / p95 s | B's arrival to running, per burst s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for mode, r in rows.items():
        a, b = r["teams"][A], r["teams"][B]
        to_running = ", ".join(f"{x:g}" for x in r["b_arrival_to_running_s"])
        lines.append(
            f"| {mode} | {r['busy_device_s']:g} / {r['available_device_s']:g} ({r['busy_share']:.0%}) | "
            f"{r['useful_share']:.0%} | {r['lost_device_s']:g} s ({r['attempts_cut_short']} attempt(s)) | "
            f"{a['tasks_done']} | {a['wait_p50_s']} / {a['wait_p95_s']} | {b['tasks_done']} | "
            f"{b['wait_p50_s']} / {b['wait_p95_s']} | {to_running} |"
        )
    if {"strict", "borrowing"} <= rows.keys():
        s_, b_ = rows["strict"], rows["borrowing"]
        lines += [
            "",
            f"Borrowing used {b_['useful_share']:.0%} of the device time against {s_['useful_share']:.0%} "
            f"under strict quotas ({b_['teams'][A]['tasks_done']} against {s_['teams'][A]['tasks_done']} of "
            f"A's tasks done), at {b_['lost_device_s']:g} device-s of A's work lost to reclaims; B's first "
            "burst includes its flow run's cluster start in both modes, a later burst waits the grace for a "
            "reclaimed device.",
        ]
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds team A stays busy")
    parser.add_argument("--task-seconds", type=float, default=4.0)
    parser.add_argument("--bursts", type=float, nargs="+", default=[10.0, 35.0], help="seconds of B's bursts")
    parser.add_argument("--burst-tasks", type=int, default=2)
    parser.add_argument("--grace", type=float, default=2.0, help="GPU_TASKS_TUNE_PREEMPTION_GRACE")
    parser.add_argument("--start-slack", type=float, default=12.0, help="seconds for the flow runs to start")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", choices=(A, B), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--events", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--t0", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        out = run_child(
            args.child, args.events, args.t0, args.duration, args.task_seconds, args.bursts, args.burst_tasks
        )
        write_json(args.json, out)
        return
    from bench.common import setup

    setup()
    res = run(args)
    write_json(args.json, res)


if __name__ == "__main__":
    main()
