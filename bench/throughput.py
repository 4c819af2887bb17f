"""Pipeline throughput: the ETL -> train pipeline at scale 1 and 10, rows per second per stage.

    python -m bench.throughput [--scale 1 10] [--rounds 60] [--gpu] [--json out.json]

Each run is ``gpu-tasks example run --scale K --json`` in a fresh process. Without
``--gpu`` it runs on emulated devices (pandas backend, XGBoost on the CPU), also on
a GPU host, so it is the CPU baseline. ``--gpu`` adds the same runs on the host's
real GPUs (cuDF backend, XGBoost on CUDA) and refuses to run when the devices are
emulated or absent: emulated numbers are never GPU numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import machine, setup, spread, write_json


class NoGpuError(SystemExit):
    """``--gpu`` on a machine without real GPUs."""


def require_real_gpus() -> None:
    """Refuse ``--gpu`` unless NVML (or a discovery command) reports real devices."""
    from gpu_tasks.devices.discovery import discover
    from gpu_tasks.settings import GpuTasksSettings

    if os.environ.get("GPU_TASKS_EMULATED_GPUS"):
        raise NoGpuError("--gpu measures real GPUs, but GPU_TASKS_EMULATED_GPUS is set: unset it")
    inventory = discover(GpuTasksSettings(emulated_gpus=None))
    if inventory.emulated or not inventory.devices:
        raise NoGpuError(
            f"--gpu needs real NVIDIA GPUs; found none ({inventory.detail}). "
            "Run without --gpu for the CPU (pandas) baseline"
        )


def run_pipeline(scale: int, rounds: int, emulated: bool) -> dict[str, Any]:
    """One ``gpu-tasks example run`` in a fresh process; returns its summary plus rows per second."""
    env = dict(os.environ)
    if emulated:
        env.setdefault("GPU_TASKS_EMULATED_GPUS", "2")
    else:
        env.pop("GPU_TASKS_EMULATED_GPUS", None)
    cli = Path(sys.executable).with_name("gpu-tasks")
    with tempfile.TemporaryDirectory(prefix="gpu-tasks-bench-") as tmp:
        proc = subprocess.run(
            [
                str(cli),
                "example",
                "run",
                "--scale",
                str(scale),
                "--rounds",
                str(rounds),
                "--data-dir",
                tmp,
                "--json",
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=3600,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"gpu-tasks example run --scale {scale} failed: {proc.stderr[-2000:]}")
    out = json.loads(proc.stdout)
    flights = out["rows"]["raw"]["flights"] if isinstance(out["rows"]["raw"], dict) else out["rows"]["raw"]
    etl, train = out["stages"]["etl"], out["stages"]["train"]
    return {
        "scale": scale,
        "rounds": rounds,
        "flights": flights,
        "train_rows": out["rows"]["train"],
        "flow_s": out["seconds"],
        "ingest_s": out["stages"]["ingest"]["seconds"],
        "etl_s": etl["seconds"],
        "train_s": train["seconds"],
        "etl_rows_per_s": flights / etl["seconds"],
        "train_rows_per_s": out["rows"]["train"] / train["seconds"],
        "backend": etl["backend"],
        "device": train["device"],
        "emulated": bool(etl["emulated"]),
        "auc": out["metrics"]["auc"],
    }


def run(scales: list[int], rounds: int, repeats: int, gpu: bool) -> dict[str, Any]:
    modes = [("pandas / XGBoost CPU (emulated devices)", True)]
    if gpu:
        modes.append(("cuDF / XGBoost CUDA (real GPU)", False))
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for label, emulated in modes:
        for scale in scales:
            for _ in range(repeats):
                r = run_pipeline(scale, rounds, emulated)
                if not emulated and r["emulated"]:
                    raise RuntimeError("a --gpu run ran on emulated devices")
                rows.setdefault(label, {}).setdefault(str(scale), []).append(r)
                print(
                    f"  {label}: scale {scale}: ETL {r['etl_rows_per_s']:,.0f} rows/s ({r['etl_s']:.1f}s), "
                    f"train {r['train_rows_per_s']:,.0f} rows/s ({r['train_s']:.1f}s), flow "
                    f"{r['flow_s']:.1f}s",
                    flush=True,
                )
    summary = {
        label: {
            s: {
                k: spread([r[k] for r in v])
                for k in ("etl_rows_per_s", "train_rows_per_s", "etl_s", "train_s", "flow_s", "ingest_s")
            }
            for s, v in by_scale.items()
        }
        for label, by_scale in rows.items()
    }
    return {
        "scales": scales,
        "rounds": rounds,
        "repeats": repeats,
        "gpu": gpu,
        "machine": machine(),
        "runs": rows,
        "summary": summary,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, nargs="+", default=[1, 10])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--gpu", action="store_true", help="add runs on real GPUs (refuses emulated devices)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.gpu:
        require_real_gpus()
    setup()
    write_json(args.json, run(args.scale, args.rounds, args.repeats, args.gpu))


if __name__ == "__main__":
    main()
