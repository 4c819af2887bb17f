"""Scale: N mapped tasks spread over three profiles; wall time and the flow's peak memory.

    python -m bench.scale [--n 1000 10000] [--repeats 1] [--load 2] [--server production] [--json out.json]

Each size runs in a fresh process (its peak resident memory is the flow process's
own: worker processes and the Prefect server are not counted). The tasks are
trivial and split evenly over a CPU profile (8 threads), a second CPU profile
(4 threads) and a ``gpus=0.25`` profile on two emulated devices (worker
processes, four tasks per device at a time); all are submitted before any result
is awaited. Near-linear means at most 11x the time for 10x the tasks. ``--load K`` runs K
processes spinning on a core each beside every size (a machine busy with other work).

The same flow on Prefect's ThreadPoolTaskRunner, with Prefect as shipped, runs
beside it as the reference: every task run carries tags, and what the Prefect
server and task engine cost for tagged tasks shows there too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, cpu_hogs, machine, setup, spread, write_json
from bench.production import SERVERS, server, stored_events

PROFILES = ("cpu", "io", "quarter")
STORED_AT_MOST_S = 1800.0  # how long the stored events are counted after the flow, while they move


def run_one(n: int, reference: bool = False) -> dict[str, Any]:
    """One flow of ``n`` tasks in this process; returns wall time and memory.

    ``reference``: the same flow, the same tagged tasks, on Prefect's own
    ThreadPoolTaskRunner (16 threads, about the slots of the three profiles) and
    Prefect's settings as shipped: what the Prefect server and task engine cost alone.
    """
    from prefect import flow, task
    from prefect.task_runners import ThreadPoolTaskRunner

    from gpu_tasks import ProfileTaskRunner, ResourceProfile, profile
    from gpu_tasks.prefect_api.backlog import waited_seconds
    from gpu_tasks.prefect_api.server import embedded_server

    @task
    def inc(x: int) -> int:
        return x + 1

    profiles = [
        ResourceProfile(name="cpu", cpus=0.25),
        ResourceProfile(name="io", cpus=0.5),
        ResourceProfile(name="quarter", gpus=0.25, idle_timeout=600),
    ]
    per = [n // 3 + (1 if i < n % 3 else 0) for i in range(3)]

    runner = (
        ThreadPoolTaskRunner(max_workers=16)
        if reference
        else ProfileTaskRunner(profiles=profiles, default="cpu", idle_timeout=600)
    )

    @flow(task_runner=runner, name=f"scale-{n}")
    def f() -> dict[str, float]:
        tagged = {p: inc.with_options(tags=[profile(p)]) for p in PROFILES}
        for t in tagged.values():  # provisioning every worker is cold start, not scale
            [x.result() for x in t.map(range(-8, 0))]
        t0, began = time.perf_counter(), time.time()
        futures = [tagged[p].map(range(k)) for p, k in zip(PROFILES, per, strict=True)]
        submitted = time.perf_counter() - t0
        values = [x.result() for fl in futures for x in fl]
        wall = time.perf_counter() - t0
        expected = [i + 1 for k in per for i in range(k)]
        if values != expected:
            raise RuntimeError("wrong results")
        return {"wall_s": wall, "submit_s": submitted, "began": began}

    since = datetime.datetime.now(datetime.UTC).isoformat()
    with embedded_server() as url:
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out = f()
        # a script ends once its process has sent every event it queued (Prefect drains its
        # EventsWorker at exit): at 10,000 tasks thousands still wait here when the flow returns
        out["sent_s"] = _events_sent(out["began"])
        out["backlog_waited_s"] = waited_seconds()  # the flow's task runs waiting on that queue
        # what the UI can show: each task run's Completed event, stored by the server (the embedded
        # one's in-memory messaging drops events under load; the production set-up's Redis does not)
        expected = n + 8 * len(PROFILES)
        # while the count still moves, for up to 30 minutes: with CPU hogs beside it the server
        # needs longer than the flow to store 100,000 task runs (79,112 of them after 5 minutes)
        out["events_completed"] = stored_events(
            url, "prefect.task-run.Completed", since, expected, at_most_s=STORED_AT_MOST_S
        )
        out["events_expected"] = expected
        # from the first task's submission until the server had stored every task run's Completed
        # event (what the UI shows then is the whole run); None when some never were
        began = out.pop("began")
        out["recorded_s"] = time.time() - began if out["events_completed"] >= expected else None
    own = resource.getrusage(resource.RUSAGE_SELF)
    out.update(
        n=n,
        # this flow process's own CPU seconds (its workers' are in the parent's cpu_machine_s)
        cpu_flow_s=own.ru_utime + own.ru_stime,
        per_profile=dict(zip(PROFILES, per, strict=True)),
        peak_rss_mib=own.ru_maxrss / 1024,
        rss_before_mib=rss_before / 1024,
    )
    out["ms_per_task"] = out["wall_s"] * 1000 / n
    return out


def _events_sent(began: float, timeout_s: float = 900.0) -> float | None:
    """Seconds from ``began`` until this process's Prefect events were all sent, sending them as the
    interpreter's exit does (None: not within ``timeout_s``)."""
    from gpu_tasks.compat.prefect_server import drain_events

    return time.time() - began if drain_events(timeout_s) else None


