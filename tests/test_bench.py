"""The benchmark suite's own logic: accounting, the report, and the refusals (no timings asserted)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import report
from bench.common import ray_missing, ray_skipped, spread
from bench.held_busy import GPU_STAGES, busy_by_device, run_profile, run_static, union_seconds
from bench.waits import cache_hit, excess_seconds, most, slot_wait, steps_from_intervals, value_at

ROOT = Path(__file__).resolve().parents[1]


def test_union_seconds_merges_overlaps_and_gaps():
    assert union_seconds([]) == 0
    assert union_seconds([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3.0)
    assert union_seconds([(3, 4), (0, 10)]) == pytest.approx(10.0)  # unsorted, nested


def test_busy_counts_gpu_stages_only_per_device():
    tasks = [
        {"stage": "etl", "devices": ["0"], "start": 0, "end": 1},
        {"stage": "train", "devices": ["0", "1"], "start": 2, "end": 3},
        {"stage": "prepare", "devices": ["1"], "start": 5, "end": 9},  # a CPU stage on a GPU worker
    ]
    assert busy_by_device(tasks) == {"0": [(0, 1), (2, 3)], "1": [(2, 3)]}


def test_spread():
    assert spread([3.0, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0, "n": 3}


@pytest.mark.slow
def test_held_busy_accounting_on_both_setups(prefect_server, emulated, no_leaked_processes):
    """Every GPU-stage task ran inside a hold of its device, by the profile that ran it;
    the static cluster holds every device for its whole life."""
    prof = run_profile(scale=0.1, idle_timeout=0.3)
    static = run_static(scale=0.1, n_gpus=2)
    for res in (prof, static):
        assert res["busy_s"] > 0 and res["held_s"] >= res["busy_s"]
        for t in (t for t in res["tasks"] if t["stage"] in GPU_STAGES):
            assert t["devices"], t
            for d in t["devices"]:
                assert any(
                    h["device"] == d and h["start"] <= t["start"] and t["end"] <= h["end"]
                    for h in res["holds"]
                ), (res["setup"], t)
    assert {h["profile"] for h in prof["holds"]} == {"gpu-etl", "gpu-train"}
    assert all(h["reason"] for h in prof["holds"])
    assert sorted(h["device"] for h in static["holds"]) == ["0", "1"]
    life = {(h["start"], h["end"]) for h in static["holds"]}
    assert len(life) == 1, "the static cluster holds both devices for the same span"


def test_waits_counts_devices_held_beyond_the_need():
    held = steps_from_intervals([(0, 4), (1, 3), (5, 6)])  # two devices from 1 to 3
    assert [value_at(held, t) for t in (-1, 0, 1.5, 3.5, 5.5, 7)] == [0, 1, 2, 1, 1, 0]
    assert most(held, 0, 6) == 2 and most(held, 3.5, 4.5) == 1
    assert excess_seconds(held, [(0, 1)], 0, 6) == pytest.approx(2.0)  # beyond one device
    assert excess_seconds(held, [], 0, 6) == pytest.approx(7.0)  # every device-second
    assert excess_seconds(held, [(0, 1)], 2, 2.5) == pytest.approx(0.5)  # only within the window
    assert excess_seconds([], [(0, 1)], 0, 6) == 0  # never below zero


@pytest.mark.slow
def test_waits_profile_runner_holds_nothing_for_waiting_or_cached_tasks(
    prefect_server, emulated, lease_dir, no_leaked_processes, tmp_path
):
    """Under a tag limit of 1 the waiting task holds no device (one device leased in all); a cached
    task leases none and starts no worker. The static Dask cluster, in the same conditions, has the
    waiting task on the second GPU and the cached task on a GPU worker."""
    from bench.held_busy import PROFILE, STATIC

    slot = slot_wait(PROFILE, 0.3)
    assert slot["devices_leased"] == 1 and len(slot["leased_devices"]) == 1, slot
    assert slot["held_while_waiting_s"] == 0 and slot["slot_wait_s"] > 0
    assert slot["second"]["start"] >= slot["first"]["end"]  # the limit held: one at a time
    cache = cache_hit(PROFILE, tmp_path / "results")
    assert cache["device_s"] == 0 and cache["devices_leased"] == 0 and cache["leased_devices"] == []
    assert cache["workers_started"] == 0 and cache["cache_hits"] == 1, cache

    static = slot_wait(STATIC, 0.3)
    assert static["devices_leased"] == 2 and static["held_while_waiting_s"] > 0, static
    assert static["first"]["devices"] != static["second"]["devices"]  # the waiter sat on the other GPU
    cached = cache_hit(STATIC, tmp_path / "results")
    assert cached["devices_leased"] == 1 and cached["device_s"] > 0 and cached["workers_started"] == 2


def _results(tmp_path: Path, ray: bool = True) -> dict:
    """Results shaped as the suite writes them, from a real held-vs-busy accounting of the runs;
    without ``ray``, as a run without the bench extra writes them (the Ray case skipped)."""

    def tasks(t0: float) -> list[dict]:
        return [
            {"stage": "etl", "devices": ["0"], "start": t0 + 1, "end": t0 + 2, "pid": 11},
            {"stage": "train", "devices": ["1"], "start": t0 + 3, "end": t0 + 5, "pid": 12},
            {"stage": "ingest", "devices": [], "start": t0, "end": t0 + 1, "pid": 10},
        ]

    from bench.held_busy import _account

    prof = _account(
        "ProfileTaskRunner",
        0,
        6,
        tasks(0),
        [
            {"device": "0", "profile": "gpu-etl", "start": 0.5, "end": 2.5, "reason": "scaled down: idle"},
            {"device": "1", "profile": "gpu-train", "start": 2.5, "end": 5.5, "reason": "scaled down: idle"},
        ],
        1.0,
    )
    static = _account(
        "static DaskTaskRunner",
        0,
        6,
        tasks(0),
        [{"device": d, "profile": "static", "start": 0, "end": 6, "reason": "flow ended"} for d in "01"],
        0.0,
    )
    ray_run = {
        **_account(
            "RayTaskRunner",
            0,
            8,
            tasks(2),
            [{"device": d, "profile": "ray", "start": 0, "end": 8, "reason": "flow ended"} for d in "01"],
            0.0,
        ),
        "init_s": 2.0,
    }
    setups = [prof, static, ray_run] if ray else [prof, static]
    skipped = {} if ray else {"RayTaskRunner": "skipped: ray not installed (the bench extra)"}
    one = lambda v: spread([v])  # noqa: E731
    m = {
        "arch": "x86_64",
        "cpus": 2,
        "memory_gib": 24,
        "python": "3.11",
        "device_source": "emulated",
        "devices": ["EMU", "EMU"],
        "emulated": True,
        "gpu": False,
    }
    from bench.overhead import DASK, PROFILE_CPU, PROFILE_GPU, RAY, RAY_GPU, THREADS, summary

    ms = {THREADS: [4.0], DASK: [90.0], PROFILE_CPU: [7.0], PROFILE_GPU: [20.0]}
    if ray:
        ms |= {RAY: [180.0], RAY_GPU: [50.0]}

    return {
        "suite": {"machine": m, "quick": True, "seconds": 60, "finished": "now"},
        "overhead": {
            "repeats": 1,
            "machine": m,
            "ms_per_task": {"100": ms},
            "summary": summary({"ms_per_task": {"100": ms}}),
            "skipped": skipped,
        },
        "held_busy": {
            "repeats": 1,
            "idle_timeout": 0.5,
            "gpus": 2,
            "machine": m,
            "runs": setups,
            "skipped": skipped,
            "stages": {"etl": {"profile": "gpu-etl", "tasks": 1, "seconds": 1}},
            "summary": {
                r["setup"]: {
                    k: one(r[k])
                    for k in (
                        "held_over_busy",
                        "held_less_idle_tails_over_busy",
                        "held_s",
                        "busy_s",
                        "flow_s",
                    )
                }
                for r in setups
            },
        },
        "cold_start": {
            "repeats": 1,
            "idle_timeout": 0.5,
            "machine": m,
            "skipped": skipped,
            "summary": {
                "fresh": {
                    "total_s": one(1.5),
                    "prepare_s": one(0.0),
                    "wait_devices_s": one(0.0),
                    "before_lease_other_s": one(0.0),
                    "start_workers_s": one(0.4),
                    "engine_first_task_s": one(1.1),
                    "lease_to_body_s": one(0.4 + 1.1),
                },
                "reprovision": {
                    "total_s": one(2.5),
                    "prepare_s": one(0.0),
                    "wait_devices_s": one(0.0),
                    "before_lease_other_s": one(0.0),
                    "start_workers_s": one(0.4),
                    "engine_first_task_s": one(2.1),
                    "lease_to_body_s": one(0.4 + 2.1),
                },
                "warm": {"total_s": one(0.1)},
                "dask": {"total_s": one(1.3)},
                **(
                    {"ray": {"total_s": one(3.9), "init_s": one(2.6), "first_task_s": one(1.3)}}
                    if ray
                    else {}
                ),
                "by_hand": {
                    "total_s": one(0.4),
                    "cluster_s": one(0.38),
                    "first_submit_s": one(0.02),
                    "import_task_engine_s": one(0.9),
                },
            },
        },
        "waits": {
            "repeats": 1,
            "seconds": 2.0,
            "gpus": 2,
            "machine": m,
            "skipped": skipped,
            "summary": {
                name: {
                    "slot": {
                        "slot_wait_s": one(w),
                        "held_while_waiting_s": one(h),
                        "devices_leased": one(d),
                        "handoff_s": one(0.4),
                        "flow_s": one(6.0),
                    },
                    "cache": {
                        "device_s": one(c),
                        "devices_leased": one(min(d, 1) if c else 0),
                        "workers_started": one(k),
                        "hit_s": one(0.2),
                    },
                }
                for name, w, h, d, c, k in (
                    ("ProfileTaskRunner", 4.0, 0.0, 1, 0.0, 0),
                    ("static DaskTaskRunner", 2.1, 2.05, 2, 0.11, 2),
                    ("RayTaskRunner", 1.9, 2.0, 2, 0.9, 0),
                )[: 3 if ray else 2]
            },
        },
        "scale": {
            "repeats": 1,
            "machine": m,
            "runs": {"10": [{"per_profile": {"cpu": 4, "io": 3, "quarter": 3}}]},
            "summary": {
                n: {
                    "wall_s": one(w),
                    "ms_per_task": one(w * 1000 / int(n)),
                    "peak_rss_mib": one(r),
                    "rss_before_mib": one(100),
                }
                for n, w, r in (("10", 1.0, 110), ("100", 12.0, 130))
            },
            "ratio": {"tasks": 10, "wall": 12.0, "peak_rss_growth": 3.0},
            "reference": {
                "runs": {},
                "ratio": {"tasks": 10, "wall": 19.0, "peak_rss_growth": 2.0},
                "summary": {
                    n: {
                        "wall_s": one(w),
                        "ms_per_task": one(w * 1000 / int(n)),
                        "peak_rss_mib": one(120),
                        "rss_before_mib": one(100),
                    }
                    for n, w in (("10", 0.5), ("100", 9.5))
                },
            },
        },
        "throughput": {
            "rounds": 10,
            "repeats": 1,
            "gpu": False,
            "machine": m,
            "runs": {"pandas": {"1": [{"flights": 336776}]}},
            "summary": {
                "pandas": {
                    "1": {
                        k: one(v)
                        for k, v in (
                            ("etl_rows_per_s", 1.6e5),
                            ("train_rows_per_s", 7e4),
                            ("etl_s", 2.1),
                            ("train_s", 4.0),
                            ("flow_s", 15.0),
                            ("ingest_s", 1.0),
                        )
                    }
                }
            },
        },
    }


def test_report_writes_markdown_with_verdicts_and_plots(tmp_path: Path):
    results = _results(tmp_path)
    results["held_busy_long"] = {**results["held_busy"], "stage_seconds": 5.0}
    path = report.write(results, tmp_path)
    text = path.read_text()
    for title in (
        "## Per-task overhead",
        "## Device-seconds held versus busy",
        "## Cold start",
        "## Waiting without a device",
        "## Scale",
        "## Pipeline throughput",
    ):
        assert title in text
    assert "EMULATED" in text and "unverified on GPU" in text and "QUICK RUN" in text
    # verdicts follow the numbers: 20 ms is 5x the thread pool (missed), 7 ms is within 2x (met)
    assert (
        "ProfileTaskRunner, CPU profile: 1.75x the thread pool and 12.9x faster than DaskTaskRunner: **met**"
        in text
    )
    assert "ProfileTaskRunner, gpus=0.25 profile: 5.00x the thread pool" in text and "**missed**" in text
    assert "re-provision 2.50s: **missed**" in text  # the slower case decides
    # a device's lease to the task body: start worker + first task (0.4 + 1.1, 0.4 + 2.1)
    assert "re-provisioned): 1.50s and 2.50s: **missed**, 2.20s over" in text
    assert "gpus=0.25 profile: 5.00x the thread pool" in text and "2.5x the target, see below" in text
    assert "10x the tasks took 12.00x the time: **missed**" in text
    assert (
        "| ThreadPoolTaskRunner (reference) | 100 | 9.5 |" in text and "took 19.00x the time for 10x" in text
    )
    # held/busy: ProfileTaskRunner held 5 device-s for 3 busy, the static cluster 12
    assert "holds devices 2.40x less than the static cluster" in text
    assert (
        "From a device's lease to the first task body on it: 0.50 (0.50-0.50) s over 2 provisionings" in text
    )
    assert (
        "| ProfileTaskRunner, stages 5x as long |" in text and "Measured with every stage 5x as long" in text
    )
    # the Ray peer: its rows, and the comparisons read from its figures
    assert "| 100 | RayTaskRunner | 180.00 | 45.00x | 0.5x |" in text
    assert "gpus=0.25 profile took 20.0 ms (2.5x less)" in text
    assert "| RayTaskRunner | 5.33 |" in text  # held 16 device-s (its life, 8 s, x 2) for 3 busy
    assert (
        "ProfileTaskRunner holds devices 3.20x less" in text and "ran in 2 worker processes (one each" in text
    )
    assert (
        "`ray.init` + first task | 3.90 | - | - | - | 2.60 | 1.30 | - |" in text
        and "3.0x more than DaskTaskRunner" in text
    )
    # waiting without a device: the target follows ProfileTaskRunner's figures; the peers beside them
    assert (
        "ProfileTaskRunner 0.00 device-s while waiting and 0.00 for the cached task (most over the "
        "repeats), **met**; in the same run static DaskTaskRunner 2.05 device-s while waiting" in text
    )
    assert "| static DaskTaskRunner | 2.10 | 2.05 | 2 | 0.11 | 2 |" in text
    assert "| RayTaskRunner | 1.90 | 2.00 | 2 | 0.90 | 0 |" in text
    assert "skipped" not in text
    for png in ("overhead", "held_busy_timeline", "cold_start", "waits", "scale", "throughput"):
        data = (tmp_path / "results" / f"{png}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, png


def test_without_ray_the_ray_case_is_skipped_with_its_reason(monkeypatch, capsys, tmp_path: Path):
    """The tests never install Ray (the bench extra): each benchmark says the Ray case is skipped
    and why, runs the others, and the report says so where the Ray rows would be."""
    from bench.overhead import RAY, runners

    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed, even where it is
    assert ray_missing() == "skipped: ray not installed (the bench extra: ./scripts/bench installs it)"
    assert ray_skipped() == {"RayTaskRunner": ray_missing()}
    assert "RayTaskRunner: skipped: ray not installed" in capsys.readouterr().out
    assert not [label for label in runners(2) if label.startswith(RAY)]
    text = report.write(_results(tmp_path, ray=False), tmp_path).read_text()
    assert text.count("- RayTaskRunner: skipped: ray not installed (the bench extra).") == 4
    assert "| RayTaskRunner" not in text and "Ray:" not in text


def test_report_renders_only_what_ran(tmp_path: Path):
    results = _results(tmp_path)
    only = {"suite": results["suite"], "cold_start": results["cold_start"]}
    text = report.write(only, tmp_path).read_text()
    assert "## Cold start" in text and "## Scale" not in text and "## Per-task overhead" not in text


def test_report_puts_both_prefect_versions_side_by_side(tmp_path: Path):
    from bench.overhead import PROFILE_GPU, THREADS

    def end(prefect: str, venv: str, threads: list[float], gpu: list[float]) -> dict:
        return {
            "venv": venv,
            "versions": {
                "prefect": prefect,
                "dask": "2026.7.1",
                "distributed": "2026.7.1",
                "fastapi": "0.150.0",
            },
            "ms_per_task": {"100": {THREADS: threads, PROFILE_GPU: gpu}},
            "vs_threads": {"100": spread(gpu)["median"] / spread(threads)["median"]},
        }

    results = _results(tmp_path)
    results["prefect_versions"] = {
        "repeats": 3,
        "order": ["lowest", "newest"],
        "ends": {
            "lowest": end("3.8.8", ".venv", [2.0, 2.5, 3.0], [4.0, 5.0, 6.0]),
            "newest": end("3.9.1", ".venv-compat", [2.0, 2.2, 2.4], [6.0, 5.5, 7.0]),
        },
        "seconds": 600.0,
        "finished": "2026-11-26 10:00 UTC",
        "commit": "abc1234",
    }
    text = report.write(results, tmp_path).read_text()
    assert text.index("## Per-task overhead by Prefect version") > text.index("## Per-task overhead\n")
    assert (
        "| N | runner | Prefect 3.8.8 ms/task | Prefect 3.9.1 ms/task | Prefect 3.9.1 / Prefect 3.8.8, "
        "medians | best repeats |" in text
    )
    assert f"| 100 | {PROFILE_GPU} | 5.00 (4.00-6.00) | 6.00 (5.50-7.00) | 1.20x | 1.38x |" in text
    assert "2.00x the thread pool's time on Prefect 3.8.8 and 2.73x on Prefect 3.9.1" in text
    assert "its best repeats took 1.00x as long on Prefect 3.9.1" in text
    assert "prefect_versions 2026-11-26 10:00 UTC (commit abc1234)" in text
    assert "Repeats over" not in text
    # a repeat far slower than its row's best is named as a stall
    results["prefect_versions"]["ends"]["newest"]["ms_per_task"]["100"][PROFILE_GPU] = [5.5, 6.0, 130.0]
    text = report.write(results, tmp_path).read_text()
    assert (
        f"Repeats over 5x their row's best: Prefect 3.9.1, N = 100, {PROFILE_GPU}: 1 of 3 repeats at 130 ms "
        "per task against 5.50 for its best (13 s for the map)" in text
    )


def _bench(args: list[str], **env: str) -> subprocess.CompletedProcess:
    clean = {
        k: v for k, v in os.environ.items() if not k.startswith(("GPU_TASKS_EMULATED", "PREFECT_API_URL"))
    }
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**clean, **env},
        timeout=120,
    )


def test_gpu_mode_refuses_emulated_devices():
    proc = _bench(["bench.throughput", "--gpu"], GPU_TASKS_EMULATED_GPUS="2")
    assert proc.returncode != 0 and "GPU_TASKS_EMULATED_GPUS is set" in proc.stderr, proc.stderr


@pytest.mark.skipif(os.path.exists("/dev/nvidia0"), reason="this host has a GPU device node")
def test_gpu_mode_refuses_a_machine_without_gpus():
    proc = _bench(["bench", "--gpu", "--only", "throughput"])
    assert proc.returncode != 0 and "needs real NVIDIA GPUs" in proc.stderr, proc.stderr


def test_report_takes_real_gpu_figures_from_the_gpu_check_and_nothing_from_a_dry_run(tmp_path: Path):
    """docs/benchmarks.md's real-GPU line comes from docs/results/gpu.json: figures of the checks
    that passed, with their commit; a failed or missing check, or a dry run, reads unverified on GPU."""
    import json

    cold = {"fresh": {"lease_to_body_s": 1.234}, "reprovision": {"lease_to_body_s": 0.987}}
    data = {
        "device": {"name": "NVIDIA H200"},
        "dry_run": False,
        "checks": [
            {"name": "cold_start_warm_pool", "passed": True, "commit": "abc1234", "figures": cold},
            {"name": "cold_start_local_cuda_cluster", "passed": False, "figures": cold},
            {
                "name": "overhead",
                "passed": True,
                "commit": "abc1234",
                "figures": {"100": {"ratio": 1.5}, "1000": {"ratio": 1.25}, "seconds": 9.0},
            },
        ],
    }
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(data))
    line = report._gpu_cold_start(path)
    assert "1.23 s fresh and 0.99 s re-provisioned" in line and "`abc1234`" in line
    assert "LocalCUDACluster` spawns" not in line  # that check failed
    assert "1.50x / 1.25x the thread pool at N=100 / 1,000" in line
    data["checks"][2]["passed"] = False
    path.write_text(json.dumps(data))
    assert "overhead of a `gpus=0.25` profile: unverified on GPU" in report._gpu_cold_start(path)
    data["dry_run"] = True
    path.write_text(json.dumps(data))
    line = report._gpu_cold_start(path)
    assert "lease to first body is unverified on GPU" in line and "1.23" not in line
    assert "unverified on GPU" in report._gpu_cold_start(tmp_path / "missing.json")


def test_merge_puts_a_benchmark_run_on_its_own_into_the_report(tmp_path: Path):
    """`python -m bench --merge NAME JSON`: a benchmark run by hand (its --json) joins the suite's
    results with the commit it measured, and the report shows it; an unknown name is refused."""
    import json

    from bench.__main__ import main

    (tmp_path / "results").mkdir()
    results = _results(tmp_path)
    (tmp_path / "results" / "benchmarks.json").write_text(json.dumps(results))
    one = {
        "repeats": 1,
        "machine": results["scale"]["machine"],
        "server": "production",
        "load": 0,
        "runs": {
            n: [
                {
                    "events_completed": int(n) + 24,
                    "events_expected": int(n) + 24,
                    "sent_s": 0.2 * int(n) + 1.0,
                    "recorded_s": 0.5 * int(n),
                    "backlog_waited_s": 0.0 if n == "10" else 1234.4,
                    "cpu_flow_s": 0.3 * int(n),
                    "cpu_server_s": {
                        "api": 0.1 * int(n),
                        "services": 0.5 * int(n),
                        "postgres": 1.0,
                        "redis": 0.0,
                    },
                    "cpu_machine_s": 1.2 * int(n),
                }
            ]
            for n in ("10", "100")
        },
        "summary": results["scale"]["summary"],
    }
    (tmp_path / "one.json").write_text(json.dumps(one))
    assert (
        main(
            [
                "--out",
                str(tmp_path),
                "--merge",
                "scale_production_quiet",
                str(tmp_path / "one.json"),
                "--commit",
                "abc1234",
            ]
        )
        == 0
    )
    merged = json.loads((tmp_path / "results" / "benchmarks.json").read_text())
    assert merged["scale_production_quiet"]["commit"] == "abc1234" and "scale" in merged
    text = (tmp_path / "benchmarks.md").read_text()
    assert "## Scale to 100 tasks, on a quiet machine, on PostgreSQL and Redis" in text
    assert "| 100 | 12.0 |" in text and "124 of 124" in text
    # where the CPU went, and the time until the server had stored every task run
    assert "| 100 | 30 | 10 | 50 | 1 | 0 | 120 | 1200.0 |" in text, text
    assert "N = 10: 5.0 s, N = 100: 50.0 s" in text and "100 tasks took 10.00x the time of 10." in text
    # ... until the flow process had sent its events (a script's end), and its back-pressure waits
    assert "had sent every event it queued" in text and "N = 10: 3.0 s, N = 100: 21.0 s" in text
    assert "100 tasks took 7.00x the time of 10." in text
    assert "events waited to be sent: N = 10: 0 s, N = 100: 1,234 s." in text
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--merge", "scale_huge", str(tmp_path / "one.json")])


def test_sharing_figures_count_lost_work_waits_and_bs_time_to_running():
    from bench.sharing import A, B, attempts, figures

    def ev(team, task, pid, kind, t, dev="0"):
        return {"team": team, "task": task, "pid": pid, "kind": kind, "t": t, "devices": [dev]}

    lines = [
        ev(A, 0, 10, "start", 0.0),
        ev(A, 0, 10, "alive", 2.0),
        ev(A, 0, 10, "end", 4.0),  # device 0
        ev(A, 1, 11, "start", 0.0, "1"),
        ev(A, 1, 11, "alive", 1.5, "1"),  # cut short on device 1
        ev(B, 0, 20, "start", 3.0, "1"),
        ev(B, 0, 20, "end", 7.0, "1"),
        ev(A, 1, 12, "start", 4.0),
        ev(A, 1, 12, "end", 8.0),  # A's task 1 again, on device 0
    ]
    runs = attempts(lines)
    assert [(a["team"], a["task"], a["ended"]) for a in runs] == [
        (A, 0, True),
        (A, 1, False),
        (B, 0, True),
        (A, 1, True),
    ]
    submitted = {A: {"0": 0.0, "1": 0.0}, B: {"0": 2.0}}
    f = figures(lines, submitted, t0=0.0, t_end=10.0, devices=2, bursts=[2.0], burst_tasks=1)
    assert f["available_device_s"] == 20.0
    assert f["busy_device_s"] == 8.0 + 1.5 + 4.0  # device 0: 0-8; device 1: 0-1.5 and 3-7
    assert f["useful_device_s"] == 12.0 and f["lost_device_s"] == 1.5 and f["attempts_cut_short"] == 1
    assert f["teams"][A]["tasks_done"] == 2 and f["teams"][A]["preempted"] == 1
    assert f["teams"][A]["wait_p50_s"] == 2.0  # waits 0 and 4
    assert f["teams"][B]["wait_p50_s"] == 1.0 and f["b_arrival_to_running_s"] == [1.0]
