"""Imported by the warm-pool fork server: start-up work done once there and inherited by every fork
(Prefect's collections, the versions a Dask worker registers with, the ``DASK_*`` environment)."""

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
    """Whether the ``DASK_*`` variables are those Dask's config was read with (YAML taken as unchanged)."""
    return _dask_environ() == _READ_WITH
