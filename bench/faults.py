"""Fault scenarios, each run as a user would; writes docs/reliability.md and docs/results/faults.json.

    python -m bench.faults [--out docs] [--only worker_sigkill_once ...] [--quick]
    python -m bench --only faults          # the same, through the benchmark harness
    python -m bench.faults --report-only   # re-render docs/reliability.md from results/faults.json

One Prefect server (a temporary PREFECT_HOME) serves the scenarios that need one; the
ephemeral-API and ``gpu-tasks example run`` scenarios start their own, as a user's would. Every
scenario is a fresh flow script (or CLI command) in a subprocess, with a marker in its
environment that every descendant inherits, so whatever outlives it is found with psutil.
A scenario that fails is reported with its error; the others still run. The tests in
``tests/faults/`` assert the same outcomes; this script measures and tabulates them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.common import ROOT, commit, describe, machine
from bench.procs import ctrl_c, kill_marked, marked, terminal_signals, wait_gone

LEAK_GRACE_S = 10.0  # a marked process alive this long after its scenario ended is leaked
SETTLE_S = 20.0  # states reach the server as events; wait this long for final ones
UNFINISHED = {"RUNNING", "PENDING", "SCHEDULED"}
SOAK_AT = (1, 5, 10, 20)


# ---------------------------------------------------------------- processes
# ---------------------------------------------------------------- the server's records
def api(url: str, method: str, path: str, **kw: Any) -> Any:
    import httpx

    response = httpx.request(method, url.rstrip("/") + path, timeout=30, **kw)
    response.raise_for_status()
    return response.json() if response.content else None


def ts(iso: str) -> float:
    """Epoch seconds of an ISO timestamp from the server."""
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def task_run(url: str, task_run_id: str, want: Callable[[dict], bool], timeout: float = SETTLE_S) -> dict:
    """The task run as the server recorded it, once ``want`` holds (or after ``timeout``). The server
    writes task runs from their events, in batches (the embedded server's recorder): until then it
    answers 404, or has the run without its ``state``."""
    import httpx

    deadline = time.monotonic() + timeout
    run: dict = {}
    while True:
        try:
            run = api(url, "GET", f"/task_runs/{task_run_id}")
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code != 404:
                raise
        if (run.get("state") and want(run)) or time.monotonic() > deadline:
            return run
        time.sleep(0.25)


def task_states(url: str, task_run_id: str) -> list[dict]:
    states = api(url, "GET", "/task_run_states/", params={"task_run_id": task_run_id})
    return sorted(states, key=lambda s: s["timestamp"])


def runs_under(
    url: str,
    flow_run_ids: list[str] | None = None,
    flow_name: str | None = None,
    wait: float = SETTLE_S,
    at_least: int = 0,
) -> list[dict]:
    """Task runs of these flow runs (or of every run of ``flow_name``), once at least ``at_least`` are
    recorded (the server records them from their events, a moment later) and none is unfinished (or
    after ``wait`` s)."""
    body: dict[str, Any] = {"limit": 200}
    if flow_run_ids is not None:
        body["flow_runs"] = {"id": {"any_": flow_run_ids}}
    if flow_name is not None:
        body["flows"] = {"name": {"any_": [flow_name]}}
    deadline = time.monotonic() + wait
    while True:
        runs = api(url, "POST", "/task_runs/filter", json=body)
        settled = len(runs) >= at_least and not any(r["state_type"] in UNFINISHED for r in runs)
        if settled or time.monotonic() > deadline:
            return runs
        time.sleep(0.25)


def flow_run(
    url: str, flow_run_id: str, want: Callable[[dict], bool] = lambda r: True, timeout: float = SETTLE_S
) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        run = api(url, "GET", f"/flow_runs/{flow_run_id}")
        if want(run) or time.monotonic() > deadline:
            return run
        time.sleep(0.25)


def db_rows(db: Path, sql: str) -> list[tuple]:
    """Rows of ``sql`` in a Prefect server's SQLite database (empty while it has no such table)."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=2)) as con:
            return con.execute(sql).fetchall()
    except sqlite3.Error:
        return []


def lost(runs: list[dict] | list[tuple[str, str]]) -> list[str]:
    """``name: STATE`` of the task runs left unfinished."""
    pairs = [(r["name"], r["state_type"]) if isinstance(r, dict) else r for r in runs]
    return [f"{name}: {state}" for name, state in pairs if state in UNFINISHED]


def msg(text: str | None, n: int = 120) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= n else text[: n - 1] + "…"


def flow_sees(url: str, flow_run_id: str) -> str:
    """``; flow run FAILED: "message"`` when the flow run did not complete, else nothing."""
    run = flow_run(url, flow_run_id, lambda r: r["state_type"] not in UNFINISHED, timeout=5)
    if run["state_type"] == "COMPLETED":
        return ""
    return f'; flow run {run["state_type"]}: "{msg(run["state"]["message"])}"'


def sees(states: list[dict]) -> str:
    """``Crashed → AwaitingRetry → Completed; Crashed: "message"`` (the first Crashed/Failed state's message,
    else the final state's)."""
    names = " → ".join(s["name"] for s in states if s["type"] not in ("PENDING", "RUNNING"))
    key = next((s for s in states if s["type"] in ("CRASHED", "FAILED")), states[-1] if states else None)
    if key is None:
        return "no state recorded"
    return f'{names}; {key["name"]}: "{msg(key["message"])}"' if key["message"] else names


# ---------------------------------------------------------------- flow scripts
PRELUDE = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, time
    from pathlib import Path
    from prefect import flow, task
    from prefect.context import FlowRunContext, TaskRunContext
    from gpu_tasks import ProfileTaskRunner, ResourceProfile, current_allocation, profile

    HERE = Path(__file__).resolve().parent

    def stamp(name):
        (HERE / name).write_text(repr(time.time()))

    def flow_run_id():
        return str(FlowRunContext.get().flow_run.id)

    def report(out):
        print("RESULT " + json.dumps(out, default=str), flush=True)
    """
)


@dataclass
class Ctx:
    """One scenario's surroundings: its directory, marker, environment and the shared server."""

    key: str
    url: str
    tmp: Path
    marker: str
    env: dict[str, str]

    def script(self, body: str, name: str | None = None) -> Path:
        path = self.tmp / f"{name or self.key}.py"
        path.write_text(PRELUDE + textwrap.dedent(body))
        return path

    def run(
        self, body: str, timeout: float = 240, env: dict[str, str] | None = None, require_result: bool = True
    ) -> dict:
        """Run a flow script to its end; its RESULT line as a dict (raises with its stderr if none,
        unless ``require_result`` is false: then only its exit status and stderr)."""
        path = self.script(body)
        proc = subprocess.run(
            [sys.executable, str(path)],
            cwd=self.tmp,
            env=env or self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        (self.tmp / "stderr").write_text(proc.stderr)
        found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if not found and not require_result:
            return {"returncode": proc.returncode, "stderr": proc.stderr}
        if not found:
            raise RuntimeError(
                f"{path.name} exited {proc.returncode} without a result: {proc.stderr[-1500:]}"
            )
        out = json.loads(found[-1][len("RESULT ") :])
        out["returncode"] = proc.returncode
        out["stderr"] = proc.stderr
        return out

    def stamp(self, name: str) -> float:
        return float((self.tmp / name).read_text())

    def start(self, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start ``args`` as a terminal would: leader of a process group of its own."""
        return subprocess.Popen(
            args,
            env=env or self.env,
            cwd=self.tmp,
            start_new_session=True,
            preexec_fn=terminal_signals,
            stdout=(self.tmp / "stdout").open("wb"),
            stderr=(self.tmp / "stderr").open("wb"),
        )

    def tail(self) -> str:
        path = self.tmp / "stderr"
        return path.read_bytes().decode(errors="replace")[-1500:] if path.exists() else ""


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


# ---------------------------------------------------------------- scenarios
# Each returns part of its row: sees, recovery_s, recovery (what was timed), lost (list), checks
# ({description: bool}), and any figures of its own. The harness adds leaks, timing and errors.


def ephemeral_api(ctx: Ctx) -> dict:
    home = ctx.tmp / "prefect-home"
    env = {k: v for k, v in ctx.env.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(home)
    out = ctx.run(
        """
        @task(tags=[profile("quarter")])
        def hold(i):
            time.sleep(0.2)
            return [i, list(current_allocation().devices)]

        QUARTER = ResourceProfile(name="quarter", gpus=0.25, idle_timeout=1)

        @flow(task_runner=ProfileTaskRunner(profiles=[QUARTER]))
        def newcomer():
            return {"flow_run_id": flow_run_id(), "results": [f.result() for f in hold.map(range(8))]}

        if __name__ == "__main__":
            report(newcomer())
        """,
        env=env,
    )
    db = home / "prefect.db"
    flows = db_rows(
        db,
        "select f.id, f.state_type, s.message from flow_run f "
        "left join flow_run_state s on s.id = f.state_id",
    )
    runs = db_rows(db, "select name, state_type, flow_run_id from task_run")
    completed = [r for r in runs if r[1] == "COMPLETED"]
    missing = [f"task {i}: no COMPLETED record" for i in range(8 - len(completed))]
    return {
        "sees": f"flow run {flows[0][1] if flows else 'not recorded'}; {len(completed)}/8 task runs "
        "COMPLETED "
        "in the flow's own (ephemeral) server" + (f'; "{msg(flows[0][2])}"' if flows and flows[0][2] else ""),
        "recovery_s": None,
        "recovery": "no fault injected: Prefect's default API, no PREFECT_API_URL",
        "lost": lost([(r[0], r[1]) for r in runs])
        + missing
        + [f"result {i} missing" for i in range(8 - len(out.get("results", [])))],
        "checks": {
            "script exit 0": out["returncode"] == 0,
            "no 'Server process did not start'": "Server process did not start" not in out["stderr"],
            "one flow run, COMPLETED": len(flows) == 1 and flows[0][1] == "COMPLETED",
            "8 task runs under that flow run": len(runs) == 8 and {r[2] for r in runs} == {flows[0][0]}
            if flows
            else False,
        },
    }


def worker_sigkill_once(ctx: Ctx) -> dict:
    out = ctx.run(
        """
        @task(tags=[profile("gpu")], retries=1)
        def dies_once():
            if not (HERE / "killed").exists():
                stamp("killed")
                os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would
            return list(current_allocation().devices)

        GPU = ResourceProfile(name="gpu", gpus=1, max_workers=1, idle_timeout=30)

        @flow(task_runner=ProfileTaskRunner(profiles=[GPU]))
        def one_death():
            future = dies_once.submit()
            devices = future.result()
            return {"flow_run_id": flow_run_id(), "task_run_id": str(future.task_run_id), "devices": devices}

        if __name__ == "__main__":
            report(one_death())
        """
    )
    run = task_run(
        ctx.url, out["task_run_id"], lambda r: r["state_type"] == "COMPLETED" and r["run_count"] == 2
    )
    states = task_states(ctx.url, out["task_run_id"])
    names = [s["name"] for s in states]
    done = [s for s in states if s["type"] == "COMPLETED"]
    return {
        "sees": sees(states),
        "states": names,
        "recovery_s": ts(done[-1]["timestamp"]) - ctx.stamp("killed") if done else None,
        "recovery": "SIGKILL → retried task run Completed (state timestamp)",
        "lost": lost(runs_under(ctx.url, [out["flow_run_id"]])),
        "checks": {
            "Crashed, AwaitingRetry, then Completed": "Crashed" in names
            and "AwaitingRetry" in names
            and names[-1] == "Completed",
            "run_count 2": run["run_count"] == 2,
            "result returned": out["devices"] in (["0"], ["1"]),
            "message names signal 9": any("signal 9" in (s["message"] or "") for s in states),
        },
    }


def worker_exits(ctx: Ctx) -> dict:
    out = ctx.run(
        """
        @task(tags=[profile("gpu")])
        def always_dies():
            stamp("exited")
            os._exit(3)

        @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="gpu", gpus=1, idle_timeout=30)]))
        def keeps_dying():
            future = always_dies.submit()
            future.wait()
            return {"flow_run_id": flow_run_id(), "task_run_id": str(future.task_run_id),
                    "state": future.state.type.value}

        if __name__ == "__main__":
            report(keeps_dying())
        """
    )
    run = task_run(ctx.url, out["task_run_id"], lambda r: r["state_type"] == "CRASHED")
    states = task_states(ctx.url, out["task_run_id"])
    message = run["state"]["message"] or ""
    return {
        "sees": sees(states),
        "states": [s["name"] for s in states],
        "recovery_s": ts(run["state"]["timestamp"]) - ctx.stamp("exited"),
        "recovery": "worker exit → task run Crashed (state timestamp)",
        "lost": lost(runs_under(ctx.url, [out["flow_run_id"]])),
        "checks": {
            "Crashed": run["state_type"] == "CRASHED",
            "message has the exit status": "exited with status 3" in message,
            "message names profile and device": "profile 'gpu'" in message and "device(s) " in message,
            "run_count 1 (no silent Dask re-run)": run["run_count"] == 1,
        },
    }


def _raises(exc: str) -> Callable[[Ctx], dict]:
    def scenario(ctx: Ctx) -> dict:
        out = ctx.run(
            f"""
            @task(tags=[profile("gpu")])
            def interrupts():
                stamp("raised")
                raise {exc}()

            @task(tags=[profile("gpu")])
            def fine():
                return 7

            GPU = ResourceProfile(name="gpu", gpus=1, max_workers=1)

            @flow(task_runner=ProfileTaskRunner(profiles=[GPU]))
            def interrupted_task():
                future = interrupts.submit()
                future.wait()
                return {{"flow_run_id": flow_run_id(), "task_run_id": str(future.task_run_id),
                        "after": fine.submit().result()}}

            if __name__ == "__main__":
                report(interrupted_task())
            """
        )
        run = task_run(ctx.url, out["task_run_id"], lambda r: r["state_type"] == "CRASHED")
        states = task_states(ctx.url, out["task_run_id"])
        flow = flow_run(ctx.url, out["flow_run_id"], lambda r: r["state_type"] == "COMPLETED")
        return {
            "sees": sees(states) + f"; flow run {flow['state_type']}",
            "states": [s["name"] for s in states],
            "recovery_s": ts(run["state"]["timestamp"]) - ctx.stamp("raised"),
            "recovery": "raise → task run Crashed (state timestamp)",
            "lost": lost(runs_under(ctx.url, [out["flow_run_id"]])),
            "checks": {
                "task run Crashed": run["state_type"] == "CRASHED",
                "run_count 1": run["run_count"] == 1,
                "flow continues: next task returns": out["after"] == 7,
                "flow run Completed": flow["state_type"] == "COMPLETED",
            },
        }

    return scenario


def nested_one_slot(ctx: Ctx) -> dict:
    out = ctx.run(
        """
        CORES = os.cpu_count() or 1

        @task(tags=[profile("g")])
        def leaf_g(x): return x + 1
        @task(tags=[profile("g")])
        def middle_g(x): return sum(f.result() for f in [leaf_g.submit(x), leaf_g.submit(x + 10)])
        @task(tags=[profile("g")])
        def top_g(x): return middle_g.submit(x).result() * 10, list(current_allocation().devices)

        @task(tags=[profile("c")])
        def leaf_c(x): return x + 1
        @task(tags=[profile("c")])
        def middle_c(x): return sum(f.result() for f in [leaf_c.submit(x), leaf_c.submit(x + 10)])
        @task(tags=[profile("c")])
        def top_c(x): return middle_c.submit(x).result() * 10, list(current_allocation().devices)

        @flow(task_runner=ProfileTaskRunner(profiles=[
            ResourceProfile(name="g", gpus=1, max_workers=1),  # one whole device, one slot
            ResourceProfile(name="c", cpus=CORES),  # every core: one slot
        ]))
        def nested():
            t0 = time.monotonic()
            gpu = top_g.submit(1).result(timeout=120)
            cpu = top_c.submit(1).result(timeout=120)
            return {"flow_run_id": flow_run_id(), "gpu": gpu, "cpu": cpu, "seconds": time.monotonic() - t0}

        if __name__ == "__main__":
            report(nested())
        """
    )
    runs = runs_under(ctx.url, [out["flow_run_id"]], at_least=8)  # top, middle, 2 leaves per profile
    done = sum(r["state_type"] == "COMPLETED" for r in runs)
    return {
        "sees": f"both chains return 140; {done}/{len(runs)} task runs COMPLETED (top → middle → 2 leaves, "
        "per profile)",
        "recovery_s": out["seconds"],
        "recovery": "no fault: time for both nested chains (no deadlock)",
        "lost": lost(runs)
        + [
            f"{r['name']}: {r['state_type']}"
            for r in runs
            if r["state_type"] not in UNFINISHED | {"COMPLETED"}
        ],
        "checks": {
            "gpu chain returns 140 on one device": out["gpu"][0] == 140 and len(out["gpu"][1]) == 1,
            "cpu chain returns 140": out["cpu"][0] == 140,
            "8 task runs recorded": len(runs) == 8,
        },
    }


OOM_TASKS = """
SMALL = dict(name="small", gpus=1, max_workers=1, memory="700MiB")  # the nanny kills a worker past 95% of it

