"""Per-task overhead on both ends of the supported Prefect range, side by side in one run.

    python -m bench.prefect_versions [--n 100 1000] [--repeats 3] [--rounds 1] [--out docs]

Runs bench.overhead's ThreadPoolTaskRunner and ``gpus=0.25`` ProfileTaskRunner rows in ``.venv``
(the lowest end: Prefect 3.8.8, made by ./scripts/setup) and then in ``.venv-compat`` (the newest
end: made by ./scripts/test-compat), one after the other, each in a fresh process with its own
temporary ``PREFECT_HOME`` and its own Prefect server of the same version (a database a newer
Prefect migrated cannot be opened by an older one). ``--rounds 2`` runs them lowest, newest, newest,
lowest and pools each end's repeats, so that a machine that gets busier or quieter during the run
does not favour the end that ran first. Writes ``docs/results/prefect_versions.json``,
adds it to ``docs/results/benchmarks.json`` and re-renders docs/benchmarks.md, whose section
"Per-task overhead by Prefect version" it fills (bench/report.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, commit, setup, write_json

ENVS = {  # label -> virtual environment, lowest end first
    "lowest": ".venv",
    "newest": ".venv-compat",
}
MADE_BY = {".venv": "./scripts/setup", ".venv-compat": "./scripts/test-compat"}


def versions() -> dict[str, str]:
    """The versions this interpreter runs (the child's own)."""
    from importlib.metadata import version

    return {
        name: version(name)
        for name in ("prefect", "dask", "distributed", "fastapi", "pydantic", "cloudpickle")
    }


def child_main(sizes: list[int], repeats: int, out: str) -> None:
    """In one environment: the two overhead rows, with the versions they ran on."""
    from bench import overhead

    setup()
    res = overhead.run(sizes, repeats, only=(overhead.THREADS, overhead.PROFILE_GPU), n_gpu=2)
    res["versions"] = versions()
    res["python"] = sys.executable
    write_json(out, res)


def run_env(label: str, venv: str, sizes: list[int], repeats: int, workdir: Path, rnd: int) -> dict[str, Any]:
    """One end's two rows in a fresh process of that environment's interpreter."""
    python = ROOT / venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"bench.prefect_versions: {venv} is missing; {MADE_BY[venv]} makes it")
    out = workdir / f"{label}-{rnd}.json"
    home = workdir / f"prefect-home-{label}-{rnd}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_URL", "VIRTUAL_ENV"))}
    env.update(PREFECT_HOME=str(home), PREFECT_CLIENT_MAX_RETRIES="10", PYTHONPATH=str(ROOT))
    cmd = [str(python), "-m", "bench.prefect_versions", "--child", "--n", *map(str, sizes)]
    cmd += ["--repeats", str(repeats), "--json", str(out)]
    print(f"== {label} end: {venv} (round {rnd + 1})", flush=True)
    t0 = time.monotonic()
    load_before = os.getloadavg()[0]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"bench.prefect_versions: the {label} end failed (exit {proc.returncode})")
    res: dict[str, Any] = json.loads(out.read_text())
    res.update(label=label, venv=venv, seconds=round(time.monotonic() - t0, 1))
    res["load_average"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]  # 1-minute, before/after
    print(f"   Prefect {res['versions']['prefect']}: {res['seconds']:.0f}s", flush=True)
    return res


def pool(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One end's runs (rounds) as one: every repeat's figure, the thread-pool ratio of the medians."""
    first = runs[0]
    ms: dict[str, dict[str, list[float]]] = {}
    for r in runs:
        for n, by_label in r["ms_per_task"].items():
            for label, values in by_label.items():
                ms.setdefault(n, {}).setdefault(label, []).extend(values)
    from bench.overhead import PROFILE_GPU, THREADS

    return {
        "venv": first["venv"],
        "versions": first["versions"],
        "python": first["python"],
        "machine": first["machine"],
        "ms_per_task": ms,
        "vs_threads": {
            n: statistics.median(m[PROFILE_GPU]) / statistics.median(m[THREADS]) for n, m in ms.items()
        },
        "seconds": round(sum(r["seconds"] for r in runs), 1),
        "load_average": [r["load_average"] for r in runs],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.prefect_versions", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--n", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1, help="2: lowest, newest, newest, lowest (pooled)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="where benchmarks.md and results/ go")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_main(args.n, args.repeats, args.json)
        return 0
    t0 = time.monotonic()
    runs = []
    with tempfile.TemporaryDirectory(prefix="gpu-tasks-bench-versions-") as tmp:
        for rnd in range(args.rounds):
            for label in list(ENVS) if rnd % 2 == 0 else list(reversed(ENVS)):
                runs.append(run_env(label, ENVS[label], args.n, args.repeats, Path(tmp), rnd))
    by_end = {label: pool([r for r in runs if r["label"] == label]) for label in ENVS}
    result = {
        "sizes": args.n,
        "repeats": args.repeats,
        "rounds": args.rounds,
        "order": list(ENVS),  # the report's columns
        "sequence": [r["label"] for r in runs],  # the order they ran in
        "ends": by_end,
        "machine": by_end["lowest"]["machine"],
        "seconds": round(time.monotonic() - t0, 1),
        "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit(),
    }
    results_dir = args.out / "results"
    write_json(results_dir / "prefect_versions.json", result)
    combined = results_dir / "benchmarks.json"
    everything = json.loads(combined.read_text()) if combined.exists() else {}
    everything["prefect_versions"] = result
    write_json(combined, everything)
    from bench import report

    report.write(everything, args.out)
    md = args.out / "benchmarks.md"
    print(f"wrote {results_dir / 'prefect_versions.json'} and {md} in {result['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