def run(
    sizes: list[int],
    repeats: int,
    reference: bool = True,
    load: int = 0,
    server_kind: str = "embedded",
    reference_only: bool = False,
) -> dict[str, Any]:
    """Every size ``repeats`` times, each in a fresh process; with ``reference``, the same
    sizes on Prefect's ThreadPoolTaskRunner too (``out["reference"]``, same keys). The two
    alternate size by size, so both see the Prefect server's database grow alike. ``server_kind``:
    ``embedded`` (each run starts its SQLite server) or ``production`` (bench.production: one
    server on PostgreSQL and Redis for all the runs). ``reference_only``: ThreadPoolTaskRunner's
    rows alone (as the result's top level)."""
    with server(server_kind):
        out = _run(sizes, repeats, reference, load, reference_only) | {"server": server_kind}
    if server_kind == "production":  # Prefect's API and its services: one process or two
        out["server_processes"] = 1 if os.environ.get("GPU_TASKS_BENCH_SPLIT_SERVICES") == "0" else 2
    return out


def _run(
    sizes: list[int], repeats: int, reference: bool, load: int, reference_only: bool = False
) -> dict[str, Any]:
    import subprocess

    kinds = [True] if reference_only else [False, True] if reference else [False]
    rows: dict[bool, dict[str, list[dict[str, Any]]]] = {k: {} for k in kinds}
    for _ in range(repeats):
        for n in sizes:
            for ref in kinds:
                with tempfile.TemporaryDirectory() as tmp:
                    out = Path(tmp) / "one.json"
                    cmd = [
                        sys.executable,
                        "-m",
                        "bench.scale",
                        "--one",
                        str(n),
                        "--json",
                        str(out),
                        *(["--reference"] if ref else []),
                    ]
                    before, busy = _server_cpu(), _machine_busy()
                    with cpu_hogs(load):
                        subprocess.run(cmd, cwd=ROOT, check=True, timeout=3 * 3600)
                    row = json.loads(out.read_text())
                    after = _server_cpu()
                    row["cpu_server_s"] = {k: round(after[k] - before[k], 1) for k in after}
                    row["cpu_machine_s"] = round(_machine_busy() - busy, 1)  # hogs included
                rows[ref].setdefault(str(n), []).append(row)
                print(
                    f"  {_label(ref):20s} N={n:<6} wall {row['wall_s']:7.1f}s  {row['ms_per_task']:.2f} "
                    "ms/task  "
                    f"peak RSS {row['peak_rss_mib']:.0f} MiB  "
                    f"Completed events stored {row['events_completed']}/{row['events_expected']}  "
                    f"events sent at {_secs(row.get('sent_s'))}, recorded at {_secs(row.get('recorded_s'))}, "
                    f"backlog waits {row.get('backlog_waited_s', 0):.0f}s  "
                    f"CPU s: flow {row['cpu_flow_s']:.0f}, "
                    f"server {row['cpu_server_s']}, machine {row['cpu_machine_s']:.0f}",
                    flush=True,
                )
    if reference_only:
        return _summarize(rows[True], sizes, repeats, True) | {"load": load, "machine": machine()}
    result = _summarize(rows[False], sizes, repeats, False)
    if reference:
        result["reference"] = _summarize(rows[True], sizes, repeats, True)
    result["load"] = load  # CPU hogs beside each run
    result["machine"] = machine()
    return result


