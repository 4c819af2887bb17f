"""The pipeline's settings, read from ``GPU_TASKS_*`` environment variables (pydantic-settings).

The plugin's own settings are :class:`gpu_tasks.settings.GpuTasksSettings`; it ignores
the variables read here.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class PipelineSettings(BaseSettings):
    """Settings of the example pipeline. Every field maps to ``GPU_TASKS_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix="GPU_TASKS_", extra="ignore")

    data_dir: Path = Field(default=Path("gpu-tasks-data"), description="Where pipeline data is written.")


def get_pipeline_settings() -> PipelineSettings:
    """Read the settings from the environment now (cheap; not cached so tests can change env)."""
    return PipelineSettings()
