"""bench/faults.py's own logic: the reliability report and the per-scenario harness (no flows run)."""

from __future__ import annotations

from pathlib import Path

from bench import faults

MACHINE = {
    "arch": "x86_64",
    "cpus": 2,
    "memory_gib": 23.5,
    "python": "3.11.7",
    "device_source": "emulated",
    "devices": ["0", "1"],
    "emulated": True,
    "gpu": False,
}


def _row(key: str, ok: bool, **kw) -> dict:
    row = {
        "key": key,
        "fault": f"fault {key} | piped",
        "sees": f'Crashed; Crashed: "{key} message"',
        "recovery_s": 1.234,
        "recovery": "fault → final state",
        "leaked": 0,
        "leaked_cmds": [],
        "lost": [],
        "checks": {"a check": ok},
        "ok": ok,
        "seconds": 3.0,
    }
    row.update(kw)
    return row


def test_render_has_every_row_its_leak_and_loss_counts_and_the_soak_table():
    soak = [
        {"run": n, "fds": 14, "threads": 8, "children": 0, "rss_mb": 120.0 + n, "seconds": 6.1}
        for n in faults.SOAK_AT
    ]
    results = {
        "suite": {
            "machine": MACHINE,
            "commit": "abc1234",
            "seconds": 300.0,
            "finished": "2026-11-23 20:00 UTC",
        },
        "scenarios": [
            _row("first", True),
            _row(
                "leaky",
                False,
                leaked=1,
                leaked_cmds=["123: sleep 300"],
                lost=["t-1: RUNNING", "t-2: RUNNING"],
                note="why it leaked",
            ),
            _row("broken", False, sees=None, recovery_s=None, checks={}, error="RuntimeError: boom"),
            _row(
                "unpickled",
                False,
                sees='flow run FAILED: "TypeError: MemoryError.__new__(GpuOutOfMemoryError) '
                'is not safe, use GpuOutOfMemoryE…"',
            ),
            _row("soak", True, recovery_s=None, soak=soak),
        ],
    }
    md = faults.render(results)
    header = next(line for line in md.splitlines() if line.startswith("| # |"))
    assert "Processes leaked" in header and "Tasks lost" in header and "Recovery (s)" in header
    rows = [
        line for line in md.splitlines() if line.startswith("| ") and line[2].isdigit() and "fault " in line
    ]
    assert len(rows) == 5
    cells = [[c.strip() for c in line.strip("|").split(" | ")] for line in rows]
    assert [c[0] for c in cells] == ["1", "2", "3", "4", "5"]
    assert "\\|" in rows[0]  # a pipe in a cell is escaped, the table keeps its columns
    leaked_col, lost_col = (
        header.strip("|").split(" | ").index("Processes leaked"),
        header.strip("|").split(" | ").index("Tasks lost"),
    )
    assert [(c[leaked_col], c[lost_col]) for c in cells] == [
        ("0", "0"),
        ("1", "2"),
        ("0", "0"),
        ("0", "0"),
        ("0", "0"),
    ]
    assert [c[-1] for c in cells] == ["pass", "**FAIL**", "**FAIL**", "**FAIL**", "pass"]
    assert "1.23" in rows[0] and "| — |" in rows[2]
    assert "scenario failed: RuntimeError: boom" in rows[2]
    assert "2 of 5 scenarios passed" in md and "commit abc1234" in md and "EMULATED" in md
    assert "python -m bench.faults" in md
    assert "`123: sleep 300`" in md and "t-1: RUNNING" in md and "why it leaked" in md
    assert faults.UNPICKLE_NOTE in md  # a known cause is explained when rendering
    for n in faults.SOAK_AT:
        assert any(line.startswith(f"| {n} | 14 | 8 | 0 |") for line in md.splitlines()), n


def test_a_failing_scenario_is_a_failed_row_and_the_harness_goes_on(tmp_path: Path):
    def boom(ctx: faults.Ctx) -> dict:
        assert ctx.env["GPU_TASKS_TEST_MARKER"] == ctx.marker and ctx.env["PREFECT_API_URL"] == "http://x/api"
        raise RuntimeError("boom")

    row = faults.run_scenario(
        "boom", "a fault", boom, "http://x/api", tmp_path, {"GPU_TASKS_IDLE_TIMEOUT": "9"}
    )
    assert row["ok"] is False and row["error"] == "RuntimeError: boom"
    assert row["leaked"] == 0 and row["lost"] == [] and "boom" in row["traceback"]
    fine = faults.run_scenario(
        "fine", "no fault", lambda ctx: {"sees": "ok", "checks": {"c": True}}, "http://x/api", tmp_path, {}
    )
    assert fine["ok"] is True and fine["leaked"] == 0


def test_scenario_env_drops_the_users_gpu_tasks_and_api_settings(tmp_path: Path):
    env = faults.scenario_env(
        {"GPU_TASKS_IDLE_TIMEOUT": "9", "PREFECT_API_URL": "http://elsewhere", "HOME": "/h"},
        "http://x/api",
        "m",
        tmp_path / "leases",
    )
    assert env["PREFECT_API_URL"] == "http://x/api" and env["GPU_TASKS_TEST_MARKER"] == "m"
    assert "GPU_TASKS_IDLE_TIMEOUT" not in env and env["GPU_TASKS_EMULATED_GPUS"] == "2"
    assert env["GPU_TASKS_LEASE_DIR"] == str(tmp_path / "leases") and env["HOME"] == "/h"
