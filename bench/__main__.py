"""Run the benchmark suite and write docs/benchmarks.md, PNG plots and raw JSON.

    python -m bench [--quick] [--only overhead held_busy ...] [--gpu] [--out docs]
    python -m bench --report-only      # re-render the docs from docs/results/benchmarks.json
    python -m bench --only faults      # the fault scenarios: docs/reliability.md (bench/faults.py)
    python -m bench --merge scale_100k out.json   # one benchmark run on its own (its --json), into the report

Every benchmark runs in a fresh process against one Prefect server on 127.0.0.1
(a temporary PREFECT_HOME, so nothing is written to the user's Prefect database).
Without a GPU, two devices are emulated, and the report says so on every page.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, child, machine, setup
from bench.common import commit as _commit

SUITE = (
    "overhead",
    "held_busy",
    "held_busy_long",
    "cold_start",
    "waits",
    "scale",
    "scale_100k",
    "scale_loaded",
    "scale_production_quiet",
    "scale_production",
    "many_flows",
    "many_flows_production",
    "throughput",
    "sharing",
)
APART = ("faults",)  # asked for by name only; runs as a process of its own and writes its own page
MODULE = {
    "held_busy_long": "held_busy",
    "scale_100k": "scale",
    "scale_loaded": "scale",
    "scale_production": "scale",
    "scale_production_quiet": "scale",
    "many_flows_production": "many_flows",
}  # result key -> bench module, where they differ

FULL = {
    "overhead": ["--n", "100", "1000", "--repeats", "3"],
    "held_busy": ["--repeats", "3", "--stage-seconds", "1.0", "--idle-timeout", "1.0"],
    "held_busy_long": ["--repeats", "1", "--stage-seconds", "5.0", "--idle-timeout", "1.0"],
    "cold_start": ["--repeats", "5"],
    "waits": ["--repeats", "3"],
    "scale": ["--n", "1000", "10000", "--repeats", "1"],
    "scale_100k": ["--n", "1000", "10000", "100000", "--no-reference"],
    "scale_loaded": ["--n", "1000", "10000", "100000", "--no-reference", "--load", "2"],
    # PostgreSQL and Redis (as root: infra/postgres/up.sh, infra/redis/up.sh)
    "scale_production_quiet": ["--n", "1000", "10000", "100000", "--no-reference", "--server", "production"],
    "scale_production": "--n 1000 10000 100000 --no-reference --load 2 --server production".split(),
    "many_flows": ["--flows", "10", "--tasks", "1000"],
    "many_flows_production": ["--flows", "10", "--tasks", "1000", "--server", "production"],
    "throughput": ["--scale", "1", "10", "--repeats", "1"],
    "sharing": ["--duration", "60"],
}
QUICK = {
    "overhead": ["--n", "20", "100", "--repeats", "1"],
    "held_busy": ["--repeats", "1", "--stage-seconds", "0.25", "--idle-timeout", "0.5"],
    "held_busy_long": ["--repeats", "1", "--stage-seconds", "0.5", "--idle-timeout", "0.5"],
    "cold_start": ["--repeats", "1"],
    "waits": ["--repeats", "1", "--seconds", "0.5"],
    "scale": ["--n", "60", "600", "--repeats", "1"],
    "scale_100k": ["--n", "60", "600", "--no-reference"],
    "scale_loaded": ["--n", "60", "600", "--no-reference", "--load", "2"],
    "scale_production_quiet": ["--n", "60", "600", "--no-reference", "--server", "production"],
    "scale_production": ["--n", "60", "600", "--no-reference", "--load", "2", "--server", "production"],
    "many_flows": ["--flows", "2", "--tasks", "20"],
    "many_flows_production": ["--flows", "2", "--tasks", "20", "--server", "production"],
    "throughput": ["--scale", "1", "--repeats", "1", "--rounds", "10"],
    "sharing": ["--duration", "15", "--bursts", "4", "--burst-tasks", "1", "--task-seconds", "2"],
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="small sizes, one repeat (minutes, not a report to quote)"
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=SUITE + APART,
        default=list(SUITE),
        help="run only these ('faults': the fault scenarios, docs/reliability.md)",
    )
    parser.add_argument(
        "--gpu", action="store_true", help="throughput adds runs on real GPUs (refuses emulated devices)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="where benchmarks.md and results/ go")
    parser.add_argument(
        "--report-only", action="store_true", help="re-render the report from results/benchmarks.json"
    )
    parser.add_argument(
        "--merge",
        nargs=2,
        metavar=("NAME", "JSON"),
        help="put one benchmark's results, run on its own with --json, into the report as NAME",
    )
    parser.add_argument(
        "--commit", help="with --merge: the commit that benchmark measured (default: the one checked out)"
    )
    args = parser.parse_args(argv)
    results_dir = args.out / "results"
    combined = results_dir / "benchmarks.json"
    from bench import report

    if args.merge:
        name, path = args.merge
        if name not in SUITE:
            parser.error(f"--merge: {name!r} is not a benchmark of the suite ({', '.join(SUITE)})")
        results = json.loads(combined.read_text()) if combined.exists() else {}
        results[name] = json.loads(Path(path).read_text())
        finished = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(Path(path).stat().st_mtime))
        results[name].update(quick=False, finished=finished, commit=args.commit or _commit())
        (results_dir / f"{name}.json").write_text(json.dumps(results[name], indent=2, default=str))
        combined.write_text(json.dumps(results, indent=2, default=str))
        args.report_only = True
    if args.report_only:
        report.write(json.loads(combined.read_text()), args.out)
        print(f"wrote {args.out / 'benchmarks.md'}")
        return 0
    faults_rc = 0
    if "faults" in args.only:  # its own server, its own page: bench/faults.py, not a timed benchmark
        import subprocess

        cmd = [sys.executable, "-m", "bench.faults", "--out", str(args.out)] + (
            ["--quick"] if args.quick else []
        )
        faults_rc = subprocess.run(cmd, cwd=ROOT).returncode
        args.only = [name for name in args.only if name != "faults"]
        if not args.only:
            return faults_rc
    if args.gpu:
        from bench.throughput import require_real_gpus

        require_real_gpus()
    os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="gpu-tasks-bench-prefect-"))
    # embedded_server() gives its SQLite server a 60 s statement timeout and this process's
    # clients 10 retries; the benchmark processes reach it by PREFECT_API_URL, so they are
    # given the same client retries here (10,000 tasks keep the server's writer busy).
    os.environ.setdefault("PREFECT_CLIENT_MAX_RETRIES", "10")
    setup()  # emulation (announced) before anything reads the devices
    from gpu_tasks.prefect_api.server import embedded_server

    plan = QUICK if args.quick else FULL
    results: dict[str, Any] = json.loads(combined.read_text()) if combined.exists() else {}
    results_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    failed: list[str] = []
    with embedded_server() as url:
        for name in args.only:
            print(f"== {name} ({' '.join(plan[name])})", flush=True)
            extra = ["--gpu"] if (name == "throughput" and args.gpu) else []
            try:
                results[name] = child(
                    MODULE.get(name, name),
                    plan[name] + extra,
                    results_dir / f"{name}.json",
                    env={"PREFECT_API_URL": url},
                )
            except Exception as exc:  # one failed benchmark is reported, and the others still run
                print(f"   {name} FAILED: {exc}", file=sys.stderr, flush=True)
                results[name] = {"failed": str(exc)}
                failed.append(name)
            results[name]["quick"] = args.quick
            results[name]["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            results[name]["commit"] = _commit()
            combined.write_text(json.dumps(results, indent=2, default=str))  # progress survives a crash
    results["suite"] = {
        "machine": machine(),
        "quick": args.quick,
        "seconds": round(time.monotonic() - t0, 1),
        "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    combined.write_text(json.dumps(results, indent=2, default=str))
    report.write(results, args.out)
    print(f"wrote {args.out / 'benchmarks.md'} and {results_dir} in {results['suite']['seconds']:.0f}s")
    return 1 if failed or faults_rc else 0


if __name__ == "__main__":
    sys.exit(main())
