"""Tests for the ingest stage (gpu_tasks.pipeline.data) and the shared I/O helpers
(gpu_tasks.pipeline._io)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from gpu_tasks.pipeline._io import atomic_directory, parquet_row_count
from gpu_tasks.pipeline.data import (
    RAW_MANIFEST_NAME,
    TABLE_NAMES,
    ingest,
    load_tables,
    replicate_flights,
)
from gpu_tasks.pipeline.errors import PipelineInputError


@pytest.fixture(scope="module")
def tables() -> dict[str, pd.DataFrame]:
    return load_tables()


@pytest.fixture(scope="module")
def small(tables: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    """A 2,000-flight slice spread over the year, with the full weather and planes tables."""
    return {**tables, "flights": tables["flights"].iloc[::168].reset_index(drop=True)}


def test_load_tables_shapes(tables: dict[str, pd.DataFrame]) -> None:
    assert set(tables) == set(TABLE_NAMES)
    assert tables["flights"].shape == (336_776, 19)
    assert tables["weather"].shape == (26_115, 15)
    assert tables["planes"].shape == (3_322, 9)


def test_ingest_scale_1_writes_every_row(tmp_path: Path, tables: dict[str, pd.DataFrame]) -> None:
    result = ingest(tmp_path, scale=1)
    raw = Path(result["raw_dir"])
    assert raw == tmp_path / "raw"
    expected = {name: len(frame) for name, frame in tables.items()}
    assert result["rows"] == expected
    # Row counts on disk (footers only) and in the manifest agree with the tables.
    assert {name: parquet_row_count(raw / name) for name in TABLE_NAMES} == expected
    manifest = json.loads((raw / RAW_MANIFEST_NAME).read_text())
    assert {name: t["rows"] for name, t in manifest["tables"].items()} == expected
    # Several flight part files so Dask reads several partitions; no temporary dirs left.
    assert len(list((raw / "flights").glob("*.parquet"))) == 4
    assert [p.name for p in tmp_path.iterdir()] == ["raw"]
    schema = pq.read_schema(next((raw / "weather").glob("*.parquet")))
    assert str(schema.field("time_hour").type).startswith("timestamp")


def test_replicate_scale_3_triples_rows_and_shifts_years(small: dict[str, pd.DataFrame]) -> None:
    flights, weather = small["flights"], small["weather"]
    replicas = list(replicate_flights(flights, weather, scale=3, seed=7))
    assert [r.index for r in replicas] == [0, 1, 2]
    all_flights = pd.concat([r.flights for r in replicas], ignore_index=True)
    assert len(all_flights) == 3 * len(flights)
    assert sum(len(r.weather) for r in replicas) == 3 * len(weather)
    assert sorted(all_flights["year"].unique()) == [2013, 2014, 2015]

    original_th = pd.to_datetime(flights["time_hour"], utc=True).dt.tz_localize(None)
    for rep in replicas:
        f, w = rep.flights, rep.weather
        assert (f["year"] == 2013 + rep.index).all()
        assert (w["year"] == 2013 + rep.index).all()
        assert (f["time_hour"].dt.year - original_th.dt.year == rep.index).all()
        pd.testing.assert_series_equal(f["tailnum"], flights["tailnum"])
        # Cancelled flights stay cancelled: missing delays are missing in every copy.
        for col in ("dep_delay", "arr_delay"):
            np.testing.assert_array_equal(f[col].isna().to_numpy(), flights[col].isna().to_numpy())
    # Copy 0 is unchanged; later copies are jittered.
    np.testing.assert_array_equal(replicas[0].flights["arr_delay"], flights["arr_delay"])
    assert not np.allclose(replicas[1].flights["arr_delay"].fillna(0), flights["arr_delay"].fillna(0))


def test_replicated_weather_still_joins(small: dict[str, pd.DataFrame]) -> None:
    flights, weather = small["flights"], small["weather"]
    hits = []
    for rep in replicate_flights(flights, weather, scale=3):
        joined = rep.flights.merge(
            rep.weather[["origin", "time_hour", "temp"]], how="left", on=["origin", "time_hour"]
        )
        assert len(joined) == len(flights)
        hits.append(int(joined["temp"].notna().sum()))
    assert hits[0] > 0.9 * len(flights)
    assert hits == [hits[0]] * 3  # every copy joins exactly as well as the original


def test_replicate_is_seeded(small: dict[str, pd.DataFrame]) -> None:
    def delays(seed: int) -> np.ndarray:
        reps = list(replicate_flights(small["flights"], small["weather"], scale=2, seed=seed))
        return reps[1].flights["arr_delay"].to_numpy()

    np.testing.assert_array_equal(delays(1), delays(1))
    assert not np.array_equal(np.nan_to_num(delays(1)), np.nan_to_num(delays(2)))


@pytest.mark.parametrize("scale", [0, -1, "a", 1.5, True, None])
def test_bad_scale_is_rejected(scale: object, small: dict[str, pd.DataFrame], tmp_path: Path) -> None:
    with pytest.raises(PipelineInputError, match="scale") as info:
        replicate_flights(small["flights"], small["weather"], scale=scale)  # type: ignore[arg-type]
    assert repr(scale) in str(info.value) and ">= 1" in str(info.value)
    with pytest.raises(PipelineInputError, match="scale"):
        ingest(tmp_path, scale=scale, tables=small)  # type: ignore[arg-type]
    assert not (tmp_path / "raw").exists()


def test_ingest_scale_and_limit(tmp_path: Path, small: dict[str, pd.DataFrame]) -> None:
    result = ingest(tmp_path, scale=3, seed=1, tables=small, limit=600)
    raw = Path(result["raw_dir"])
    assert result["rows"]["flights"] == 3 * 600 == parquet_row_count(raw / "flights")
    assert result["rows"]["weather"] == 3 * len(small["weather"])
    flights = pd.read_parquet(raw / "flights")
    assert sorted(flights["year"].unique()) == [2013, 2014, 2015]
    assert sorted(flights["month"].unique()) == list(range(1, 13))  # the limit spreads over the year
    assert len(list((raw / "flights").glob("*.parquet"))) == 12


def test_failed_ingest_leaves_no_half_written_raw(tmp_path: Path, small: dict[str, pd.DataFrame]) -> None:
    ingest(tmp_path, tables=small, limit=100)
    before = pd.read_parquet(tmp_path / "raw" / "flights")

    # airlines is written after flights and weather; an unconvertible column fails the ingest midway.
    bad_airlines = small["airlines"].assign(name=[object()] * len(small["airlines"]))
    with pytest.raises(PipelineInputError, match="airlines"):
        ingest(tmp_path, tables={**small, "airlines": bad_airlines}, limit=200)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw"]  # no raw.tmp-* left behind
    assert (tmp_path / "raw" / RAW_MANIFEST_NAME).exists()
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "raw" / "flights"), before)


def test_failed_first_ingest_creates_nothing(tmp_path: Path, small: dict[str, pd.DataFrame]) -> None:
    bad_planes = small["planes"].assign(model=[object()] * len(small["planes"]))
    with pytest.raises(PipelineInputError, match="planes"):
        ingest(tmp_path, tables={**small, "planes": bad_planes}, limit=100)
    assert list(tmp_path.iterdir()) == []


def test_ingest_requires_every_table(tmp_path: Path, small: dict[str, pd.DataFrame]) -> None:
    partial = {k: v for k, v in small.items() if k != "planes"}
    with pytest.raises(PipelineInputError, match="planes"):
        ingest(tmp_path, tables=partial)


def test_atomic_directory_replaces_old_version(tmp_path: Path) -> None:
    target = tmp_path / "out"
    with atomic_directory(target) as tmp:
        (tmp / "a.txt").write_text("1")
    with atomic_directory(target) as tmp:
        (tmp / "b.txt").write_text("2")
    assert sorted(p.name for p in target.iterdir()) == ["b.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
