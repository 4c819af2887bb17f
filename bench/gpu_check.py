"""The prepared real-GPU check: every check of :mod:`bench.gpu_cases`, then docs/gpu.md from its JSON.

    scripts/gpu-check                 # on the GPU machine: docs/results/gpu.json, docs/gpu.md
    scripts/gpu-check --dry-run       # here: the same sequence on emulated devices (stand-ins for CUDA)
    python -m bench.gpu_check --report-only   # re-render docs/gpu.md from docs/results/gpu.json

Each check runs in a process of its own, against one Prefect server on 127.0.0.1 (a temporary
PREFECT_HOME, or ``--prefect-home``), with its own time limit inside one budget (400 s by
default: a device call of 480 s leaves about a minute for installing the wheels and starting the
server), so a hang costs one check, not the run. The results are written after every check (and
copied to ``$OUT``), so a run the device tool stops still brings back what it finished.
``--only NAME ...`` re-runs some checks and keeps the others' results. What the run writes
besides its results (the Prefect home it made, lease and stand-in directories, each check's
scratch files: the checks' ``TMPDIR``) goes in one temporary directory, removed when it ends.
Without an NVIDIA GPU (and without ``--dry-run``) it stops with one line.
"""

from __future__ import annotations

import argparse
import datetime as dt
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

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results" / "gpu.json"
PAGE = ROOT / "docs" / "gpu.md"
EMULATED_SPEC = "H100:80GiB"

# label, check, environment, time limit (s), what it shows
PLAN: list[tuple[str, str, dict[str, str], int, str]] = [
    ("inventory", "inventory", {}, 60, "NVML's devices equal nvidia-smi's (name, UUID, memory, MIG mode)"),
    (
        "worker_path_warm_pool",
        "worker_path",
        {"GPU_TASKS_TUNE_WARM_WORKERS": "2"},
        120,
        "the warm pool over tcp: the task sees its CUDA_VISIBLE_DEVICES, CuPy computes there, an RMM pool",
    ),
    (
        "worker_path_local_cuda_cluster",
        "worker_path",
        {"GPU_TASKS_TUNE_WARM_WORKERS": "0"},
        120,
        "GPU_TASKS_TUNE_WARM_WORKERS=0 (dask-cuda's LocalCUDACluster): the same",
    ),
    (
        "cuda_contexts",
        "contexts",
        {"GPU_TASKS_TUNE_WARM_WORKERS": "2"},
        120,
        "unbound warm processes hold no CUDA context; a bound worker's is on its device only",
    ),
    (
        "cpu_affinity",
        "cpu_affinity",
        {},
        90,
        "a bound worker runs on its device's CPUs (NVML's affinity within the flow's CPUs) and the ledger "
        "says so; cpu_affinity=False keeps the flow's CPUs",
    ),
    ("fractional_packing", "packing", {}, 120, "four gpus=0.25 tasks at once on one device, 2 GiB each"),
    (
        "out_of_memory",
        "oom",
        {},
        150,
        "a real CUDA OOM -> GpuOutOfMemoryError naming profile and device; on_oom completes it on the "
        "bigger profile",
    ),
    (
        "memory_request",
        "memory_request",
        {},
        150,
        'gpu_memory_per_task="20GiB": min(4, free // 20 GiB) tasks at once, 15 GiB each, in one worker '
        "whose CuPy pool is capped to their shares; one asking past the cap fails with GpuOutOfMemoryError "
        "in its own run, the others complete",
    ),
    ("leases", "leases", {}, 120, "two flow processes on the one device never overlap (NVML-sampled)"),
    (
        "other_programs",
        "other_programs",
        {},
        90,
        "a separate CuPy process holding 60% of the device: a gpus=1 task waits (the log names its pid and "
        "memory) and runs there once it exits",
    ),
    (
        "measured_use",
        "measured_use",
        {"GPU_TASKS_TUNE_GPU_SAMPLE_SECONDS": "0.25"},
        120,
        "a gpus=1 task holding 10 GiB with CuPy, SMs 30% busy for 5 s: the ledger's NVML peak is within "
        "[10, 12] GiB, mean SM > 0, and the right-size line suggests a smaller share (dry run: 'not "
        "measured (emulated)', no numbers)",
    ),
    (
        "cold_start_warm_pool",
        "cold_start",
        {"GPU_TASKS_TUNE_WARM_WORKERS": "2"},
        120,
        "lease -> first task body, fresh and re-provisioned, warm pool, RMM pool included",
    ),
    (
        "cold_start_local_cuda_cluster",
        "cold_start",
        {"GPU_TASKS_TUNE_WARM_WORKERS": "0"},
        120,
        "the same with LocalCUDACluster",
    ),
    (
        "overhead",
        "overhead",
        {},
        300,
        "per-task overhead of a gpus=0.25 profile against ThreadPoolTaskRunner",
    ),
]