def _secs(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}s"


def _server_cpu() -> dict[str, float]:
    """CPU seconds so far of the Prefect server's processes (``api``; ``services``: the task-run
    recorder, event persister, triggers), PostgreSQL's and Redis's, their ended children
    included: where a flow's events and states are handled."""
    import psutil

    total = dict.fromkeys(("api", "services", "postgres", "redis"), 0.0)
    for proc in psutil.process_iter(["cmdline", "name", "cpu_times"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "prefect server services" in cmd:
            part = "services"
        elif "prefect server" in cmd:
            part = "api"
        elif proc.info["name"] in SERVER_NAMES:
            part = SERVER_NAMES[proc.info["name"]]
        else:
            continue
        t = proc.info["cpu_times"]
        if t is not None:
            total[part] += t.user + t.system + t.children_user + t.children_system
    return total


def _machine_busy() -> float:
    """CPU seconds this machine's cores were busy since boot (every process, kernel included)."""
    import psutil

    t = psutil.cpu_times()
    return float(t.user + t.nice + t.system + t.irq + t.softirq + t.steal)


SERVER_NAMES = {"postgres": "postgres", "redis-server": "redis"}


def _label(reference: bool) -> str:
    return "ThreadPoolTaskRunner" if reference else "ProfileTaskRunner"


def _summarize(
    rows: dict[str, list[dict[str, Any]]], sizes: list[int], repeats: int, reference: bool
) -> dict[str, Any]:
    summary = {
        n: {k: spread([r[k] for r in v]) for k in ("wall_s", "ms_per_task", "peak_rss_mib", "rss_before_mib")}
        for n, v in rows.items()
    }
    out: dict[str, Any] = {
        "runner": _label(reference),
        "sizes": sizes,
        "repeats": repeats,
        "runs": rows,
        "summary": summary,
    }
    if len(sizes) >= 2:
        small, large = str(min(sizes)), str(max(sizes))
        out["ratio"] = {
            "tasks": max(sizes) / min(sizes),
            "wall": summary[large]["wall_s"]["median"] / summary[small]["wall_s"]["median"],
            "peak_rss_growth": (
                summary[large]["peak_rss_mib"]["median"] - summary[large]["rss_before_mib"]["median"]
            )
            / max(
                1e-9, summary[small]["peak_rss_mib"]["median"] - summary[small]["rss_before_mib"]["median"]
            ),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--no-reference", action="store_true", help="skip the same sizes on Prefect's ThreadPoolTaskRunner"
    )
    parser.add_argument(
        "--reference-only", action="store_true", help="Prefect's ThreadPoolTaskRunner alone, the same sizes"
    )
    parser.add_argument("--load", type=int, default=0, help="processes spinning on a core beside each run")
    parser.add_argument(
        "--server",
        choices=SERVERS,
        default="embedded",
        help="embedded: each run's own SQLite server; production: PostgreSQL and Redis (as root)",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    setup()
    if args.one is not None:
        write_json(args.json, run_one(args.one, reference=args.reference))
    else:
        res = run(
            args.n,
            args.repeats,
            reference=not args.no_reference,
            load=args.load,
            server_kind=args.server,
            reference_only=args.reference_only,
        )
        write_json(args.json, res)


if __name__ == "__main__":
    main()
