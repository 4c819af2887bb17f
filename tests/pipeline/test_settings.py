"""The pipeline's own settings (gpu_tasks.pipeline.settings) beside the plugin's."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu_tasks.pipeline.errors import PipelineInputError
from gpu_tasks.pipeline.settings import PipelineSettings, get_pipeline_settings
from gpu_tasks.settings import get_settings


def test_data_dir_is_read_from_its_variable_and_the_plugin_ignores_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    monkeypatch.setenv("GPU_TASKS_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("GPU_TASKS_IDLE_TIMEOUT", "3")
    assert get_pipeline_settings().data_dir == tmp_path / "data"
    assert get_settings().idle_timeout == 3  # the plugin's settings still load beside it


def test_data_dir_default(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("GPU_TASKS_DATA_DIR", raising=False)
    assert PipelineSettings().data_dir == Path("gpu-tasks-data")


# --------------------------------------------------------------------------- the flow's parameters

GOOD = {"scale": 1, "num_rounds": 60, "seed": 0, "holdout_months": 2, "limit": None}


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("scale", 0),
        ("num_rounds", 0),
        ("num_rounds", True),
        ("seed", -1),
        ("holdout_months", 12),
        ("holdout_months", 0),
        ("limit", -5),
        ("limit", 1),
        ("limit", 10),
    ],
)
def test_a_bad_flow_parameter_is_named_before_anything_runs(name: str, value: object, tmp_path: Path):
    """check_parameters is what etl_train calls before it submits a task (no ingest, no device)."""
    from gpu_tasks.pipeline.params import check_parameters

    with pytest.raises(PipelineInputError, match=rf"^{name} must be .*, got {value!r}$"):
        check_parameters(**{**GOOD, name: value}, data_dir=str(tmp_path / "data"))
    assert not (tmp_path / "data").exists(), "nothing is written for a bad parameter"


def test_smallest_limit_and_defaults_pass(tmp_path: Path):
    from gpu_tasks.pipeline.params import MIN_LIMIT, check_parameters

    data = tmp_path / "a" / "b"
    assert check_parameters(**{**GOOD, "limit": MIN_LIMIT}, data_dir=str(data)) == data and data.is_dir()


def test_an_unusable_data_dir_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from gpu_tasks.pipeline.params import check_parameters

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(PipelineInputError, match=rf"^data_dir '{blocker}/data' cannot be used .*data_dir$"):
        check_parameters(**GOOD, data_dir=str(blocker / "data"))
    monkeypatch.setenv("GPU_TASKS_DATA_DIR", str(blocker / "env"))
    with pytest.raises(PipelineInputError, match=r"^GPU_TASKS_DATA_DIR \(the default of data_dir\)"):
        check_parameters(**GOOD, data_dir=None)
