"""Imported by the warm-pool fork server (:data:`gpu_tasks.worker.warm.WARM_IMPORTS`): per-process
start-up work done once there and inherited by every fork (docs/operations.md): Prefect's
collections (loaded at a worker's first block), the package versions a Dask worker registers with,
and the ``DASK_*`` environment its config was read with (:func:`dask_config_is_current`).
"""

from __future__ import annotations

import os

from distributed.versions import get_versions
from prefect.plugins import load_prefect_collections


def _dask_environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("DASK_")}


_READ_WITH = _dask_environ()  # Dask read its config at its import, just before this
load_prefect_collections()
get_versions()


def dask_config_is_current() -> bool:
    """Whether Dask's config in this process is what :func:`dask.config.refresh` would read now: the
    ``DASK_*`` variables are those it was read with (its YAML files are taken as unchanged since)."""
    return _dask_environ() == _READ_WITH
