"""What every benchmark shares: the machine's description, spread statistics,
timed child processes, and the emulation announcement."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def machine() -> dict[str, Any]:
    """The machine the numbers come from, and whether its devices are real or emulated."""
    import psutil

    from gpu_tasks.devices.discovery import discover

    inventory = discover()
    return {
        "arch": platform.machine(),
        "cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "device_source": inventory.source,
        "devices": [d.name for d in inventory.devices],
        "emulated": bool(inventory.emulated),
        "gpu": bool(inventory.devices) and not inventory.emulated,
    }


def describe(m: dict[str, Any]) -> str:
    """``x86_64, 2 cores, 24 GiB, Python 3.11.7, 2 EMULATED devices``."""
    if m["gpu"]:
        devices = f"{len(m['devices'])} GPU(s): {', '.join(m['devices'])}"
    elif m["emulated"]:
        devices = f"{len(m['devices'])} EMULATED devices (no GPU: compute on the CPU)"
    else:
        devices = "no GPU"
    return f"{m['arch']}, {m['cpus']} cores, {m['memory_gib']:g} GiB, Python {m['python']}, {devices}"


def spread(values: list[float]) -> dict[str, float]:
    """min / median / max of repeated measurements."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def child(
    module: str, args: list[str], out: Path, env: dict[str, str] | None = None, timeout: float = 1800
) -> dict[str, Any]:
    """Run ``python -m bench.<module> ... --json out`` in a fresh process; returns its JSON.

    A fresh process per benchmark keeps them apart: no clusters, threads or memory
    of one benchmark are left for the next, and peak memory is the child's own.
    """
    cmd = [sys.executable, "-m", f"bench.{module}", *args, "--json", str(out)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark {module} failed (exit {proc.returncode}): {' '.join(cmd)}")
    data = json.loads(out.read_text())
    data["bench_seconds"] = round(time.monotonic() - t0, 1)
    return data


def ray_missing() -> str | None:
    """Why the benchmarks' Ray case cannot run here (a line to print and report), or None.

    Ray and prefect-ray come from the ``bench`` extra, which the tests never install:
    without them every benchmark runs its other cases and reports the Ray case skipped.
    """
    import importlib.util

    # found, not imported: Ray reads its settings (bench/ray_peer.py sets them) at its first import
    for module, dist in (("ray", "ray"), ("prefect_ray", "prefect-ray")):
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules
            found = False
        if not found:
            return f"skipped: {dist} not installed (the bench extra: ./scripts/bench installs it)"
    return None


RAY = "RayTaskRunner"  # the Ray case's name in every benchmark's results ("skipped", rows)


def ray_skipped() -> dict[str, str]:
    """``{RAY: reason}``, printed, when the Ray case cannot run here; ``{}`` when it can."""
    reason = ray_missing()
    if reason is None:
        return {}
    print(f"  {RAY}: {reason}", flush=True)
    return {RAY: reason}


def write_json(path: str | Path | None, data: dict[str, Any]) -> None:
    """Write results (a benchmark module's ``--json``)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{path}.tmp")
        tmp.write_text(json.dumps(data, indent=2, default=str))
        tmp.replace(path)


@contextlib.contextmanager
def cpu_hogs(n: int) -> Iterator[None]:
    """``n`` processes spinning on a core each for the block: a machine busy with other work."""
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
        for _ in range(n)
    ]
    try:
        yield
    finally:
        for h in hogs:
            h.kill()
        for h in hogs:
            h.wait()


def setup() -> None:
    """Quiet logs (benchmarks print their own lines; INFO chatter only costs time) and
    emulate two devices, announced, when there is no GPU and no emulation is set."""
    import logging

    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from gpu_tasks.devices.emulation import ensure_devices

    ensure_devices(announce=lambda m: print(m, file=sys.stderr, flush=True))
    import distributed  # noqa: F401  (configures its loggers on import; quieten them after)

    for name in ("distributed", "prefect", "gpu_tasks"):
        logging.getLogger(name).setLevel(logging.WARNING)


def commit() -> str:
    """The code measured: ``git describe``-style short hash, ``+changes`` when the tree is dirty."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", "gpu_tasks", "bench"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+changes" if dirty else "")
