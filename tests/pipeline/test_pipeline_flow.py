"""The ETL -> train flow end to end on emulated devices, each stage on its own profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpu_tasks.pipeline.errors import PipelineInputError


def etl_train(**kwargs):
    """The example flow, imported when a test runs it: its runner checks Prefect's home when built, and
    test modules do no I/O at import (tests/test_environment.py collects the suite on a bad home)."""
    from gpu_tasks.pipeline import etl_train as flow

    return flow(**kwargs)


pytestmark = pytest.mark.usefixtures("no_leaked_processes", "emulated")


def test_pipeline_runs_each_stage_on_its_profile(tmp_path: Path):
    out = etl_train(scale=1, data_dir=str(tmp_path), limit=30000, num_rounds=30)
    stages = out["stages"]
    assert stages["ingest"]["profile"] == "cpu" and stages["ingest"]["devices"] == []
    assert stages["etl"]["profile"] == "gpu-etl" and stages["etl"]["emulated"] is True
    assert stages["etl"]["backend"] == "pandas", "emulated devices must not claim cuDF"
    assert len(stages["etl"]["devices"]) == 1
    assert stages["train"]["profile"] == "gpu-train" and stages["train"]["device"] == "cpu"
    assert stages["train"]["emulated"] is True and len(stages["train"]["devices"]) == 1
    assert stages["evaluate"]["profile"] == "cpu"
    m = out["metrics"]
    assert 0.5 < m["auc"] <= 1 and 0 < m["baseline_auc"] <= 1 and m["logloss"] > 0
    assert Path(out["model_path"]).is_file()
    assert not list((tmp_path / "scale-1" / "runs").iterdir()), "the run's raw/ and features/ went with it"
    saved = json.loads(Path(out["metrics_path"]).read_text())
    assert saved["auc"] == pytest.approx(m["auc"])
    assert out["rows"]["train"] + out["rows"]["test"] <= 30000
    # clusters of the GPU profiles were provisioned during the run
    assert out["clusters"]["gpu-etl"]["state"] in {"running", "closed"}
    # the Prefect UI shows training progress, final metrics and the resource ledger
    arts = {a["key"]: a for a in _artifacts(out["flow_run_id"])}
    assert {"training-progress", "model-metrics", "resource-ledger"} <= set(arts), sorted(arts)
    assert arts["training-progress"]["data"] == 100.0
    table = json.loads(arts["model-metrics"]["data"])
    assert table[0]["metric"] == "AUC" and table[0]["model"] == pytest.approx(m["auc"], abs=1e-4)
    ledger = {row["profile"]: row for row in json.loads(arts["resource-ledger"]["data"])}
    assert {"gpu-etl", "gpu-train"} <= set(ledger) and ledger["gpu-train"]["devices"] != "none (CPU)"
    assert "EMULATED" in arts["resource-ledger"]["description"]  # device cells leave it to the description


def _artifacts(flow_run_id: str) -> list[dict]:
    from prefect_api import api

    code, body = api(
        "POST", "/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}}
    )
    assert code == 200, body
    return body


def test_multi_device_training_runs_as_a_gang(tmp_path: Path, monkeypatch):
    profiles = tmp_path / "profiles.toml"
    profiles.write_text(
        'default = "cpu"\n[profiles.cpu]\ncpus = 1\n'
        "[profiles.gpu-etl]\ngpus = 1\nidle_timeout = 1\n"
        "[profiles.gpu-train]\ngpus = 2\nidle_timeout = 1\n"
    )
    monkeypatch.setenv("GPU_TASKS_PROFILES_FILE", str(profiles))
    out = etl_train(scale=1, data_dir=str(tmp_path), limit=20000, num_rounds=10)
    train = out["stages"]["train"]
    assert sorted(train["devices"]) == ["0", "1"], "the training task holds both devices"
    assert out["metrics"]["auc"] > 0.5


@pytest.mark.parametrize(
    ("name", "value"), [("scale", 0), ("scale", -3), ("num_rounds", 0), ("holdout_months", 12), ("limit", 10)]
)
def test_a_bad_parameter_fails_before_any_cluster_starts(tmp_path: Path, name: str, value: int):
    """Named in the error, before ingest (nothing written) or a device lease: num_rounds=0 failed in
    training, after ingest and ETL ran on a leased device."""
    with pytest.raises(PipelineInputError, match=f"^{name} must be"):
        etl_train(**{"scale": 1, "limit": 1000, name: value}, data_dir=str(tmp_path))
    assert not list(tmp_path.iterdir()), "nothing was written"


STOPPED_MID_STAGE = """
import pathlib, sys, time
from prefect import flow, task
from gpu_tasks import ProfileTaskRunner, ResourceProfile, profile
from gpu_tasks.pipeline._io import remove_when_ended

work = pathlib.Path(sys.argv[1])
(work / "features").mkdir(parents=True)
(work / "features" / "part-0.parquet").write_text("rows")
started = work.parent / "started"

@task(tags=[profile("gpu")])
def stage(path):  # a stage that reads its input for a while, as training does
    pathlib.Path(started).write_text("1")
    for _ in range(400):
        if not pathlib.Path(path).exists():
            raise FileNotFoundError(path)
        time.sleep(0.05)
    return "read"

@flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="gpu", gpus=1)]))
def stopped():
    future = stage.submit(str(work / "features" / "part-0.parquet"))
    print("TASK", future.task_run_id, flush=True)
    while not started.exists():
        time.sleep(0.05)
    try:
        raise KeyboardInterrupt  # a Ctrl-C in the flow thread while the stage runs
    except BaseException:
        remove_when_ended(work, [future])
        raise

stopped()
"""


def test_a_run_stopped_mid_stage_removes_its_files_after_the_stage_ended(tmp_path: Path):
    """A run stopped while a stage runs (a Ctrl-C in `gpu-tasks example run` during training) removes
    its intermediate files only once that stage ended: removed at once, the stage still running failed
    with "train features directory ... does not exist (run the ETL stage first)" (seen once in the
    fault table's Ctrl-C scenario) instead of ending Crashed with its stopped flow run. The files are
    gone when the script has exited, and no process is left."""
    import uuid

    from faults._procs import kill_marked, run_flow_script, server_task_run, wait_gone
    from prefect.settings import get_current_settings

    marker = uuid.uuid4().hex
    work = tmp_path / "runs" / "one"
    try:
        out = run_flow_script(
            tmp_path,
            "stopped.py",
            STOPPED_MID_STAGE.replace("sys.argv[1]", repr(str(work))),
            marker,
            str(get_current_settings().api.url),
            120,
        )
        _, left = wait_gone(marker, timeout=10)
        assert not left, f"processes outlived the script: {left}"
    finally:
        kill_marked(marker)
    assert out.returncode != 0 and "KeyboardInterrupt" in out.stderr, out.stderr[-3000:]
    [task_run_id] = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("TASK ")]
    run = server_task_run(task_run_id)
    assert run["state_type"] == "CRASHED", (run.get("state"), out.stderr[-3000:])
    assert "FileNotFoundError" not in (run["state"].get("message") or ""), run["state"]
    assert not work.exists(), "the stopped run's files outlived it"
