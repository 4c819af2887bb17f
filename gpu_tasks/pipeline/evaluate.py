"""Evaluation stage (CPU): the model against a historical-rate baseline on the test split.

Metrics are ROC AUC and log loss (``sklearn.metrics``) on ``features_dir/test``.
The baseline predicts, for each test flight, the delay rate observed in the
training split for its (carrier, scheduled departure hour); when that pair never
occurs in training it falls back to the carrier's rate, then to the overall rate.
"""

from __future__ import annotations

import datetime as _dt
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from sklearn.metrics import log_loss, roc_auc_score

from gpu_tasks.pipeline._io import read_parquet_frame, write_json_atomic
from gpu_tasks.pipeline.errors import PipelineInputError
from gpu_tasks.pipeline.train import feature_split, load_model

logger = logging.getLogger(__name__)

BASELINE_KEYS: tuple[str, str] = ("carrier_code", "sched_dep_hour")
"""Group of the historical-rate baseline (falls back to the first key, then global)."""

METRICS_SUFFIX = ".metrics.json"


def baseline_rates(train: pd.DataFrame, test: pd.DataFrame, label: str) -> np.ndarray:
    """Historical delay rate per (carrier, scheduled hour) from ``train``, looked up for ``test``.

    Args:
        train: Training rows with :data:`BASELINE_KEYS` and ``label``.
        test: Rows to score, with :data:`BASELINE_KEYS`.
        label: The 0/1 label column.

    Returns:
        One probability per ``test`` row: the pair's rate, else the carrier's, else the global rate.
    """
    carrier, hour = BASELINE_KEYS
    global_rate = float(train[label].mean())
    pair = train.groupby([carrier, hour])[label].mean().rename("pair_rate").reset_index()
    by_carrier = train.groupby(carrier)[label].mean().rename("carrier_rate").reset_index()
    looked_up = (
        test[[carrier, hour]]
        .merge(pair, how="left", on=[carrier, hour])
        .merge(by_carrier, how="left", on=carrier)
    )
    rates = looked_up["pair_rate"].fillna(looked_up["carrier_rate"]).fillna(global_rate)
    return rates.to_numpy(dtype="float64")


def _scores(y: np.ndarray, p: np.ndarray, what: str) -> tuple[float, float]:
    if len(np.unique(y)) < 2:
        raise PipelineInputError(
            f"test split has a single class ({np.unique(y).tolist()}) in {len(y)} rows; AUC of the {what} "
            "is undefined: too few flights (with a small limit, raise limit)"
        )
    return float(roc_auc_score(y, p)), float(log_loss(y, np.clip(p, 1e-7, 1 - 1e-7), labels=[0, 1]))


def evaluate(features_dir: Path, model_path: Path, out_dir: Path | None = None) -> dict[str, Any]:
    """Score the model and the baseline on the test split and write the metrics JSON.

    Args:
        features_dir: ``out_dir`` of :func:`gpu_tasks.pipeline.etl.build_features`.
        model_path: Model saved by :func:`gpu_tasks.pipeline.train.train_model`.
        out_dir: Directory for ``metrics.json``; by default the metrics go next to the
            model as ``<model stem>.metrics.json``.

    Returns:
        ``{"auc", "logloss", "baseline_auc", "baseline_logloss", "test_rows",
        "metrics_path", "model_path"}``.

    Raises:
        PipelineInputError: missing/unreadable features or model, an empty test split,
            or a test split with a single class.
    """
    model_path = Path(model_path)
    test_dir, columns, label = feature_split(Path(features_dir), "test")
    train_dir, _, _ = feature_split(Path(features_dir), "train")
    booster = load_model(model_path)
    booster.set_param({"device": "cpu"})  # a model trained on cuda predicts here on host data

    test = read_parquet_frame(test_dir, [*columns, label])
    if test.empty:
        raise PipelineInputError(f"test features in {test_dir} have no rows")
    train = read_parquet_frame(train_dir, [*BASELINE_KEYS, label])
    y = test[label].to_numpy(dtype="int64")

    try:
        predictions = booster.inplace_predict(test[columns])
    except ValueError as exc:  # feature names/count differ from the model's
        raise PipelineInputError(
            f"model {model_path} does not match the features in {test_dir}: {exc}"
        ) from exc
    auc, logloss = _scores(y, np.asarray(predictions, dtype="float64"), "model")
    baseline_auc, baseline_logloss = _scores(y, baseline_rates(train, test, label), "baseline")

    metrics_path = (
        Path(out_dir) / "metrics.json"
        if out_dir is not None
        else model_path.with_name(model_path.stem + METRICS_SUFFIX)
    )
    result: dict[str, Any] = {
        "auc": auc,
        "logloss": logloss,
        "baseline_auc": baseline_auc,
        "baseline_logloss": baseline_logloss,
        "test_rows": len(test),
        "metrics_path": str(metrics_path),
        "model_path": str(model_path),
    }
    write_json_atomic(
        metrics_path,
        {
            **result,
            "features_dir": str(features_dir),
            "test_positive_rate": float(y.mean()),
            "created_at": _dt.datetime.now(_dt.UTC).isoformat(),
        },
    )
    logger.info(
        "test AUC %.4f (baseline %.4f), log loss %.4f (baseline %.4f) on %d rows -> %s",
        auc,
        baseline_auc,
        logloss,
        baseline_logloss,
        len(test),
        metrics_path,
    )
    return result
