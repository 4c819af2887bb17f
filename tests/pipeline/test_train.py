"""Tests for the training and evaluation stages (gpu_tasks.pipeline.train, gpu_tasks.pipeline.evaluate)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import xgboost as xgb

from gpu_tasks.pipeline.data import ingest
from gpu_tasks.pipeline.errors import PipelineInputError
from gpu_tasks.pipeline.etl import FEATURE_COLUMNS, build_features
from gpu_tasks.pipeline.evaluate import evaluate
from gpu_tasks.pipeline.train import load_model, train_model

pytestmark = pytest.mark.filterwarnings(
    # dask's parquet reader still calls reset_index(inplace=True), deprecated in pandas 3.1
    "ignore:The inplace keyword in DataFrame.reset_index:Warning"
)


@pytest.fixture(scope="module")
def features_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Features from 6,000 flights spread over 2013: ~4,800 train and ~1,000 test rows."""
    data_dir = tmp_path_factory.mktemp("train-data")
    raw = ingest(data_dir, scale=1, limit=6000)["raw_dir"]
    return Path(build_features(Path(raw), data_dir / "features")["features_dir"])


@pytest.fixture(scope="module")
def test_features(features_dir: Path) -> pd.DataFrame:
    return pd.read_parquet(features_dir / "test", columns=FEATURE_COLUMNS)


def _predict(model_path: Path, features: pd.DataFrame) -> np.ndarray:
    return load_model(model_path).inplace_predict(features)


def test_same_seed_gives_identical_predictions(
    features_dir: Path, test_features: pd.DataFrame, tmp_path: Path
) -> None:
    a = train_model(features_dir, tmp_path / "a.json", seed=3, num_rounds=10)
    b = train_model(features_dir, tmp_path / "b.json", seed=3, num_rounds=10)
    np.testing.assert_array_equal(
        _predict(tmp_path / "a.json", test_features), _predict(tmp_path / "b.json", test_features)
    )
    assert a["history"] == b["history"]


@pytest.mark.parametrize("suffix", [".json", ".ubj"])
def test_saved_model_loads_and_predicts_probabilities(
    features_dir: Path, test_features: pd.DataFrame, tmp_path: Path, suffix: str
) -> None:
    model_path = tmp_path / "models" / f"model{suffix}"
    result = train_model(features_dir, model_path, num_rounds=5)
    assert result["model_path"] == str(model_path)
    assert result["num_rounds"] == 5 and result["device"] == "cpu"
    assert result["train_rows"] == len(pd.read_parquet(features_dir / "train", columns=["delayed"]))
    assert result["seconds"] > 0
    assert sorted(result["history"]) == ["train-auc", "train-logloss"]
    assert [p.name for p in model_path.parent.iterdir()] == [model_path.name]  # no temporary file left

    booster = load_model(model_path)
    assert isinstance(booster, xgb.Booster)
    assert booster.num_boosted_rounds() == 5
    predictions = booster.inplace_predict(test_features)
    assert predictions.shape == (len(test_features),)
    assert ((predictions >= 0) & (predictions <= 1)).all()


def test_on_round_is_called_after_every_round(features_dir: Path, tmp_path: Path) -> None:
    calls: list[tuple[int, dict[str, float]]] = []
    result = train_model(
        features_dir, tmp_path / "m.json", num_rounds=7, on_round=lambda i, m: calls.append((i, m))
    )
    assert [i for i, _ in calls] == list(range(7))
    assert all(set(m) == {"train-auc", "train-logloss"} for _, m in calls)
    assert [m["train-auc"] for _, m in calls] == result["history"]["train-auc"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"model_path": "model.txt"}, "model_path"),
        ({"device": "tpu"}, "device"),
        ({"num_rounds": 0}, "num_rounds"),
    ],
)
def test_bad_arguments_are_rejected(features_dir: Path, tmp_path: Path, kwargs: dict, match: str) -> None:
    args = {"model_path": "model.json", **kwargs}
    args["model_path"] = tmp_path / args["model_path"]
    with pytest.raises(PipelineInputError, match=match):
        train_model(features_dir, **args)


def test_missing_features_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(PipelineInputError, match=str(tmp_path / "nothing" / "train")):
        train_model(tmp_path / "nothing", tmp_path / "m.json")


def test_load_model_errors(tmp_path: Path) -> None:
    with pytest.raises(PipelineInputError, match="does not exist"):
        load_model(tmp_path / "missing.json")
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"learner": ')
    with pytest.raises(PipelineInputError, match=str(corrupt)):
        load_model(corrupt)


def test_dask_data_parallel_training(features_dir: Path, test_features: pd.DataFrame, tmp_path: Path) -> None:
    from distributed import Client, LocalCluster

    calls: list[int] = []
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None
        ) as cluster,
        Client(cluster) as client,
    ):
        result = train_model(
            features_dir,
            tmp_path / "dask.json",
            num_rounds=4,
            client=client,
            on_round=lambda i, m: calls.append(i),
        )
    assert calls == [0, 1, 2, 3]
    assert result["train_rows"] == len(pd.read_parquet(features_dir / "train", columns=["delayed"]))
    assert len(result["history"]["train-auc"]) == 4
    predictions = _predict(tmp_path / "dask.json", test_features)
    assert ((predictions >= 0) & (predictions <= 1)).all()


# --------------------------------------------------------------------------- evaluate


def test_model_beats_the_historical_rate_baseline(features_dir: Path, tmp_path: Path) -> None:
    model_path = tmp_path / "model.json"
    train_model(features_dir, model_path, num_rounds=30, seed=0)
    result = evaluate(features_dir, model_path)
    assert result["auc"] > result["baseline_auc"] > 0.5
    assert result["logloss"] < result["baseline_logloss"]
    assert result["test_rows"] == len(pd.read_parquet(features_dir / "test", columns=["delayed"]))
    metrics_path = Path(result["metrics_path"])
    assert metrics_path == tmp_path / "model.metrics.json"
    saved = json.loads(metrics_path.read_text())
    assert saved["auc"] == result["auc"] and saved["model_path"] == str(model_path)

    elsewhere = evaluate(features_dir, model_path, out_dir=tmp_path / "reports")
    assert Path(elsewhere["metrics_path"]) == tmp_path / "reports" / "metrics.json"
    assert elsewhere["auc"] == result["auc"]


def test_evaluate_without_a_model(features_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(PipelineInputError, match="model"):
        evaluate(features_dir, tmp_path / "absent.json")


def test_a_single_class_test_split_says_to_raise_limit() -> None:
    from gpu_tasks.pipeline.evaluate import _scores

    with pytest.raises(PipelineInputError, match=r"single class \(\[1\]\) in 3 rows.*raise limit"):
        _scores(np.ones(3, dtype="int64"), np.full(3, 0.5), "model")
