"""Imported by the warm-pool fork server (:data:`gpu_tasks.worker.warm.WARM_IMPORTS`): work each
process paid at its start, done once there and inherited by every process it forks.

- Prefect's collections, the packages of its ``prefect.collections`` entry points (prefect-redis
  and the like). Prefect loads them on a process's first block (a task's result storage, in a
  worker) and caches the result per process: each warm worker paid it at its first task (about
  0.4 s of CPU with prefect-redis installed).
- The package versions a Dask worker registers with (``distributed.versions.get_versions``, which
  caches them per process): 31 ms of CPU per bound worker, read from each package's metadata.
- The ``DASK_*`` environment the server's Dask config was read with (:func:`dask_config_is_current`):
  a bound process whose environment has the same re-reads no config file (34 ms of CPU per bound
  worker, most of it parsing distributed's YAML).

A collection that fails to load is reported by Prefect as it would be in the worker.
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
