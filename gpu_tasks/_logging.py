"""Where the runner's own lines go."""

from __future__ import annotations

import logging

logger = logging.getLogger("gpu_tasks.runner")


def flow_logger() -> logging.Logger | logging.LoggerAdapter[logging.Logger]:
    """The flow run's Prefect logger (lines reach the run's logs), else the runner's module logger."""
    from prefect.logging import get_run_logger

    try:
        return get_run_logger()
    except Exception:
        return logger