@task(tags=[profile("small")])
def hog():
    stamp("allocating")
    block = bytearray(1536 * 2**20)  # 1.5 GiB, touched: resident
    time.sleep(5)  # the nanny checks memory every 100 ms
    return f"{current_allocation().profile}:{len(block)}"

@task(tags=[profile("small")])
def cuda_oom():
    if current_allocation().profile == "small":
        run = TaskRunContext.get().task_run
        ids = {"flow_run_id": str(run.flow_run_id), "task_run_id": str(run.id)}
        (HERE / "ids").write_text(json.dumps(ids))
        stamp("raised")
        raise MemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    return current_allocation().profile
"""


def memory_killed(ctx: Ctx) -> dict:
    out = ctx.run(
        OOM_TASKS
        + textwrap.dedent(
            """
        @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(**SMALL)]))
        def too_big():
            future = hog.submit()
            future.wait()
            return {"flow_run_id": flow_run_id(), "task_run_id": str(future.task_run_id)}

        if __name__ == "__main__":
            report(too_big())
        """
        )
    )
    run = task_run(ctx.url, out["task_run_id"], lambda r: r["state_type"] not in UNFINISHED)
    states = task_states(ctx.url, out["task_run_id"])
    message = run["state"]["message"] or ""
    return {
        "sees": sees(states),
        "states": [s["name"] for s in states],
        "recovery_s": ts(run["state"]["timestamp"]) - ctx.stamp("allocating"),
        "recovery": "allocation starts → task run Crashed (state timestamp)",
        "lost": lost(runs_under(ctx.url, [out["flow_run_id"]])),
        "checks": {
            "Crashed": run["state_type"] == "CRASHED",
            "message says Out of memory, profile, device, limit": all(
                w in message for w in ("Out of memory", "profile 'small'", "device(s) ", "memory limit")
            ),
        },
    }


def oom_raised(ctx: Ctx) -> dict:
    out = ctx.run(
        OOM_TASKS
        + textwrap.dedent(
            """
        @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(**SMALL)]))
        def raises_oom():
            future = cuda_oom.submit()
            future.wait()
            return {"flow_run_id": flow_run_id(), "task_run_id": str(future.task_run_id)}

        if __name__ == "__main__":
            report(raises_oom())
        """
        ),
        require_result=False,
    )
    out = {**json.loads((ctx.tmp / "ids").read_text()), **out}  # the ids, even when the script failed
    run = task_run(ctx.url, out["task_run_id"], lambda r: r["state_type"] not in UNFINISHED)
    states = task_states(ctx.url, out["task_run_id"])
    message = run["state"]["message"] or ""
    return {
        "sees": sees(states) + flow_sees(ctx.url, out["flow_run_id"]),
        "states": [s["name"] for s in states],
        "recovery_s": ts(run["state"]["timestamp"]) - ctx.stamp("raised"),
        "recovery": "raise → task run Failed (state timestamp)",
        "lost": lost(runs_under(ctx.url, [out["flow_run_id"]])),
        "checks": {
            "flow script completes (exit 0)": out["returncode"] == 0,
            "Failed": run["state_type"] == "FAILED",
            "message names error, profile, device and on_oom": all(
                w in message
                for w in ("GpuOutOfMemoryError", "out of memory on profile 'small'", "device(s) ", "on_oom")
            ),
        },
    }


UNPICKLE_NOTE = (
    "the task's GpuOutOfMemoryError reached the flow process but could not be unpickled there: distributed "
    "imports tblib's pickling support, which registers a reducer for every exception class defined by then; "
    "a script that imports gpu_tasks before distributed (as any user script does) gets one for "
    "GpuOutOfMemoryError(GpuTasksError, MemoryError), and its unpickler calls MemoryError.__new__ on it "
    "(TypeError)"
)


def known_cause(row: dict) -> str:
    """A row's note: its own, or the known cause of what it shows (applied when rendering, so a
    re-render with ``--report-only`` explains results already taken)."""
    if row.get("note"):
        return str(row["note"])
    if "MemoryError.__new__(GpuOutOfMemoryError) is not safe" in (row.get("sees") or ""):
        return UNPICKLE_NOTE
    return ""


def oom_escalated(ctx: Ctx) -> dict:
    out = ctx.run(
        OOM_TASKS
        + textwrap.dedent(
            """
        @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(**SMALL, on_oom="big"),
                                                      ResourceProfile(name="big", gpus=1, max_workers=1)]))
        def escalates():
            future = cuda_oom.submit()
            result = future.result()
            return {"flow_run_id": flow_run_id(), "task_run_id": str(future.task_run_id), "result": result}

        if __name__ == "__main__":
            report(escalates())
        """
        ),
        require_result=False,
    )
    out = {
        **json.loads((ctx.tmp / "ids").read_text()),
        "result": None,
        **out,
    }  # the ids, even when the script failed
    run = task_run(
        ctx.url,
        out["task_run_id"],
        lambda r: r["state_type"] == "COMPLETED" and r["run_count"] == 2,
        timeout=SETTLE_S if out["returncode"] == 0 else 5,
    )
    states = task_states(ctx.url, out["task_run_id"])
    done = [s for s in states if s["type"] == "COMPLETED"]
    return {
        "sees": sees(states)
        + (f"; result from profile '{out['result']}'" if out["result"] else "")
        + flow_sees(ctx.url, out["flow_run_id"]),
        "states": [s["name"] for s in states],
        "recovery_s": ts(done[-1]["timestamp"]) - ctx.stamp("raised") if done else None,
        "recovery": "raise on 'small' → task run Completed on 'big' (state timestamp)",
        "lost": lost(runs_under(ctx.url, [out["flow_run_id"]])),
        "checks": {
            "flow script completes (exit 0)": out["returncode"] == 0,
            "Completed on big": run["state_type"] == "COMPLETED" and out["result"] == "big",
            "run_count 2": run["run_count"] == 2,
        },
    }


def flow_sigkilled(ctx: Ctx) -> dict:
    ready = ctx.tmp / "ready"
    ready.mkdir()
    path = ctx.script(
        """
        @task(tags=[profile("gpu")])
        def gpu_task_with_a_child(i):
            child = subprocess.Popen(["sleep", "300"])
            flow_run = TaskRunContext.get().task_run.flow_run_id
            (HERE / "ready" / f"task-{i}").write_text(f"{os.getpid()} {child.pid} {flow_run}")
            time.sleep(300)

        @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="gpu", gpus=1)]))
        def doomed():
            [f.result() for f in gpu_task_with_a_child.map(range(2))]

        if __name__ == "__main__":
            doomed()
        """,
        name="doomed",
    )
    proc = ctx.start([sys.executable, str(path)])
    try:
        deadline = time.monotonic() + 120
        while len(list(ready.iterdir())) < 2:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the GPU tasks never started (exit {proc.poll()}): {ctx.tail()}")
            time.sleep(0.2)
        time.sleep(0.3)  # the ready files are written whole
        notes = [f.read_text().split() for f in ready.iterdir()]
        killed_flow = notes[0][2]
        before = [p for p in marked(ctx.marker) if p.pid != proc.pid]
        workers_and_children = {int(n[0]) for n in notes} | {int(n[1]) for n in notes}
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        took, survivors = wait_gone(ctx.marker, LEAK_GRACE_S)
    finally:
        stop(proc)
        kill_marked(ctx.marker)
    # the next flow run, a fresh process on the same devices (and lease directory)
    out = ctx.run(
        """
        import tempfile
        from pathlib import Path
        from prefect import unmapped

        @task(tags=[profile("gpu")])
        def visible_device(i, folder):
            # a rendezvous: both tasks hold a device at once (a second worker may start slowly)
            Path(folder, str(i)).write_text("")
            deadline = time.monotonic() + 60
            while len(list(Path(folder).iterdir())) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            return os.environ.get("CUDA_VISIBLE_DEVICES", "")

        @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="gpu", gpus=1, idle_timeout=0.5)]))
        def next_run():
            meet = tempfile.mkdtemp()
            devices = [f.result() for f in visible_device.map(range(2), unmapped(meet))]
            startup = FlowRunContext.get().task_runner.status()["gpu"]["startup"]
            waited = startup["wait_devices_s"]
            return {"flow_run_id": flow_run_id(), "devices": devices, "wait_devices_s": waited}

        if __name__ == "__main__":
            report(next_run())
        """
    )
    killed_runs = runs_under(ctx.url, [killed_flow], wait=5)
    killed_flow_run = flow_run(ctx.url, killed_flow)
    stale = lost(killed_runs)
    return {
        "sees": f"all {len(before)} worker and `sleep` child processes gone in {took:.2f} s; next run got "
        "devices "
        f"{sorted(out['devices'])} after {out['wait_devices_s']:.3f} s; the killed run's records: flow run "
        f"{killed_flow_run['state_type']}, task runs {sorted(r['state_type'] for r in killed_runs)}",
        "recovery_s": took,
        "recovery": "flow SIGKILL → last worker and child gone",
        "next_run_wait_devices_s": out["wait_devices_s"],
        "lost": stale + lost(runs_under(ctx.url, [out["flow_run_id"]])),
        "note": (
            "the killed flow run and its task runs stay Running on the server: the SIGKILLed flow process "
            "cannot report them, and the workers' guard (gpu_tasks.worker.guard) ends the workers without "
            "reporting their task runs Crashed"
        )
        if stale
        else "",
        "leaked_at_kill": survivors,
        "checks": {
            "workers and children carried the marker": workers_and_children <= {p.pid for p in before},
            "all gone within 10 s": not survivors,
            "next run got both devices": sorted(out["devices"]) == ["0", "1"],
            "next run waited < 1 s for devices": out["wait_devices_s"] < 1.0,
        },
    }


def ctrl_c_flow_script(ctx: Ctx) -> dict:
    path = ctx.script(
        """
        @task(tags=[profile("gpu")])
        def long_gpu_task():
            (HERE / "ready").write_text(str(TaskRunContext.get().task_run.flow_run_id))
            time.sleep(300)

        @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="gpu", gpus=1)]))
        def interrupted():
            long_gpu_task.submit().result()

        if __name__ == "__main__":
            interrupted()
        """
    )
    ready = ctx.tmp / "ready"
    proc = ctx.start([sys.executable, str(path)])
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() or not ready.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the GPU task never started (exit {proc.poll()}): {ctx.tail()}")
            time.sleep(0.2)
        time.sleep(0.5)
        took = ctrl_c(proc)
    finally:
        stop(proc)
    flow_run_id = ready.read_text()
    runs = runs_under(ctx.url, [flow_run_id], at_least=1)
    flow = flow_run(ctx.url, flow_run_id, lambda r: r["state_type"] in ("CRASHED", "CANCELLED"))
    return {
        "sees": f'exit {proc.returncode}; flow run {flow["state_type"]}: "{msg(flow["state"]["message"])}"; '
        f"task runs {sorted(r['state_type'] for r in runs)}",
        "recovery_s": took,
        "recovery": "Ctrl-C (SIGINT to the group) → script exits",
        "lost": lost(runs),
        "checks": {
            "exits within 10 s": took < 10,
            "non-zero exit": proc.returncode != 0,
            "flow run Crashed or Cancelled": flow["state_type"] in ("CRASHED", "CANCELLED"),
            "task run recorded": bool(runs),
        },
    }


def ctrl_c_cli(ctx: Ctx) -> dict:
    home = ctx.tmp / "prefect-home"
    db = home / "prefect.db"
    env = {k: v for k, v in ctx.env.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(home)
    # a few thousand flights keep ingest and ETL short; a million rounds keep training busy
    proc = ctx.start(
        [
            sys.executable,
            "-m",
            "gpu_tasks.cli",
            "example",
            "run",
            "--limit",
            "5000",
            "--rounds",
            "1000000",
            "--data-dir",
            str(ctx.tmp / "data"),
        ],
        env=env,
    )
    try:
        deadline = time.monotonic() + 180
        while not db_rows(
            db, "select id from task_run where state_type = 'RUNNING' and tags like '%\"profile:gpu-train\"%'"
        ):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"training never started (exit {proc.poll()}): {ctx.tail()}")
            time.sleep(0.3)
        time.sleep(1.0)  # into the stage, past its first boosting rounds
        took = ctrl_c(proc)
    finally:
        stop(proc)
    err = ctx.tail()
    flows = db_rows(
        db, "select f.state_type, s.message from flow_run f left join flow_run_state s on s.id = f.state_id"
    )
    runs = db_rows(db, "select name, state_type from task_run")
    return {
        "sees": f"exit {proc.returncode}; flow run(s) {[f[0] for f in flows]}"
        + (f': "{msg(flows[0][1])}"' if flows and flows[0][1] else "")
        + f"; task runs {sorted({s for _, s in runs})}",
        "recovery_s": took,
        "recovery": "Ctrl-C (SIGINT to the group) → `gpu-tasks example run` exits",
        "lost": lost(runs),
        "checks": {
            "exits within 10 s": took < 10,
            "exit 130": proc.returncode == 130,
            "says interrupted (Ctrl-C) and where the database is, no traceback": "interrupted (Ctrl-C)" in err
            and str(db) in err
            and "Traceback" not in err,
            "flow runs Crashed or Cancelled": bool(flows)
            and all(f[0] in ("CRASHED", "CANCELLED") for f in flows),
            "train task run recorded": any(name.startswith("train") for name, _ in runs),
        },
    }


def soak(ctx: Ctx, runs: int = 20) -> dict:
    script = ROOT / "tests" / "faults" / "soak_script.py"
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script), "--runs", str(runs), "--json"],
        env=ctx.env,
        cwd=ctx.tmp,
        capture_output=True,
        text=True,
        timeout=540,
    )
    if done.returncode != 0:
        raise RuntimeError(f"soak_script exited {done.returncode}: {done.stderr[-1500:]}")
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    by_run = {r["run"]: r for r in rows}
    first, base, last = by_run[1], by_run[min(5, runs)], by_run[runs]
    records = runs_under(ctx.url, flow_name="soak-run", at_least=4 * runs)
    done_runs = sum(r["state_type"] == "COMPLETED" for r in records)
    return {
        "sees": f"{runs} flow runs in one process; {done_runs}/{4 * runs} task runs COMPLETED; every cluster "
        f"idled out ({sorted({r['state_after_idle'] for r in rows})}); fds {base['fds']}→{last['fds']}, "
        f"threads {base['threads']}→{last['threads']}, RSS {base['rss_mb']}→{last['rss_mb']} MB "
        f"(run {min(5, runs)}→{runs})",
        "recovery_s": None,
        "recovery": f"no fault: {runs} runs took {time.monotonic() - t0:.0f} s",
        "lost": lost(records) + [f"task run {i}: no COMPLETED record" for i in range(4 * runs - done_runs)],
        "soak": [by_run[n] for n in SOAK_AT if n in by_run],
        "checks": {
            "every cluster closed after idling": {r["state_after_idle"] for r in rows} == {"closed"},
            "fds flat (+5)": last["fds"] <= base["fds"] + 5,
            "threads flat (+3)": last["threads"] <= base["threads"] + 3,
            "children not growing": last["children"] <= first["children"],
            "RSS growth < 30 MB": last["rss_mb"] - base["rss_mb"] < 30,
        },
    }


SCENARIOS: list[tuple[str, str, Callable[[Ctx], dict]]] = [
    (
        "ephemeral_api",
        "Prefect's default ephemeral API (no server, no PREFECT_API_URL): 8 tasks on gpus=0.25",
        ephemeral_api,
    ),
    ("worker_sigkill_once", "GPU worker SIGKILLed once mid-task; task has retries=1", worker_sigkill_once),
    ("worker_exits", "GPU worker exits (`os._exit(3)`) every time; no retries", worker_exits),
    ("task_keyboard_interrupt", "task raises KeyboardInterrupt (GPU profile)", _raises("KeyboardInterrupt")),
    ("task_system_exit", "task raises SystemExit (GPU profile)", _raises("SystemExit")),
    (
        "nested_one_slot",
        "nested submission (task → task → 2 tasks) on one-slot profiles: gpus=1 max_workers=1, "
        "and cpus=all cores",
        nested_one_slot,
    ),
    (
        "memory_killed",
        "worker killed for memory: profile memory=700MiB, task allocates 1.5 GiB",
        memory_killed,
    ),
    ("oom_raised", "task raises CUDA out-of-memory (MemoryError)", oom_raised),
    ("oom_escalated", "task raises CUDA out-of-memory; profile has on_oom='big'", oom_escalated),
    (
        "flow_sigkilled",
        "flow process SIGKILLed while 2 GPU tasks run (each with a `sleep 300` child)",
        flow_sigkilled,
    ),
    (
        "ctrl_c_flow_script",
        "Ctrl-C (SIGINT to the process group) on a flow script mid GPU task",
        ctrl_c_flow_script,
    ),
    ("ctrl_c_cli", "Ctrl-C on `gpu-tasks example run` mid training (its embedded server)", ctrl_c_cli),
    (
        "soak",
        "soak: 20 flow runs in one process, each provisioning a gpus=0.5 profile and idling it out",
        soak,
    ),
]


def scenario_env(base: dict[str, str], url: str, marker: str, lease_dir: Path) -> dict[str, str]:
    """The user's environment less gpu-tasks and Prefect API settings, plus two emulated devices,
    the shared server, a Prefect home, lease and presence directories of the scenario's own (no other
    run's leases) and a marker every descendant inherits."""
    env = {k: v for k, v in base.items() if not k.startswith(("GPU_TASKS_", "PREFECT_API_URL"))}
    env.update(
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        GPU_TASKS_EMULATED_GPUS="2",
        PREFECT_API_URL=url,
        PREFECT_HOME=str(lease_dir.parent / "prefect-home"),
        GPU_TASKS_LEASE_DIR=str(lease_dir),
        GPU_TASKS_PRESENCE_DIR=str(lease_dir.parent / "presence"),
        GPU_TASKS_TEST_MARKER=marker,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), base.get("PYTHONPATH")])),
    )
    return env