# What cannot run on the GPU machine, and why: unverified on GPU.
UNVERIFIED = [
    (
        "cuDF ETL (the example pipeline's feature stage on a GPU profile)",
        "cuDF's wheels are far larger than the 64 MiB a device call carries and the GPU machine reaches no "
        "package registry; they can now travel in parts (below), which has not run on a GPU yet",
    ),
    (
        "XGBoost training with device='cuda'",
        "xgboost-cu13's wheel (59 MiB, NCCL from the image) travels in the same parts, not yet run on a GPU",
    ),
    (
        "more than one GPU (placement across devices, gang-started multi-GPU profiles, CPU affinity per "
        "device)",
        "the GPU machine lent has one GPU",
    ),
    (
        "MIG instances as devices",
        "the lent GPU is not in MIG mode and the check does not change its settings",
    ),
    ("UCX / UCXX protocols for dask-cuda workers", "ucx-py / ucxx wheels are not carried"),
    (
        "cuDF spilling (cuda.enable_cudf_spill) and cuDF's RMM plugin",
        "needs cuDF on the GPU machine (see above)",
    ),
]


# How the wheels too large for one device call travel (bench/gpu_parts.py); on the page as it is.
PARTS_PROCEDURE = """## Carrying wheels in parts

**Unverified on GPU**: nothing of this has run on the GPU machine yet; the whole sequence is rehearsed
here by `scripts/gpu-check --dry-run --parts` (parts split, carried one at a time into a fresh staging
directory and checked by sha256, a fresh machine and a damaged part refused in one line each, then
joined, checked and every wheel opened; the wheels are not installed here).

`scripts/gpu-wheels --pipeline` adds cuDF, dask-cuDF and XGBoost for CUDA 13 and Python 3.12 to
gpu-tasks' own set, leaves out every distribution on the image's list (`scripts/gpu-image-packages.txt`,
CUDA runtime libraries included; versions are not on that list, so the last call's `pip check` tells),
and writes one tar of the wheels as `.gpu-parts/part-01` ... `part-NN` with `.gpu-parts/manifest.json`
(each part's size and sha256, the whole archive's, each wheel's). A part is at most 64 MiB less the
working tree as the device tool carries it (`git ls-files` tracked and untracked-not-ignored, plus
`shared/`) less a 2 MiB margin, in whole MiB. Built 2026-12-02 (tree 3.7 MiB): 100 wheels, 625.9 MiB
in 11 parts of 58 MiB (libcudf-cu13 287 MiB; the CUDA compiler pieces that cuDF's `cupy-cuda13x[ctk]`
and `numba-cuda[cu13]` ask for and the image's list lacks: nvidia-nvvm 72 MiB, nvidia-cuda-nvcc 45 MiB,
nvidia-cuda-cccl and nvidia-cuda-crt; numba-cuda-mlir 68 MiB; xgboost-cu13 59 MiB).

Each device call sends the checkout the session was started in, so run `scripts/gpu-wheels --pipeline`
and the rehearsal there (not in a helper's worktree), after the last commit (a tree grown by more than
the margin fails the rehearsal's fit check: build again). Then, with `status` showing a machine and
time to spare, make the calls back to back, each as soon as the previous returns (a machine idle 30 s
goes back, and `.gpu-staging/` with it):

| call | `run` command | `carry` | timeout_s |
| --- | --- | --- | --- |
| n = 1 to N-1 | `scripts/gpu-check --receive-part n` | the manifest, part n | 60 |
| N | `scripts/gpu-check --receive-part N && scripts/gpu-check --from-parts --budget 300` | the same | 480 |

`carry` is `[".gpu-parts/manifest.json", ".gpu-parts/part-NN"]`, NN in two digits (`part-01`).
Each call's one line says `part-0n of N verified (sha256 ...); n of N staged; next: ...`. The last call
joins the parts, checks the archive's and each wheel's sha256, installs the wheels with
`pip install --no-index --no-deps --target /tmp/gpu-check-site`, runs `pip check`, then the checks
above. Exit 3 on any call: a part from an earlier call is missing, so this is a fresh machine: start
over from call 1 (if the time left allows N more calls). Exit 4: the part arrived damaged: make the same
call again. Afterwards `give_back`. Device time, estimated, not measured: a start (1-2 min), N-1
short calls of about 62 MiB each, and the last call's install and checks (up to 480 s) fit 15 minutes
only once: keep `--budget` low enough that a restart is not needed, or use `--only`.
"""


