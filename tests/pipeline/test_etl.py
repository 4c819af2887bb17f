"""Tests for the ETL stage (gpu_tasks.pipeline.etl)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest

from gpu_tasks import _gpu
from gpu_tasks.pipeline._io import parquet_row_count
from gpu_tasks.pipeline.data import ingest, load_tables
from gpu_tasks.pipeline.errors import PipelineInputError
from gpu_tasks.pipeline.etl import (
    FEATURE_COLUMNS,
    FEATURES_MANIFEST_NAME,
    LABEL,
    build_features,
    category_vocabulary,
    featurize,
    weekday,
)

pytestmark = pytest.mark.filterwarnings(
    # dask's parquet reader still calls reset_index(inplace=True), deprecated in pandas 3.1
    "ignore:The inplace keyword in DataFrame.reset_index:Warning"
)


@pytest.fixture(scope="module")
def raw_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Raw tables with 3,000 flights spread over 2013 (scale 1)."""
    data_dir = tmp_path_factory.mktemp("etl-data")
    return Path(ingest(data_dir, scale=1, limit=3000)["raw_dir"])


@pytest.fixture(scope="module")
def frames(raw_dir: Path) -> dict[str, pd.DataFrame]:
    return {t: pd.read_parquet(raw_dir / t) for t in ("flights", "weather", "planes")}


