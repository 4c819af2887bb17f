"""Training stage: an XGBoost binary classifier for ``delayed`` on the feature tables.

Two ways to train, same parameters and model format:

* single process (``client=None``): ``xgboost.train`` on a ``QuantileDMatrix``.
  With ``device="cuda"`` the data is read with cuDF (kept on the GPU, no host
  copy) when cuDF is installed, else with pandas (XGBoost copies it over);
* data parallel (a synchronous ``dask.distributed.Client``): ``xgboost.dask.train``
  on a ``DaskQuantileDMatrix`` built from ``dask.dataframe.read_parquet`` (on the
  cuDF backend when ``device="cuda"`` and dask-cuDF is installed).

``on_round(iteration, metrics)`` is called in the caller's process after each
boosting round with the training metrics of that round, e.g.
``{"train-auc": 0.71, "train-logloss": 0.49}``. With a Dask client the rank-0
worker publishes each round as a Dask event that is relayed to ``on_round``
while training runs; rounds whose event has not arrived when training ends are
replayed from the returned history, so ``on_round`` still sees every round once.

Training is deterministic for a given ``seed`` and data layout (no row or
column subsampling; ``hist`` on CPU is deterministic). The model is saved as
JSON (``.json``) or UBJSON (``.ubj``) through a temporary file and ``os.replace``.
"""

from __future__ import annotations

import logging
import queue
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import xgboost as xgb
from xgboost.callback import TrainingCallback

from gpu_tasks import _gpu
from gpu_tasks.pipeline._io import (
    atomic_file,
    parquet_files,
    parquet_row_count,
    read_parquet_frame,
    read_schema_names,
)
from gpu_tasks.pipeline.errors import PipelineInputError
from gpu_tasks.pipeline.etl import FEATURE_COLUMNS, LABEL, read_manifest

if TYPE_CHECKING:
    from distributed import Client

logger = logging.getLogger(__name__)

MODEL_SUFFIXES: tuple[str, ...] = (".json", ".ubj")

DEFAULT_PARAMS: dict[str, Any] = {
    "objective": "binary:logistic",
    "eval_metric": ["auc", "logloss"],
    "tree_method": "hist",
    "max_depth": 6,
    "eta": 0.1,
    "min_child_weight": 5.0,
    "max_bin": 256,
}
"""Booster parameters; :func:`train_model` adds ``device`` and ``seed``."""

RoundCallback = Callable[[int, dict[str, float]], None]


# --------------------------------------------------------------------------- callbacks


def _latest(evals_log: Mapping[str, Mapping[str, Sequence[Any]]]) -> dict[str, float]:
    """``{"train-auc": last value, ...}`` from XGBoost's ``{"train": {"auc": [...]}}`` log."""
    out: dict[str, float] = {}
    for data_name, metrics in evals_log.items():
        for metric, values in metrics.items():
            if len(values):
                last = values[-1]
                out[f"{data_name}-{metric}"] = float(last[0] if isinstance(last, tuple) else last)
    return out


def _flatten_history(evals_result: Mapping[str, Mapping[str, Sequence[Any]]]) -> dict[str, list[float]]:
    """``{"train-auc": [per round], ...}`` from XGBoost's nested evaluation history."""
    return {
        f"{data_name}-{metric}": [float(v) for v in values]
        for data_name, metrics in evals_result.items()
        for metric, values in metrics.items()
    }


class RoundReporter(TrainingCallback):
    """Calls ``on_round(iteration, metrics)`` after every boosting round (single process)."""

    def __init__(self, on_round: RoundCallback) -> None:
        super().__init__()
        self._on_round = on_round

    def after_iteration(self, model: Any, epoch: int, evals_log: Any) -> bool:
        """Report the round; never asks XGBoost to stop."""
        self._on_round(epoch, _latest(evals_log))
        return False


class DaskRoundPublisher(TrainingCallback):
    """Runs on Dask workers: rank 0 publishes each round as an event under ``topic``.

    Metrics are all-reduced across workers, so one publisher is enough.
    """

    def __init__(self, topic: str) -> None:
        super().__init__()
        self.topic = topic

    def after_iteration(self, model: Any, epoch: int, evals_log: Any) -> bool:
        """Publish the round from rank 0; never asks XGBoost to stop."""
        from distributed import get_worker
        from xgboost import collective

        if collective.get_rank() == 0:
            get_worker().log_event(self.topic, {"iteration": int(epoch), "metrics": _latest(evals_log)})
        return False


# --------------------------------------------------------------------------- inputs


