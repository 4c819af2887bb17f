"""ETL stage: raw flights, weather and planes -> train/test feature tables.

One code path for both backends: the tables are read with ``dask.dataframe``
under ``dask.config.set({"dataframe.backend": backend})``, so ``backend="pandas"``
runs on CPU and ``backend="cudf"`` runs the very same operations on GPUs through
dask-cuDF. Only operations that pandas, cuDF and Dask share are used (merge,
groupby-mean, arithmetic, ``Series.map`` with a dict); weekday is computed with
integer arithmetic rather than datetime accessors so both backends agree exactly.

Feature table (one row per flight that was not cancelled or diverted, i.e. with
both ``dep_time`` and ``arr_delay`` present):

* ``delayed`` (label, int8): ``arr_delay > 15`` minutes.
* ``sched_dep_hour``, ``weekday`` (Monday = 0, local flight date), ``month`` (int32).
* ``carrier_code``, ``origin_code``, ``dest_code`` (int32): positions in a sorted
  vocabulary of the values seen in the flights table (stored in the manifest),
  identical for train and test and for both backends; -1 for a missing value.
* ``distance``, ``plane_age`` (flight year - plane manufacture year), ``seats``,
  and weather at the scheduled departure hour: ``temp``, ``wind_speed``,
  ``precip``, ``visib``, ``humid`` (float32).

Missing numeric values (unknown plane, no weather observation, a weather table
without ``humid``) are left as NaN on purpose: XGBoost treats NaN as "missing"
and learns a default direction for it, for train and test alike.

Split by time: the last ``holdout_months`` calendar months of every year (e.g.
November and December for 2) are the test set, the rest train. Because replicas
made by :func:`gpu_tasks.pipeline.data.replicate_flights` are jittered copies of the same
year, splitting by month of year (not by absolute date) keeps near-duplicate
flights from landing on both sides of the split.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import dask.config
import dask.dataframe as dd
import numpy as np
import pandas as pd
from dask.base import compute as dask_compute

from gpu_tasks import _gpu
from gpu_tasks.pipeline._io import (
    atomic_directory,
    parquet_errors,
    parquet_files,
    parquet_row_count,
    read_schema_names,
    write_json_atomic,
)
from gpu_tasks.pipeline.data import RAW_MANIFEST_NAME
from gpu_tasks.pipeline.errors import PipelineInputError

logger = logging.getLogger(__name__)

LABEL = "delayed"
"""Label column: 1 when the flight arrived more than :data:`DELAY_THRESHOLD_MINUTES` late."""

DELAY_THRESHOLD_MINUTES = 15

CATEGORICAL_COLUMNS: tuple[str, ...] = ("carrier", "origin", "dest")
"""Flight columns encoded as ``<name>_code`` integer features."""

WEATHER_FEATURES: tuple[str, ...] = ("temp", "wind_speed", "precip", "visib", "humid")
"""Weather columns joined at the scheduled departure hour."""

OPTIONAL_WEATHER: frozenset[str] = frozenset({"humid"})
"""Weather columns that may be absent from the weather table (then all NaN)."""

FEATURE_COLUMNS: list[str] = [
    "sched_dep_hour",
    "weekday",
    "month",
    "carrier_code",
    "origin_code",
    "dest_code",
    "distance",
    "plane_age",
    "seats",
    *WEATHER_FEATURES,
]
"""Model inputs, in order."""

INT_FEATURES: frozenset[str] = frozenset(
    {"sched_dep_hour", "weekday", "month", "carrier_code", "origin_code", "dest_code"}
)
"""Features stored as int32; the others are float32 (NaN = missing)."""

REQUIRED_COLUMNS: dict[str, tuple[str, ...]] = {
    "flights": (
        "year",
        "month",
        "day",
        "dep_time",
        "sched_dep_time",
        "arr_delay",
        "carrier",
        "tailnum",
        "origin",
        "dest",
        "distance",
        "time_hour",
    ),
    "weather": ("origin", "time_hour", *(c for c in WEATHER_FEATURES if c not in OPTIONAL_WEATHER)),
    "planes": ("tailnum", "year", "seats"),
}
"""Columns each raw table must have (extra columns are ignored and not read)."""

BACKENDS: tuple[str, ...] = ("pandas", "cudf")

FEATURES_MANIFEST_NAME = "_manifest.json"
"""Written into ``out_dir`` last, once ``train`` and ``test`` are in place."""

_WEATHER_KEY = ["origin", "time_hour"]


# --------------------------------------------------------------------------- validation


def _check_columns(table: str, present: Iterable[str], where: object | None = None) -> None:
    """Raise :class:`PipelineInputError` naming the table and the missing required columns."""
    present = list(present)
    missing = [c for c in REQUIRED_COLUMNS[table] if c not in present]
    if missing:
        at = f" ({where})" if where is not None else ""
        raise PipelineInputError(
            f"{table} table{at} is missing required column(s) {missing}; it has {present}"
        )


def _table_files(raw_dir: Path, table: str) -> list[Path]:
    """The readable Parquet files of ``table`` under ``raw_dir``, each with the required columns.

    Accepts ``raw_dir/<table>/`` (a directory of part files) or ``raw_dir/<table>.parquet``.
    Only file footers are read.
    """
    candidates = [raw_dir / table, raw_dir / f"{table}.parquet"]
    path = next((p for p in candidates if p.exists()), None)
    if path is None:
        raise PipelineInputError(
            f"missing input table {table!r}: neither {candidates[0]} nor {candidates[1]} exists "
            "(run the ingest stage first)"
        )
    files = parquet_files(path)
    if not files:
        raise PipelineInputError(f"input table {table!r} at {path} holds no .parquet files")
    for file in files:
        _check_columns(
            table, read_schema_names(file, f"of table {table!r} (corrupt or not Parquet)"), where=file
        )
    return files


def _validate_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise PipelineInputError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    return backend


def _validate_holdout(holdout_months: object) -> int:
    if (
        isinstance(holdout_months, bool)
        or not isinstance(holdout_months, (int, np.integer))
        or not 1 <= holdout_months <= 11
    ):
        raise PipelineInputError(
            f"holdout_months must be an int from 1 to 11 (months at the end of each year "
            f"held out as test), got {holdout_months!r}"
        )
    return int(holdout_months)


# --------------------------------------------------------------------------- features


def _is_dask(obj: object) -> bool:
    return isinstance(obj, (dd.DataFrame, dd.Series))


def _host_values(values: Any) -> list[str]:
    """Unique values from pandas, cuDF or Arrow-backed arrays as a sorted list of str."""
    if hasattr(values, "to_pandas"):  # cuDF Series / Index
        values = values.to_pandas()
    return sorted({str(v) for v in pd.Series(values).dropna().tolist()})


def category_vocabulary(flights: Any) -> dict[str, list[str]]:
    """Sorted distinct values of ``carrier``, ``origin`` and ``dest`` (one pass for Dask frames).

    Args:
        flights: Flights as a pandas, cuDF or Dask frame.

    Returns:
        ``{"carrier": [...], "origin": [...], "dest": [...]}``; the code of a value is its position.
    """
    uniques = [flights[c].unique() for c in CATEGORICAL_COLUMNS]
    if _is_dask(flights):
        uniques = list(dask_compute(*uniques))
    return {c: _host_values(u) for c, u in zip(CATEGORICAL_COLUMNS, uniques, strict=True)}


def _codes_partition(series: Any, mapping: Mapping[str, int]) -> Any:
    """Map values to integer codes (pandas or cuDF series); unknown/missing -> -1."""
    return series.map(dict(mapping)).fillna(-1).astype("int32")


def _codes(series: Any, vocabulary: Sequence[str]) -> Any:
    mapping = {value: code for code, value in enumerate(vocabulary)}
    if _is_dask(series):
        return series.map_partitions(_codes_partition, mapping, meta=(series.name, "int32"))
    return _codes_partition(series, mapping)


def weekday(year: Any, month: Any, day: Any) -> Any:
    """Day of week (Monday = 0) of a civil date, by integer arithmetic.

    Works elementwise on ints, numpy arrays, and pandas/cuDF/Dask series alike
    (days-from-civil algorithm of H. Hinnant; 1970-01-01 was a Thursday).

    Args:
        year: Calendar year(s).
        month: Month(s), 1-12.
        day: Day(s) of month.

    Returns:
        Weekday number(s), 0-6, same container type as the inputs.
    """
    y = year - (month <= 2) * 1
    era = y // 400
    yoe = y - era * 400
    mp = (month + 9) % 12  # March = 0 ... February = 11
    doy = (153 * mp + 2) // 5 + day - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    days = era * 146097 + doe - 719468
    return (days + 3) % 7


def featurize(
    flights: Any,
    weather: Any,
    planes: Any,
    vocabulary: Mapping[str, Sequence[str]] | None = None,
) -> Any:
    """Join and encode flights, weather and planes into the feature table (lazy for Dask).

    Steps: drop cancelled/diverted flights (``dep_time`` or ``arr_delay`` missing);
    left-join weather on ``(origin, time_hour)`` after collapsing it to one row per
    key (mean of duplicates) so no flight is duplicated; left-join planes on
    ``tailnum`` (one row per tail number; its ``year`` becomes ``plane_year``);
    derive the features and the ``delayed`` label. Row count out = non-cancelled
    flights in.

    Args:
        flights: Flights, a pandas, cuDF or Dask frame with :data:`REQUIRED_COLUMNS` ``["flights"]``.
        weather: Weather, same kind of frame.
        planes: Planes, same kind of frame.
        vocabulary: Category vocabulary from :func:`category_vocabulary`; computed
            from ``flights`` when omitted (pass it to keep codes fixed across calls).

    Returns:
        A frame of the same kind with :data:`FEATURE_COLUMNS` and :data:`LABEL`.

    Raises:
        PipelineInputError: a required column is missing, or ``time_hour`` types differ.
    """
    for name, frame in (("flights", flights), ("weather", weather), ("planes", planes)):
        _check_columns(name, frame.columns)
    if vocabulary is None:
        vocabulary = category_vocabulary(flights)

    f = flights[list(REQUIRED_COLUMNS["flights"])]
    f = f[f["arr_delay"].notnull() & f["dep_time"].notnull()]

    weather_cols = [c for c in WEATHER_FEATURES if c in weather.columns]
    w = weather[_WEATHER_KEY + weather_cols]
    if w["time_hour"].dtype != f["time_hour"].dtype:
        if pd.api.types.is_datetime64_dtype(w["time_hour"].dtype) and pd.api.types.is_datetime64_dtype(
            f["time_hour"].dtype
        ):
            w = w.assign(time_hour=w["time_hour"].astype(f["time_hour"].dtype))
        else:
            raise PipelineInputError(
                f"time_hour has type {f['time_hour'].dtype} in flights but {w['time_hour'].dtype} "
                "in weather; both must be the same (naive UTC datetimes)"
            )
    w = w.groupby(_WEATHER_KEY).agg({c: "mean" for c in weather_cols}).reset_index()

    p = planes[["tailnum", "year", "seats"]].groupby("tailnum").agg({"year": "mean", "seats": "mean"})
    p = p.reset_index().rename(columns={"year": "plane_year"})

    df = f.merge(w, how="left", on=_WEATHER_KEY).merge(p, how="left", on="tailnum")
    for col in WEATHER_FEATURES:
        if col not in weather_cols:
            df = df.assign(**{col: np.nan})

    features = {
        "sched_dep_hour": df["sched_dep_time"] // 100,
        "weekday": weekday(df["year"], df["month"], df["day"]),
        "month": df["month"],
        **{f"{c}_code": _codes(df[c], vocabulary[c]) for c in CATEGORICAL_COLUMNS},
        "distance": df["distance"],
        "plane_age": df["year"] - df["plane_year"],
        "seats": df["seats"],
        **{c: df[c] for c in WEATHER_FEATURES},
    }
    features = {
        name: col.astype("int32" if name in INT_FEATURES else "float32") for name, col in features.items()
    }
    features[LABEL] = (df["arr_delay"] > DELAY_THRESHOLD_MINUTES).astype("int8")
    return df.assign(**features)[[*FEATURE_COLUMNS, LABEL]]


# --------------------------------------------------------------------------- stage


def build_features(
    raw_dir: Path,
    out_dir: Path,
    backend: str = "pandas",
    holdout_months: int = 2,
) -> dict[str, Any]:
    """Build the train/test feature tables from the raw Parquet tables.

    Reads ``raw_dir/{flights,weather,planes}`` with ``dask.dataframe`` on the given
    backend, runs :func:`featurize`, and writes ``out_dir/train`` and
    ``out_dir/test`` (Parquet, one file per partition) in one Dask computation.
    Each directory is written into a temporary sibling and renamed into place;
    ``out_dir/_manifest.json`` (row counts, feature columns, vocabulary) is
    removed before the swap and written last, so it marks a complete build.

    Args:
        raw_dir: Directory written by :func:`gpu_tasks.pipeline.data.ingest`.
        out_dir: Where ``train``, ``test`` and the manifest go (created if missing).
        backend: ``"pandas"`` (CPU) or ``"cudf"`` (GPU, needs dask-cuDF).
        holdout_months: Last calendar months of each year held out as test (1-11).

    Returns:
        ``{"features_dir", "train_rows", "test_rows", "feature_columns", "label",
        "backend", "manifest_path"}``.

    Raises:
        PipelineInputError: a missing directory/table, an unreadable Parquet file,
            a missing column, an empty flights table, or an empty train/test split.
        gpu_tasks._gpu.GpuLibraryUnavailable: ``backend="cudf"`` without dask-cuDF.
    """
    backend = _validate_backend(backend)
    holdout_months = _validate_holdout(holdout_months)
    raw_dir, out_dir = Path(raw_dir), Path(out_dir)
    if not raw_dir.is_dir():
        raise PipelineInputError(f"raw data directory {raw_dir} does not exist (run the ingest stage first)")
    files = {table: _table_files(raw_dir, table) for table in REQUIRED_COLUMNS}
    flight_rows = sum(parquet_row_count(f) for f in files["flights"])
    if flight_rows == 0:
        raise PipelineInputError(
            f"flights table under {raw_dir} is empty (0 rows in {len(files['flights'])} file(s))"
        )
    if backend == "cudf":
        _gpu.load("dask_cudf")  # fail clearly, naming the missing library, before any work

    test_months = list(range(13 - holdout_months, 13))
    logger.info(
        "building features from %s (%d flights, backend %s, test months %s)",
        raw_dir,
        flight_rows,
        backend,
        test_months,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = out_dir / FEATURES_MANIFEST_NAME
    with (
        parquet_errors(f"reading the raw tables under {raw_dir} failed"),
        dask.config.set({"dataframe.backend": backend}),
    ):
        tables = {
            table: dd.read_parquet([str(f) for f in paths], columns=list(_columns_to_read(table, paths)))
            for table, paths in files.items()
        }
        vocabulary = category_vocabulary(tables["flights"])
        feats = featurize(tables["flights"], tables["weather"], tables["planes"], vocabulary)
        is_test = feats["month"] > 12 - holdout_months
        with atomic_directory(out_dir / "train") as train_tmp, atomic_directory(out_dir / "test") as test_tmp:
            dask_compute(
                feats[~is_test].to_parquet(str(train_tmp), write_index=False, compute=False),
                feats[is_test].to_parquet(str(test_tmp), write_index=False, compute=False),
            )
            train_rows, test_rows = parquet_row_count(train_tmp), parquet_row_count(test_tmp)
            if train_rows == 0 or test_rows == 0:
                raise PipelineInputError(
                    f"time split of {raw_dir} is unusable: {train_rows} train and {test_rows} test rows "
                    f"(test = months {test_months}); the data must cover months on both sides"
                    + _limit_hint(raw_dir)
                )
            manifest_path.unlink(missing_ok=True)  # the old manifest must not describe new data

    write_json_atomic(
        manifest_path,
        {
            "train_rows": train_rows,
            "test_rows": test_rows,
            "feature_columns": FEATURE_COLUMNS,
            "label": LABEL,
            "backend": backend,
            "holdout_months": holdout_months,
            "test_months": test_months,
            "vocabulary": vocabulary,
            "raw_dir": str(raw_dir),
            "created_at": _dt.datetime.now(_dt.UTC).isoformat(),
        },
    )
    logger.info("features written to %s: %d train rows, %d test rows", out_dir, train_rows, test_rows)
    return {
        "features_dir": str(out_dir),
        "train_rows": train_rows,
        "test_rows": test_rows,
        "feature_columns": list(FEATURE_COLUMNS),
        "label": LABEL,
        "backend": backend,
        "manifest_path": str(manifest_path),
    }


def _limit_hint(raw_dir: Path) -> str:
    """A hint to raise ``limit`` when ``raw_dir`` was ingested with one (per its manifest), else ``""``."""
    try:
        limit = json.loads((raw_dir / RAW_MANIFEST_NAME).read_text()).get("limit")
    except (OSError, ValueError, AttributeError):
        return ""
    return "" if limit is None else f"; it was ingested with limit={limit} flights: raise limit to cover both"


def _columns_to_read(table: str, paths: Sequence[Path]) -> list[str]:
    """Required columns plus the optional weather columns present in every file."""
    columns = list(REQUIRED_COLUMNS[table])
    if table == "weather":
        names = [set(read_schema_names(p)) for p in paths]
        columns += [c for c in sorted(OPTIONAL_WEATHER) if all(c in n for n in names)]
    return columns


def read_manifest(features_dir: Path) -> dict[str, Any]:
    """The manifest of a feature build, or ``{}`` when there is none.

    Args:
        features_dir: ``out_dir`` of :func:`build_features`.

    Returns:
        The parsed ``_manifest.json``.

    Raises:
        PipelineInputError: the manifest exists but is not valid JSON.
    """
    path = Path(features_dir) / FEATURES_MANIFEST_NAME
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PipelineInputError(f"feature manifest {path} is unreadable: {exc}") from exc
