"""Per-task overhead on both ends of the supported Prefect range, side by side in one run.

    python -m bench.prefect_versions [--n 100 1000] [--repeats 3] [--out docs]

Runs bench.overhead's ThreadPoolTaskRunner and ``gpus=0.25`` ProfileTaskRunner rows in ``.venv``
(the lowest end: Prefect 3.8.8, made by ./scripts/setup) and then in ``.venv-compat`` (the newest
end: made by ./scripts/test-compat), one after the other, each in a fresh process with its own
temporary ``PREFECT_HOME`` and its own Prefect server of the same version (a database a newer
Prefect migrated cannot be opened by an older one). Writes ``docs/results/prefect_versions.json``,
adds it to ``docs/results/benchmarks.json`` and re-renders docs/benchmarks.md, whose section
"Per-task overhead by Prefect version" it fills (bench/report.py).
"""

from __future__ import annotations

import argparse
import json
import os
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
    med = {
        n: {label: sorted(v)[len(v) // 2] for label, v in by_label.items()}
        for n, by_label in res["ms_per_task"].items()
    }
    res["vs_threads"] = {n: m[overhead.PROFILE_GPU] / m[overhead.THREADS] for n, m in med.items()}
    write_json(out, res)


def run_env(label: str, venv: str, sizes: list[int], repeats: int, workdir: Path) -> dict[str, Any]:
    python = ROOT / venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"bench.prefect_versions: {venv} is missing; {MADE_BY[venv]} makes it")
    out = workdir / f"{label}.json"
    home = workdir / f"prefect-home-{label}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_URL", "VIRTUAL_ENV"))}
    env.update(PREFECT_HOME=str(home), PREFECT_CLIENT_MAX_RETRIES="10", PYTHONPATH=str(ROOT))
    cmd = [str(python), "-m", "bench.prefect_versions", "--child", "--n", *map(str, sizes)]
    cmd += ["--repeats", str(repeats), "--json", str(out)]
    print(f"== {label} end: {venv}", flush=True)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"bench.prefect_versions: the {label} end failed (exit {proc.returncode})")
    res: dict[str, Any] = json.loads(out.read_text())
    res["venv"] = venv
    res["seconds"] = round(time.monotonic() - t0, 1)
    print(f"   Prefect {res['versions']['prefect']}: {res['seconds']:.0f}s", flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.prefect_versions", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--n", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="where benchmarks.md and results/ go")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_main(args.n, args.repeats, args.json)
        return 0
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-tasks-bench-versions-") as tmp:
        by_end = {
            label: run_env(label, venv, args.n, args.repeats, Path(tmp)) for label, venv in ENVS.items()
        }
    result = {
        "sizes": args.n,
        "repeats": args.repeats,
        "order": list(ENVS),
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