def _validate_args(model_path: Path, device: str, num_rounds: object) -> None:
    if model_path.suffix not in MODEL_SUFFIXES:
        raise PipelineInputError(
            f"model_path {model_path} must end in one of {list(MODEL_SUFFIXES)} (JSON or UBJSON model)"
        )
    if not isinstance(device, str) or device.split(":", 1)[0] not in ("cpu", "cuda", "gpu"):
        raise PipelineInputError(f"device must be 'cpu', 'cuda' or 'cuda:<ordinal>', got {device!r}")
    if isinstance(num_rounds, bool) or not isinstance(num_rounds, (int, np.integer)) or num_rounds < 1:
        raise PipelineInputError(f"num_rounds must be an int >= 1, got {num_rounds!r}")


def _is_gpu(device: str) -> bool:
    return device.split(":", 1)[0] in ("cuda", "gpu")


def feature_split(features_dir: Path, split: str) -> tuple[Path, list[str], str]:
    """Locate a split of a feature build and check its columns.

    Args:
        features_dir: ``out_dir`` of :func:`gpu_tasks.pipeline.etl.build_features`.
        split: ``"train"`` or ``"test"``.

    Returns:
        ``(split directory, feature columns, label column)``; columns come from the
        build manifest when there is one, else :data:`gpu_tasks.pipeline.etl.FEATURE_COLUMNS`.

    Raises:
        PipelineInputError: the directory is missing, holds no Parquet files, a file
            is unreadable, or columns are missing.
    """
    features_dir = Path(features_dir)
    manifest = read_manifest(features_dir)
    columns = list(manifest.get("feature_columns", FEATURE_COLUMNS))
    label = str(manifest.get("label", LABEL))
    path = features_dir / split
    if not path.is_dir():
        raise PipelineInputError(
            f"{split} features directory {path} does not exist (run the ETL stage first)"
        )
    files = parquet_files(path)
    if not files:
        raise PipelineInputError(f"{split} features directory {path} holds no .parquet files")
    names = read_schema_names(files[0])
    missing = [c for c in [*columns, label] if c not in names]
    if missing:
        raise PipelineInputError(f"{split} features in {path} lack column(s) {missing}; they have {names}")
    return path, columns, label


def _read_local(path: Path, columns: list[str], device: str) -> Any:
    """The split as one frame: cuDF for a GPU device when available, else pandas."""
    if _is_gpu(device):
        if _gpu.available("cudf"):
            return _gpu.load("cudf").read_parquet(str(path), columns=columns)
        logger.warning(
            "device %s without cuDF (%s): reading with pandas, XGBoost copies the data to the GPU",
            device,
            _gpu.why_unavailable("cudf"),
        )
    return read_parquet_frame(path, columns)


# --------------------------------------------------------------------------- training


def train_model(
    features_dir: Path,
    model_path: Path,
    device: str = "cpu",
    seed: int = 0,
    num_rounds: int = 50,
    on_round: RoundCallback | None = None,
    client: Client | None = None,
) -> dict[str, Any]:
    """Train the delay classifier on ``features_dir/train`` and save it to ``model_path``.

    Args:
        features_dir: ``out_dir`` of :func:`gpu_tasks.pipeline.etl.build_features`.
        model_path: Where to save the model; ``.json`` or ``.ubj``. Parents are created.
        device: XGBoost device: ``"cpu"``, ``"cuda"`` or ``"cuda:<ordinal>"``.
        seed: Booster seed; the same seed and data give identical predictions.
        num_rounds: Boosting rounds (>= 1).
        on_round: Called as ``on_round(iteration, {"train-auc": ..., "train-logloss": ...})``
            after each round, in the calling process.
        client: A synchronous ``dask.distributed.Client`` to train data-parallel with
            ``xgboost.dask``; ``None`` trains in this process.

    Returns:
        ``{"model_path", "num_rounds", "device", "train_rows", "seconds", "history"}``;
        ``history`` maps ``"train-auc"``/``"train-logloss"`` to per-round values.

    Raises:
        PipelineInputError: bad arguments or missing/unreadable features.
    """
    started = time.perf_counter()
    model_path = Path(model_path)
    _validate_args(model_path, device, num_rounds)
    num_rounds = int(num_rounds)
    train_dir, columns, label = feature_split(Path(features_dir), "train")
    params = {**DEFAULT_PARAMS, "device": device, "seed": int(seed)}
    logger.info(
        "training %d rounds on %s (device %s, %s)",
        num_rounds,
        train_dir,
        device,
        "dask client" if client is not None else "single process",
    )

    if client is None:
        frame = _read_local(train_dir, [*columns, label], device)
        train_rows = len(frame)
        if train_rows == 0:
            raise PipelineInputError(f"train features in {train_dir} have no rows")
        dtrain = xgb.QuantileDMatrix(frame[columns], label=frame[label])
        del frame
        evals_result: dict[str, Any] = {}
        booster = xgb.train(
            params,
            dtrain,
            num_boost_round=num_rounds,
            evals=[(dtrain, "train")],
            evals_result=evals_result,
            verbose_eval=False,
            callbacks=[RoundReporter(on_round)] if on_round is not None else None,
        )
        history = _flatten_history(evals_result)
    else:
        train_rows = parquet_row_count(train_dir)
        if train_rows == 0:
            raise PipelineInputError(f"train features in {train_dir} have no rows")
        booster, history = _train_dask(
            client, params, train_dir, columns, label, num_rounds, on_round, device
        )

    save_model(booster, model_path)
    seconds = time.perf_counter() - started
    logger.info("trained %d rounds on %d rows in %.1f s -> %s", num_rounds, train_rows, seconds, model_path)
    return {
        "model_path": str(model_path),
        "num_rounds": num_rounds,
        "device": device,
        "train_rows": int(train_rows),
        "seconds": seconds,
        "history": history,
    }