def gpu_present() -> str | None:
    """Why there is no NVIDIA GPU to check, or ``None``."""
    if shutil.which("nvidia-smi") is None:
        return "no nvidia-smi on this machine"
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except Exception as exc:
        return f"nvidia-smi failed: {exc}"
    if out.returncode != 0 or "GPU" not in out.stdout:
        return f"nvidia-smi lists no GPU ({(out.stderr or out.stdout).strip()[:200]})"
    return None


def device_info(dry: bool) -> dict[str, Any]:
    if dry:
        return {
            "name": f"{EMULATED_SPEC.split(':')[0]} (emulated)",
            "memory": EMULATED_SPEC.split(":")[1],
            "driver": None,
            "cuda": None,
            "emulated": True,
        }
    import pynvml as nvml

    nvml.nvmlInit()
    try:
        h = nvml.nvmlDeviceGetHandleByIndex(0)
        name = nvml.nvmlDeviceGetName(h)
        cuda = nvml.nvmlSystemGetCudaDriverVersion()
        return {
            "name": name.decode() if isinstance(name, bytes) else name,
            "memory": f"{nvml.nvmlDeviceGetMemoryInfo(h).total / 2**30:.1f} GiB",
            "count": nvml.nvmlDeviceGetCount(),
            "driver": str(nvml.nvmlSystemGetDriverVersion()),
            "cuda": f"{cuda // 1000}.{cuda % 1000 // 10}",
            "emulated": False,
        }
    finally:
        nvml.nvmlShutdown()