def run_scenario(
    key: str, fault: str, fn: Callable[[Ctx], dict], url: str, root: Path, base_env: dict[str, str]
) -> dict:
    """One scenario, whatever happens: its row, with leaked processes counted and leftovers killed."""
    marker = uuid.uuid4().hex
    tmp = root / key
    (tmp / "leases").mkdir(parents=True)
    ctx = Ctx(key, url, tmp, marker, scenario_env(base_env, url, marker, tmp / "leases"))
    row: dict[str, Any] = {"key": key, "fault": fault}
    t0 = time.monotonic()
    try:
        row.update(fn(ctx))
    except Exception as exc:  # a failed scenario is reported; the others still run
        row["error"] = f"{type(exc).__name__}: {exc}"
        row["traceback"] = traceback.format_exc()[-3000:]
    finally:
        _, left = wait_gone(marker, LEAK_GRACE_S)
        kill_marked(marker)
    row["leaked_cmds"] = row.pop("leaked_at_kill", []) + left
    row["leaked"] = len(row["leaked_cmds"])
    row["lost"] = row.get("lost", [])
    row["checks"] = row.get("checks", {})
    row["ok"] = "error" not in row and all(row["checks"].values()) and not row["leaked"] and not row["lost"]
    row["seconds"] = round(time.monotonic() - t0, 1)
    if isinstance(row.get("recovery_s"), float):
        row["recovery_s"] = round(row["recovery_s"], 2)
    return row