def _train_dask(
    client: Client,
    params: dict[str, Any],
    train_dir: Path,
    columns: list[str],
    label: str,
    num_rounds: int,
    on_round: RoundCallback | None,
    device: str,
) -> tuple[xgb.Booster, dict[str, list[float]]]:
    """Data-parallel training with ``xgboost.dask``; relays rounds to ``on_round`` live."""
    import dask
    import dask.dataframe as dd
    import xgboost.dask as dxgb

    backend = "cudf" if _is_gpu(device) and _gpu.available("dask_cudf") else "pandas"
    with dask.config.set({"dataframe.backend": backend}):
        ddf = dd.read_parquet(str(train_dir), columns=[*columns, label])
    # Persist the whole frame first: dask-expr may fuse the parquet files differently for
    # the feature and the label projections, and XGBoost needs them partition-aligned.
    ddf = client.persist(ddf)
    dtrain = dxgb.DaskQuantileDMatrix(client, ddf[columns], ddf[label])
    kwargs: dict[str, Any] = {
        "num_boost_round": num_rounds,
        "evals": [(dtrain, "train")],
        "verbose_eval": False,
    }
    if on_round is None:
        output = dxgb.train(client, params, dtrain, **kwargs)
        return output["booster"], _flatten_history(output["history"])

    topic = f"gpu-tasks-xgboost-{uuid.uuid4().hex}"
    events: queue.Queue[Any] = queue.Queue()
    delivered: set[int] = set()

    def deliver(message: Mapping[str, Any]) -> None:
        iteration = int(message["iteration"])
        if iteration not in delivered:
            delivered.add(iteration)
            on_round(iteration, dict(message["metrics"]))

    client.subscribe_topic(topic, lambda event: events.put(event[1]))
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="xgboost-dask-train") as pool:
            future = pool.submit(
                dxgb.train, client, params, dtrain, callbacks=[DaskRoundPublisher(topic)], **kwargs
            )
            while True:
                try:
                    deliver(events.get(timeout=0.1))
                except queue.Empty:
                    if future.done():
                        break
            output = future.result()
    finally:
        client.unsubscribe_topic(topic)
    while not events.empty():
        deliver(events.get_nowait())
    history = _flatten_history(output["history"])
    missed = [i for i in range(num_rounds) if i not in delivered]
    if missed:  # events still in flight when training ended: replay them from the history
        logger.debug("replaying %d of %d rounds from the training history", len(missed), num_rounds)
    for iteration in missed:
        deliver({"iteration": iteration, "metrics": {k: v[iteration] for k, v in history.items()}})
    return output["booster"], history


# --------------------------------------------------------------------------- model files


def save_model(booster: xgb.Booster, model_path: Path) -> None:
    """Save ``booster`` to ``model_path`` atomically (:func:`gpu_tasks.pipeline._io.atomic_file`).

    Args:
        booster: The trained booster.
        model_path: Destination ending in ``.json`` or ``.ubj`` (the format follows the suffix).
    """
    with atomic_file(Path(model_path)) as tmp:
        booster.save_model(str(tmp))


def load_model(model_path: Path) -> xgb.Booster:
    """Load a model saved by :func:`train_model`.

    Args:
        model_path: A ``.json`` or ``.ubj`` model file.

    Returns:
        The booster.

    Raises:
        PipelineInputError: the file is missing or is not a valid XGBoost model.
    """
    model_path = Path(model_path)
    if not model_path.is_file():
        raise PipelineInputError(f"model file {model_path} does not exist (run the training stage first)")
    booster = xgb.Booster()
    try:
        booster.load_model(str(model_path))
    except xgb.core.XGBoostError as exc:
        raise PipelineInputError(f"model file {model_path} is not a valid XGBoost model: {exc}") from exc
    return booster