@pytest.fixture()
def raw_copy(raw_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the raw tables that a test may damage."""
    return Path(shutil.copytree(raw_dir, tmp_path / "raw"))


def _not_cancelled(flights: pd.DataFrame) -> int:
    return int((flights["arr_delay"].notna() & flights["dep_time"].notna()).sum())


def _sorted(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.sort_values(list(frame.columns)).reset_index(drop=True)


# --------------------------------------------------------------------------- featurize


def test_joins_keep_one_row_per_non_cancelled_flight(frames: dict[str, pd.DataFrame]) -> None:
    flights, weather, planes = frames["flights"], frames["weather"], frames["planes"]
    expected = _not_cancelled(flights)
    assert 0 < expected < len(flights)
    feats = featurize(flights, weather, planes)
    assert len(feats) == expected
    assert list(feats.columns) == [*FEATURE_COLUMNS, LABEL]
    # Most flights find their weather hour and their plane.
    assert feats["temp"].notna().mean() > 0.9
    assert feats["seats"].notna().mean() > 0.6

    # Duplicated weather hours and plane rows must not duplicate flights (or change values).
    dup = featurize(flights, pd.concat([weather, weather.iloc[:500]]), pd.concat([planes, planes.iloc[:100]]))
    assert len(dup) == expected
    pd.testing.assert_frame_equal(_sorted(dup), _sorted(feats))


def test_plane_year_becomes_plane_age(frames: dict[str, pd.DataFrame]) -> None:
    flights, planes = frames["flights"], frames["planes"]
    kept = flights[flights["arr_delay"].notna() & flights["dep_time"].notna()].reset_index(drop=True)
    feats = featurize(kept, frames["weather"], planes).reset_index(drop=True)
    manufacture = kept["tailnum"].map(planes.set_index("tailnum")["year"])
    expected = (kept["year"] - manufacture).astype("float32")
    np.testing.assert_array_equal(feats["plane_age"].to_numpy(), expected.to_numpy())
    assert feats["plane_age"].isna().any()  # unknown planes stay NaN


def test_label_is_arrival_delay_over_15_minutes(frames: dict[str, pd.DataFrame]) -> None:
    flights = frames["flights"].iloc[:6].copy()
    flights["arr_delay"] = [15.0, 16.0, -3.0, np.nan, 200.0, 15.5]
    flights["dep_time"] = [600.0, 600.0, 600.0, 600.0, np.nan, 600.0]  # row 4 cancelled
    feats = featurize(flights, frames["weather"], frames["planes"]).reset_index(drop=True)
    assert feats[LABEL].tolist() == [0, 1, 0, 1]
    assert str(feats[LABEL].dtype) == "int8"


def test_codes_follow_a_sorted_vocabulary(frames: dict[str, pd.DataFrame]) -> None:
    flights = frames["flights"]
    vocab = category_vocabulary(flights)
    assert vocab["origin"] == ["EWR", "JFK", "LGA"]
    assert vocab["carrier"] == sorted(vocab["carrier"])
    feats = featurize(flights, frames["weather"], frames["planes"], vocab)
    kept = flights[flights["arr_delay"].notna() & flights["dep_time"].notna()].reset_index(drop=True)
    expected = kept["origin"].map({v: i for i, v in enumerate(vocab["origin"])}).to_numpy()
    np.testing.assert_array_equal(feats["origin_code"].to_numpy(), expected)
    # A slice that lacks some carriers still uses the same codes when given the vocabulary.
    part = featurize(
        kept[kept["carrier"] == vocab["carrier"][-1]], frames["weather"], frames["planes"], vocab
    )
    assert set(part["carrier_code"]) == {len(vocab["carrier"]) - 1}


def test_dask_and_pandas_featurize_agree(frames: dict[str, pd.DataFrame]) -> None:
    eager = featurize(frames["flights"], frames["weather"], frames["planes"])
    lazy = featurize(
        dd.from_pandas(frames["flights"], npartitions=3),
        dd.from_pandas(frames["weather"], npartitions=2),
        dd.from_pandas(frames["planes"], npartitions=1),
    ).compute()
    pd.testing.assert_frame_equal(_sorted(lazy), _sorted(eager))


def test_weekday_matches_pandas() -> None:
    dates = pd.Series(pd.date_range("1999-12-25", "2031-03-05", freq="37D"))
    got = weekday(dates.dt.year, dates.dt.month, dates.dt.day)
    np.testing.assert_array_equal(got.to_numpy(), dates.dt.day_of_week.to_numpy())
    assert weekday(2013, 1, 1) == 1  # a Tuesday


def test_featurize_names_missing_columns(frames: dict[str, pd.DataFrame]) -> None:
    with pytest.raises(PipelineInputError, match=r"planes.*seats"):
        featurize(frames["flights"], frames["weather"], frames["planes"].drop(columns=["seats"]))


# --------------------------------------------------------------------------- build_features


def test_build_features_splits_by_month(
    raw_dir: Path, frames: dict[str, pd.DataFrame], tmp_path: Path
) -> None:
    result = build_features(raw_dir, tmp_path / "features", holdout_months=2)
    out = Path(result["features_dir"])
    assert result["label"] == LABEL and result["backend"] == "pandas"
    assert result["feature_columns"] == FEATURE_COLUMNS
    assert result["train_rows"] + result["test_rows"] == _not_cancelled(frames["flights"])
    train, test = pd.read_parquet(out / "train"), pd.read_parquet(out / "test")
    assert (len(train), len(test)) == (result["train_rows"], result["test_rows"])
    assert set(train["month"]) == set(range(1, 11))
    assert set(test["month"]) == {11, 12}
    assert list(train.columns) == [*FEATURE_COLUMNS, LABEL]

    manifest = json.loads((out / FEATURES_MANIFEST_NAME).read_text())
    assert manifest["train_rows"] == result["train_rows"]
    assert manifest["feature_columns"] == FEATURE_COLUMNS
    assert manifest["vocabulary"]["origin"] == ["EWR", "JFK", "LGA"]
    assert sorted(p.name for p in out.iterdir()) == [FEATURES_MANIFEST_NAME, "test", "train"]

    # Rebuilding with another holdout replaces both splits.
    again = build_features(raw_dir, out, holdout_months=3)
    assert set(pd.read_parquet(out / "test")["month"]) == {10, 11, 12}
    assert again["train_rows"] + again["test_rows"] == result["train_rows"] + result["test_rows"]
    assert sorted(p.name for p in out.iterdir()) == [FEATURES_MANIFEST_NAME, "test", "train"]


@pytest.mark.parametrize("holdout", [0, 12, 1.5, "2"])
def test_bad_holdout_is_rejected(raw_dir: Path, tmp_path: Path, holdout: object) -> None:
    with pytest.raises(PipelineInputError, match="holdout_months"):
        build_features(raw_dir, tmp_path / "f", holdout_months=holdout)  # type: ignore[arg-type]


def test_unknown_backend_is_rejected(raw_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(PipelineInputError, match="backend"):
        build_features(raw_dir, tmp_path / "f", backend="polars")


def test_missing_raw_dir_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "raw"
    with pytest.raises(PipelineInputError, match=str(missing)):
        build_features(missing, tmp_path / "f")


def test_missing_table_names_the_path(raw_copy: Path, tmp_path: Path) -> None:
    shutil.rmtree(raw_copy / "planes")
    with pytest.raises(PipelineInputError, match=r"planes") as info:
        build_features(raw_copy, tmp_path / "f")
    assert str(raw_copy / "planes") in str(info.value)


def test_missing_column_names_table_and_column(raw_copy: Path, tmp_path: Path) -> None:
    weather_file = next((raw_copy / "weather").glob("*.parquet"))
    pd.read_parquet(weather_file).drop(columns=["temp"]).to_parquet(weather_file, index=False)
    with pytest.raises(PipelineInputError) as info:
        build_features(raw_copy, tmp_path / "f")
    message = str(info.value)
    assert "weather" in message and "'temp'" in message and "wind_speed" in message  # lists what is there


def test_corrupt_parquet_names_the_file(raw_copy: Path, tmp_path: Path) -> None:
    bad = raw_copy / "flights" / "part-r0000-q9.parquet"
    bad.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(PipelineInputError, match=str(bad)) as info:
        build_features(raw_copy, tmp_path / "f")
    assert info.value.__cause__ is not None


def test_empty_part_file_does_not_break_the_build(
    raw_copy: Path, frames: dict[str, pd.DataFrame], tmp_path: Path
) -> None:
    frames["flights"].iloc[:0].to_parquet(raw_copy / "flights" / "part-r0000-q0.parquet", index=False)
    frames["weather"].iloc[:0].to_parquet(raw_copy / "weather" / "part-empty.parquet", index=False)
    result = build_features(raw_copy, tmp_path / "f")
    assert result["train_rows"] + result["test_rows"] == _not_cancelled(frames["flights"])


def test_empty_flights_table_is_an_error(
    raw_copy: Path, frames: dict[str, pd.DataFrame], tmp_path: Path
) -> None:
    for part in (raw_copy / "flights").glob("*.parquet"):
        frames["flights"].iloc[:0].to_parquet(part, index=False)
    with pytest.raises(PipelineInputError, match="empty"):
        build_features(raw_copy, tmp_path / "f")


def test_split_without_test_months_is_an_error(
    raw_copy: Path, frames: dict[str, pd.DataFrame], tmp_path: Path
) -> None:
    flights = frames["flights"]
    shutil.rmtree(raw_copy / "flights")
    (raw_copy / "flights").mkdir()
    flights[flights["month"] <= 6].to_parquet(raw_copy / "flights" / "part-0.parquet", index=False)
    with pytest.raises(PipelineInputError, match="0 test rows.* ingested with limit=3000 .*raise limit"):
        build_features(raw_copy, tmp_path / "f")
    assert not (tmp_path / "f" / "train").exists()


def test_failed_build_keeps_previous_features(raw_copy: Path, tmp_path: Path) -> None:
    out = tmp_path / "features"
    first = build_features(raw_copy, out)
    (raw_copy / "flights" / "part-zz.parquet").write_bytes(b"garbage")
    with pytest.raises(PipelineInputError):
        build_features(raw_copy, out)
    assert parquet_row_count(out / "train") == first["train_rows"]
    assert (out / FEATURES_MANIFEST_NAME).exists()
    assert sorted(p.name for p in out.iterdir()) == [FEATURES_MANIFEST_NAME, "test", "train"]


def test_replicated_raw_data_builds(tmp_path: Path) -> None:
    tables = load_tables()
    raw = Path(ingest(tmp_path, scale=2, limit=1000, tables=tables)["raw_dir"])
    result = build_features(raw, tmp_path / "features")
    flights = pd.read_parquet(raw / "flights")
    assert result["train_rows"] + result["test_rows"] == _not_cancelled(flights)
    # The shifted weather still joins in the copy as well as in the original.
    train = pd.read_parquet(tmp_path / "features" / "train")
    assert train["temp"].notna().mean() > 0.9


@pytest.mark.gpu
def test_cudf_backend_matches_pandas(raw_dir: Path, tmp_path: Path) -> None:
    for lib in ("cudf", "dask_cudf"):
        if not _gpu.available(lib):
            pytest.skip(f"{lib} is not available: {_gpu.why_unavailable(lib)}")
    on_cpu = build_features(raw_dir, tmp_path / "pandas", backend="pandas")
    on_gpu = build_features(raw_dir, tmp_path / "cudf", backend="cudf")
    assert on_gpu["backend"] == "cudf"
    for split in ("train", "test"):
        assert on_cpu[f"{split}_rows"] == on_gpu[f"{split}_rows"]
        expected = _sorted(pd.read_parquet(tmp_path / "pandas" / split))
        got = _sorted(pd.read_parquet(tmp_path / "cudf" / split))
        pd.testing.assert_frame_equal(got, expected, check_exact=False, rtol=1e-5)


def test_two_runs_at_one_scale_each_train_on_their_own_rows(tmp_path: Path) -> None:
    """Two flow runs at scale 1 with different limits, their stages interleaved as on one worker:
    each run's ETL and training read what that run ingested (they shared <data_dir>/scale-1/, and a
    limit=5000 run trained on the 273,355 rows of a full run beside it)."""
    from gpu_tasks.pipeline.params import run_directory
    from gpu_tasks.pipeline.train import train_model

    nyc = load_tables()
    runs = {1000: run_directory(tmp_path, 1, "run-a"), 2000: run_directory(tmp_path, 1, "run-b")}
    raw = {limit: ingest(work, scale=1, limit=limit, tables=nyc)["raw_dir"] for limit, work in runs.items()}
    feats = {limit: build_features(Path(raw[limit]), work / "features") for limit, work in runs.items()}
    for limit, work in runs.items():
        rows = feats[limit]["train_rows"] + feats[limit]["test_rows"]
        assert rows == _not_cancelled(pd.read_parquet(Path(raw[limit]) / "flights")) and rows <= limit
        trained = train_model(Path(feats[limit]["features_dir"]), work / "model.json", num_rounds=2)
        assert trained["train_rows"] == feats[limit]["train_rows"], f"run with limit={limit}"
    assert feats[1000]["train_rows"] < feats[2000]["train_rows"]