# ---------------------------------------------------------------- the report
def render(results: dict[str, Any]) -> str:
    """docs/reliability.md from the results: one row per scenario, then the soak figures."""
    suite = results["suite"]
    rows = results["scenarios"]
    n_ok = sum(r["ok"] for r in rows)
    out = [
        "# Reliability",
        "",
        "<!-- generated by `python -m bench.faults` (or `python -m bench --only faults`); "
        "edit bench/faults.py, not this file -->",
        "",
        f"Every fault we tried, from one run of `python -m bench.faults` on {suite['finished']} "
        f"(commit {suite['commit']}), {suite['seconds']:.0f} s in all: **{n_ok} of {len(rows)} scenarios "
        "passed**. "
        f"Machine: {describe(suite['machine'])}. Raw results: [results/faults.json](results/faults.json).",
        "",
        "**Devices were EMULATED** (`GPU_TASKS_EMULATED_GPUS=2`: real Dask worker processes, each with its "
        "own "
        '`CUDA_VISIBLE_DEVICES`, compute on the CPU). The "CUDA out of memory" faults are raised errors, '
        "not a real GPU running out of memory (a real one, on an H200 and an H100: "
        "[gpu.md: out-of-memory](gpu.md#out-of-memory)). Nothing here is a GPU measurement; it tests "
        "processes, signals and the states Prefect records.",
        "",
        "Each scenario is a fresh flow script (or `gpu-tasks example run`) in a subprocess, as a user "
        "would run it, against one Prefect server (the first and the `gpu-tasks example run` ones use "
        "their own, as a user's would). "
        "*What the user sees* is what the server recorded: the state names in order and the first 120 "
        "characters "
        "of the message. *Processes leaked*: processes of the scenario (found by an environment marker every "
        "descendant inherits) still alive 10 s after it ended. *Tasks lost*: task runs left Running/Pending "
        "on the "
        "server, or results missing. Both must be 0 for a row to pass, as must the scenario's own checks "
        "(listed below the table).",
        "",
        "| # | Fault | What the user sees | Recovery (s) | Recovery measured as | Processes leaked | Tasks "
        "lost | Result |",
        "| ---: | --- | --- | ---: | --- | ---: | ---: | --- |",
    ]
    for i, r in enumerate(rows, 1):
        rec = "—" if r.get("recovery_s") is None else f"{r['recovery_s']:.2f}"
        sees_text = r.get("sees") or f"scenario failed: {msg(r.get('error'), 200)}"
        result = "pass" if r["ok"] else "**FAIL**"
        out.append(
            f"| {i} | {_cell(r['fault'])} | {_cell(sees_text)} | {rec} | {_cell(r.get('recovery', '—'))} "
            f"| {r['leaked']} | {len(r['lost'])} | {result} |"
        )
    soak_rows = next((r.get("soak") for r in rows if r.get("soak")), None)
    if soak_rows:
        out += [
            "",
            "## Soak: one process, many flow runs",
            "",
            "`tests/faults/soak_script.py --runs 20`: each flow run provisions a `gpus=0.5` profile, runs 4 "
            "tasks "
            "and lets the cluster idle out (0.3 s) inside the flow. The process's own figures after run N "
            "(children less multiprocessing's resource tracker):",
            "",
            "| after run | open fds | threads | child processes | RSS (MB) | run took (s) |",
            "| ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for s in soak_rows:
            out.append(
                f"| {s['run']} | {s['fds']} | {s['threads']} | {s['children']} | {s['rss_mb']:g} "
                f"| {s['seconds']:g} |"
            )
    out += ["", "## Checks per scenario", ""]
    for i, r in enumerate(rows, 1):
        marks = "; ".join(f"{name}: {'yes' if ok else '**no**'}" for name, ok in r["checks"].items())
        out.append(f"{i}. `{r['key']}` ({r['seconds']:g} s): {marks or 'no checks ran'}")
        if r.get("error"):
            out.append(f"   - error: `{msg(r['error'], 300)}`")
        if r["leaked_cmds"]:
            out.append(f"   - leaked: {'; '.join(f'`{c}`' for c in r['leaked_cmds'])}")
        if r["lost"]:
            out.append(f"   - lost: {', '.join(r['lost'])}")
        if known_cause(r):
            out.append(f"   - note: {known_cause(r)}")
    out += [
        "",
        "## How to regenerate",
        "",
        "`python -m bench.faults` (or `python -m bench --only faults`; a plain `python -m bench` leaves it "
        "out) "
        "reruns every scenario and rewrites this page and `docs/results/faults.json`, in about "
        f"{max(1, round(suite['seconds'] / 60))} minutes here; `--only KEY ...` runs some (and writes only "
        "those), "
        "`--report-only` re-renders. The same faults are asserted in `tests/faults/` (`./scripts/test -m "
        "faults`).",
        "",
    ]
    return "\n".join(out)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def write(results: dict[str, Any], out: Path) -> None:
    (out / "results").mkdir(parents=True, exist_ok=True)
    (out / "results" / "faults.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (out / "reliability.md").write_text(render(results))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=ROOT / "docs", help="where reliability.md and results/ go"
    )
    parser.add_argument("--only", nargs="+", choices=[k for k, _, _ in SCENARIOS], help="run only these")
    parser.add_argument("--quick", action="store_true", help="soak with 5 runs instead of 20")
    parser.add_argument(
        "--report-only", action="store_true", help="re-render reliability.md from results/faults.json"
    )
    args = parser.parse_args(argv)
    if args.report_only:
        write(json.loads((args.out / "results" / "faults.json").read_text()), args.out)
        print(f"wrote {args.out / 'reliability.md'}")
        return 0
    base_env = dict(os.environ)  # what scenarios inherit: the user's environment, not this harness's settings
    # this process only serves the API: its own server in a temporary home, never the user's
    os.environ.pop("PREFECT_API_URL", None)
    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="gpu-tasks-faults-prefect-")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ["GPU_TASKS_EMULATED_GPUS"] = "2"
    from gpu_tasks.prefect_api.server import embedded_server

    plan = [s for s in SCENARIOS if not args.only or s[0] in args.only]
    root = Path(tempfile.mkdtemp(prefix="gpu-tasks-faults-"))
    t0 = time.monotonic()
    rows = []
    with embedded_server() as url:
        for key, fault, fn in plan:
            if key == "soak" and args.quick:
                fn = lambda ctx: soak(ctx, runs=5)  # noqa: E731
            print(f"== {key}", flush=True)
            row = run_scenario(key, fault, fn, url, root, base_env)
            print(
                f"   {'pass' if row['ok'] else 'FAIL'} in {row['seconds']:.0f}s: recovery "
                f"{row.get('recovery_s')} s, "
                f"leaked {row['leaked']}, lost {len(row['lost'])}"
                + (f"; {row['error']}" if row.get("error") else ""),
                flush=True,
            )
            rows.append(row)
    results = {
        "suite": {
            "machine": machine(),
            "commit": commit(),
            "seconds": round(time.monotonic() - t0, 1),
            "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "quick": args.quick,
        },
        "scenarios": rows,
    }
    write(results, args.out)
    print(
        f"wrote {args.out / 'reliability.md'} and {args.out / 'results' / 'faults.json'} "
        f"in {results['suite']['seconds']:.0f}s; scratch files in {root}"
    )
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
