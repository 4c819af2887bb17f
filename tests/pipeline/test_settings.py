"""The pipeline's own settings (gpu_tasks.pipeline.settings) beside the plugin's."""

from __future__ import annotations

from pathlib import Path

import pytest

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
