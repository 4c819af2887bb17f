"""The pipeline's error: bad input data or arguments for a stage."""

from __future__ import annotations

from gpu_tasks.errors import GpuTasksError


class PipelineInputError(GpuTasksError, ValueError):
    """Input data for a pipeline stage is missing, corrupt or has the wrong schema."""
