"""Deployments describe their profiles and GPU needs (gpu_tasks.deployments, `gpu-tasks deployment-info`)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner
from typer.testing import CliRunner

from gpu_tasks import ProfileError, ProfileTaskRunner, ResourceProfile
from gpu_tasks.cli import app
from gpu_tasks.deployments import deployment_info, describe_profile, most_gpus

ROOT = Path(__file__).resolve().parents[1]

CPU = ResourceProfile(name="cpu", cpus=0.5)
QUARTER = ResourceProfile(name="quarter", gpus=0.25, max_workers=2)
GANG = ResourceProfile(
    name="train", gpus=2, gang=True, max_workers=2, gpu_model="H100", gpu_memory_total="40GiB", fallback="cpu"
)


@functools.cache
def _pipeline() -> Any:
    """The flow these tests describe, built on first use (a runner checks Prefect's home when built;
    test modules do no I/O at import)."""

    @flow(task_runner=ProfileTaskRunner(profiles=[CPU, QUARTER, GANG], default="cpu"))
    def pipeline() -> None:
        """Nightly features and training.

        More text that is not the summary.
        """

    return pipeline


@pytest.fixture(autouse=True)
def _no_profiles_file(monkeypatch):
    monkeypatch.delenv("GPU_TASKS_PROFILES_FILE", raising=False)


@pytest.mark.parametrize(
    ("prof", "text"),
    [
        (CPU, "cpu: CPU (0.5 cores per task)"),
        (QUARTER, "quarter: 1/4 GPU per task, up to 2 workers"),
        (GANG, "train: 2 GPUs per task as a gang, H100, >= 40 GiB, up to 2 workers, CPU fallback"),
        (ResourceProfile(name="any", gpus=1), "any: 1 GPU per task, a worker per free device"),
        (
            ResourceProfile(name="far", gpus=1, address="tcp://127.0.0.1:8786"),
            "far: 1 GPU per task, on a remote Dask cluster",
        ),
    ],
)
def test_each_profile_reads_as_a_phrase(prof, text):
    assert describe_profile(prof) == text


def test_most_gpus_held_at_once():
    assert most_gpus({"cpu": CPU, "quarter": QUARTER, "train": GANG}) == 2 * 1 + 2 * 2
    assert most_gpus({"cpu": CPU}) == 0
    assert most_gpus({"quarter": QUARTER, "any": ResourceProfile(name="any", gpus=1)}) is None


def test_deployment_info_from_the_flows_profiles():
    info = deployment_info(_pipeline())
    assert info.description == (
        "Nightly features and training. GPU profiles: quarter: 1/4 GPU per task, up to 2 workers; "
        "train: 2 GPUs per task as a gang, H100, >= 40 GiB, up to 2 workers, CPU fallback. Holds at most "
        "6 GPUs at once, each only while its profile has work (gpu-tasks). CPU profiles: cpu (default)."
    )
    assert info.tags == ["gpu-tasks", "gpu-profile:quarter", "gpu-profile:train", "gpu-model:H100", "gpus:6"]
    assert info.kwargs() == {"description": info.description, "tags": info.tags}
    # deployment tags never look like the profile: tags that route tasks
    assert not [t for t in info.tags if t.startswith("profile:")]


def test_a_profiles_file_remaps_what_the_deployment_needs(tmp_path: Path, monkeypatch):
    path = tmp_path / "p.toml"
    path.write_text('[profiles.train]\ngpus = 1\nmax_workers = 4\ngpu_model = "L4"\n')
    info = deployment_info(_pipeline(), profiles_file=path, summary="Remapped")
    assert info.description.startswith("Remapped. GPU profiles: quarter: 1/4 GPU per task, up to 2 workers; ")
    assert "train: 1 GPU per task, L4, up to 4 workers." in info.description
    assert info.tags[-2:] == ["gpu-model:L4", "gpus:6"]
    monkeypatch.setenv("GPU_TASKS_PROFILES_FILE", str(path))  # the environment's file, as a flow run reads it
    assert deployment_info(_pipeline(), summary="Remapped") == info


def test_cpu_only_flow_and_a_flow_without_profiles():
    @flow(task_runner=ProfileTaskRunner(profiles=[CPU]))
    def light() -> None:
        pass

    info = deployment_info(light)
    assert (
        info.description
        == "Flow light. No GPU profiles: runs on CPU only (gpu-tasks). CPU profiles: cpu (default)."
    )
    assert info.tags == ["gpu-tasks"] and info.gpus == 0

    @flow(task_runner=ThreadPoolTaskRunner())
    def plain() -> None:
        pass

    with pytest.raises(
        ProfileError, match="does not use ProfileTaskRunner .*task_runner=ThreadPoolTaskRunner"
    ):
        deployment_info(plain)


def test_cli_prints_prefect_yaml_lines_and_json(tmp_path: Path):
    runner = CliRunner()
    args = ["deployment-info", f"{ROOT}/flows/etl_train.py:etl_train", "--summary", "Nightly"]
    out = runner.invoke(app, args)
    assert out.exit_code == 0, out.output
    lines = out.stdout.splitlines()
    assert lines[0].startswith('description: "Nightly. GPU profiles: gpu-etl: 1 GPU per task')
    assert lines[1] == "tags: [gpu-tasks, gpu-profile:gpu-etl, gpu-profile:gpu-train, gpus:2]"
    data = json.loads(runner.invoke(app, [*args, "--json", "-f", str(ROOT / "infra/profiles.toml")]).stdout)
    assert data["gpus"] == 3 and "gpu-model:H100" in data["tags"]

    bad = runner.invoke(app, ["deployment-info", f"{tmp_path}/nope.py:flow"])
    assert bad.exit_code == 2 and "cannot load flow" in bad.stderr and "Traceback" not in bad.stderr


def test_cli_names_what_a_flow_script_raised_and_reads_the_deployments_profiles_file(tmp_path, monkeypatch):
    runner = CliRunner()
    script = tmp_path / "boom.py"
    script.write_text('raise RuntimeError("boom at import")\n')
    bad = runner.invoke(app, ["deployment-info", f"{script}:flow"])
    assert bad.exit_code == 2 and "importing it raised RuntimeError: boom at import" in bad.stderr, bad.output
    entrypoint = f"{ROOT}/flows/etl_train.py:etl_train"
    missing = runner.invoke(app, ["deployment-info", entrypoint, "-f", str(tmp_path / "missing.toml")])
    assert missing.exit_code == 2 and "(--profiles-file) cannot be read" in missing.stderr, missing.output
    # a broken file in the shell's environment: -f gives the deployment's own, for the flow's import too
    monkeypatch.setenv("GPU_TASKS_PROFILES_FILE", str(tmp_path / "nope.toml"))
    good = runner.invoke(
        app, ["deployment-info", entrypoint, "--json", "-f", str(ROOT / "infra/profiles.toml")]
    )
    assert good.exit_code == 0 and json.loads(good.stdout)["gpus"] == 3, good.output


def test_cli_rejects_a_profiles_file_whose_default_names_no_profile(tmp_path):
    """As ``gpu-tasks profiles --file`` does, even where the flow's runner sets its own default=."""
    path = tmp_path / "p.toml"
    path.write_text('default = "nope"\n[profiles.gpu]\ngpus = 1\n')
    out = CliRunner().invoke(
        app, ["deployment-info", f"{ROOT}/flows/etl_train.py:etl_train", "-f", str(path)]
    )
    assert out.exit_code == 2, out.output
    # one line, from the flow's own runner as its module is imported (where this process has not
    # imported it before) or as deployment_info resolves its profiles
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("error: ") and line.endswith(
        f"profiles file {str(path)!r}: default profile 'nope' is not defined; known profiles: cpu, gpu, "
        "gpu-etl, gpu-train; add [profiles.nope] to the file or change its default"
    ), line