def commit() -> str:
    if os.environ.get("GPU_TASKS_COMMIT"):
        return os.environ["GPU_TASKS_COMMIT"]
    try:
        from bench.common import commit as git_commit

        return git_commit()
    except Exception:
        return "unknown"


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_check(
    label: str, check: str, env: dict[str, str], limit: float, log: Path, own_limit: float
) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix=f"{label}-")) / f"{label}.json"  # in the run's scratch TMPDIR
    t0 = time.time()
    with open(log, "ab") as err:
        err.write(f"\n===== {label} ({check}, limit {limit:.0f} s) =====\n".encode())
        err.flush()
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.gpu_cases", check, "--label", label, "--out", str(out)],
            cwd=ROOT,
            env={**os.environ, **env},
            stdout=err,
            stderr=err,
            start_new_session=True,  # its workers and servers are killed with it
        )
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            pass
        finally:
            _kill_group(proc)
            proc.wait()
    if out.exists():
        return dict(json.loads(out.read_text()))
    if time.time() - t0 < limit - 1:
        reason = f"exit status {proc.returncode}"
    elif limit < own_limit:  # cut short by the run's budget, not by its own limit
        reason = (
            f"stopped after {limit:.0f} s, what was left of the run's budget "
            f"(its own limit: {own_limit:.0f} s)"
        )
    else:
        reason = f"timed out after {limit:.0f} s"
    return {
        "name": label,
        "passed": False,
        "figures": {"seconds": round(time.time() - t0, 2)},
        "detail": reason,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu-check", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="emulated devices, stand-ins for CUDA (CPU-only)"
    )
    parser.add_argument(
        "--only", nargs="+", choices=[p[0] for p in PLAN], help="these checks; keep the others"
    )
    parser.add_argument("--budget", type=float, default=400.0, help="seconds for all checks (default 400)")
    parser.add_argument(
        "--out-dir", default=None, help="where gpu.json and gpu.md go (default: docs/; dry run: a temp dir)"
    )
    parser.add_argument(
        "--report-only", action="store_true", help="re-render docs/gpu.md from docs/results/gpu.json"
    )
    parser.add_argument(
        "--prefect-home",
        default=None,
        help="the Prefect home of the run's server (default: a new temporary one; a home whose database "
        "is already migrated saves the server its migrations)",
    )
    args = parser.parse_args(argv)

    if args.report_only:
        PAGE.write_text(render(json.loads(RESULTS.read_text())))
        print(f"gpu-check: wrote {PAGE.relative_to(ROOT)} from {RESULTS.relative_to(ROOT)}")
        return 0
    if not args.dry_run and (why := gpu_present()):
        print(f"gpu-check: no NVIDIA GPU here ({why}); use --dry-run to rehearse on emulated devices")
        return 2
    if args.out_dir:
        results, page = Path(args.out_dir) / "results" / "gpu.json", Path(args.out_dir) / "gpu.md"
    elif args.dry_run:
        d = Path(tempfile.mkdtemp(prefix="gpu-check-dry-"))
        results, page = d / "results" / "gpu.json", d / "gpu.md"
    else:
        results, page = RESULTS, PAGE
    results.parent.mkdir(parents=True, exist_ok=True)
    log = results.parent / "gpu-check.log"
    log.write_text("")
    scratch = tempfile.mkdtemp(prefix="gpu-check-run-")
    try:
        return _run(args, results, page, log, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run(args: argparse.Namespace, results: Path, page: Path, log: Path, scratch: str) -> int:
    """Every check of the plan (``--only``'s), with what they write besides results under ``scratch``."""
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    os.environ["PYTHONUNBUFFERED"] = "1"
    os.environ["TMPDIR"] = tempfile.tempdir = scratch  # the checks' own temporary files, removed with it
    os.environ["PREFECT_HOME"] = args.prefect_home or tempfile.mkdtemp(prefix="prefect-home-")
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    os.environ["GPU_TASKS_LEASE_DIR"] = tempfile.mkdtemp(prefix="leases-")
    if args.dry_run:
        os.environ["GPU_CHECK_DRY_RUN"] = "1"
        os.environ["GPU_TASKS_EMULATED_GPUS"] = EMULATED_SPEC
        os.environ["GPU_CHECK_STANDIN_DIR"] = tempfile.mkdtemp(prefix="standin-")
    else:
        os.environ.pop("GPU_TASKS_EMULATED_GPUS", None)
        os.environ.pop("GPU_CHECK_DRY_RUN", None)

    device = device_info(args.dry_run)
    print(
        f"gpu-check: {device['name']}, {device['memory']}"
        + (" (DRY RUN: emulated, stand-ins for CUDA)" if args.dry_run else ""),
        flush=True,
    )
    previous = json.loads(results.read_text()) if results.exists() else {}
    # --only keeps the other checks' results; every run is listed, whatever it ran
    done = {c["name"]: c for c in previous.get("checks", [])} if args.only else {}
    ran = [label for label, *_ in PLAN if not args.only or label in args.only]
    start = time.monotonic()

    def save(final: bool) -> dict[str, Any]:
        data = {
            "device": device,
            "commit": commit(),
            "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "dry_run": args.dry_run,
            "seconds": round(time.monotonic() - start, 1),
            "checks": [done[p[0]] for p in PLAN if p[0] in done],
        }
        this_run = {
            "commit": data["commit"],
            "device": device["name"],
            "checks": len(ran),
            "passed": sum(bool(done[label]["passed"]) for label in ran if label in done),
            "seconds": data["seconds"],
            "note": ("--only " + " ".join(args.only) if args.only else "every check")
            + f", budget {args.budget:.0f} s"
            + ("" if final else f" (stopped after {sum(label in done for label in ran)} of {len(ran)})"),
        }
        data["runs"] = [*previous.get("runs", []), this_run]
        results.write_text(json.dumps(data, indent=2, default=str) + "\n")
        page.write_text(render(data))
        if os.environ.get("OUT"):  # the device tool brings back what is under $OUT
            for f in (results, page, log):
                shutil.copy(f, Path(os.environ["OUT"]) / f.name)
        return data

    from gpu_tasks.prefect_api.server import embedded_server

    with embedded_server() as url:
        os.environ["PREFECT_API_URL"] = url
        print(f"gpu-check: Prefect server at {url} ({time.monotonic() - start:.1f} s)", flush=True)
        for label, check, env, limit, _what in PLAN:
            if label not in ran:
                continue
            left = args.budget - (time.monotonic() - start)
            if left < 15:
                done[label] = {
                    "name": label,
                    "passed": False,
                    "figures": {},
                    "detail": "not run: the budget was spent",
                }
                print(f"  SKIP {label}: the budget was spent", flush=True)
                continue
            # a dry run shares a 2-core CI machine with other tests: each check gets twice its limit
            own = limit * (2 if args.dry_run else 1)
            row = run_check(label, check, env, min(own, left), log, own)
            row["commit"] = commit()  # a rerun (--only) keeps the other checks' own commits and devices
            row["device"] = device["name"]
            done[label] = row
            first = str(row["detail"]).splitlines()[0] if row["detail"] else ""
            print(
                f"  {'PASS' if row['passed'] else 'FAIL'} {label} "
                f"({row['figures'].get('seconds', '?')} s): {first[:400]}",
                flush=True,
            )
            save(final=False)
    data = save(final=True)
    passed = sum(c["passed"] for c in data["checks"])
    print(
        f"gpu-check: {passed} of {len(data['checks'])} passed in {data['seconds']} s; "
        f"wrote {results} and {page}"
    )
    return 0 if passed == len(data["checks"]) else 1


def render(data: dict[str, Any]) -> str:
    """docs/gpu.md from the check's JSON (nothing on the page is written by hand)."""
    dev = data["device"]
    what = {p[0]: p[4] for p in PLAN}
    lines = ["# gpu-tasks on a real GPU", ""]
    lines.append(
        "<!-- generated by `python -m bench.gpu_check --report-only` from docs/results/gpu.json; "
        "do not edit -->"
    )
    lines.append("")
    if dev.get("emulated"):
        lines += [
            "**DRY RUN on emulated devices with stand-ins for CUDA: these are not GPU results.**",
            "",
        ]
    passed = sum(c["passed"] for c in data["checks"])
    commits = sorted({c.get("commit", data["commit"]) for c in data["checks"]})
    # checks kept from an earlier run (--only) may have run on another device: the page names each
    elsewhere = sorted({c["device"] for c in data["checks"] if c.get("device", dev["name"]) != dev["name"]})
    on = f" (the last run's device; some checks below ran on {', '.join(elsewhere)})" if elsewhere else ""
    lines += [
        f"Checked by `scripts/gpu-check` on **{dev['name']}** ({dev['memory']}; driver {dev.get('driver')}, "
        f"CUDA {dev.get('cuda')}){on} at commit{'s' if len(commits) > 1 else ''} "
        f"{', '.join(f'`{c}`' for c in commits)} (each check's below), last run {data['date']}: "
        f"**{passed} of {len(data['checks'])} checks passed**. Every real-GPU statement in the README and "
        "docs/ points to a row below or says *unverified on GPU*.",
        "",
        "| check | what it shows | result |",
        "| --- | --- | --- |",
    ]
    for c in data["checks"]:
        result = "passed" if c["passed"] else "**FAILED**"
        lines.append(
            f"| [{c['name']}](#{c['name'].replace('_', '-')}) | {what.get(c['name'], '')} | {result} |"
        )
    if data.get("runs"):
        lines += ["", "Runs on the device, in order (each with the commit it ran and the device):", ""]
        lines += [
            f"- `{r['commit']}`{' on ' + r['device'] if r.get('device') else ''}: {r['passed']} of "
            f"{r['checks']} passed in {r['seconds']} s; {r['note']}"
            for r in data["runs"]
        ]
    lines += ["", "## Checks", ""]
    for c in data["checks"]:
        lines += [f"### {c['name'].replace('_', '-')}", ""]
        where = (f"commit `{c['commit']}`" if c.get("commit") else "", c.get("device", ""))
        at = ", ".join(x for x in where if x)
        at = f" ({at})" if at else ""
        lines += [f"{'Passed' if c['passed'] else 'FAILED'}{at}: {str(c['detail']).strip()}", ""]
        lines += ["```json", json.dumps(c["figures"], indent=1, default=str)[:3000], "```", ""]
    lines += [
        "## Unverified on GPU",
        "",
        "What the GPU machine cannot run, and why; everything here is **unverified on GPU** (emulated "
        "devices and CPU fallbacks test the scheduling of it on every CI run).",
        "",
        "| what | why |",
        "| --- | --- |",
    ]
    lines += [f"| {w} | {why} |" for w, why in UNVERIFIED]
    lines += ["", PARTS_PROCEDURE.rstrip("\n"), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
