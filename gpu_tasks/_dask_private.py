"""The private Dask/distributed APIs gpu-tasks relies on, each with why and the versions checked.

Checked against distributed 2026.7.1 (the version pinned in pyproject.toml and by
dask-cuda 26.10). Each wrapper degrades to a logged no-op or a clear error on a
version where the private name is gone, so a Dask upgrade fails here, in one place.

One private hook cannot live here: :class:`gpu_tasks._nanny.WatchedNanny` overrides
``Nanny._on_worker_exit_sync`` (called with the worker process's exit code) to learn
how a worker died; a subclass has to override it where it is defined.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def correct_state(cluster: Any) -> None:
    """Make a ``SpecCluster`` start or stop workers to match its ``worker_spec`` now.

    ``SpecCluster.scale`` can only add copies of its ``new_spec``; a profile's workers
    each have their own devices, so gpu-tasks edits ``worker_spec`` and applies it with
    the private ``_correct_state`` (what ``scale`` itself calls), synchronously.
    """
    cluster.sync(cluster._correct_state)


def forget_closed_schedulers() -> None:
    """Let closed Dask schedulers be freed.

    distributed 2026.7.1 memoizes ``distributed.core._expects_comm`` with an unbounded
    ``functools.cache`` keyed by bound handler methods, so every Scheduler that ever
    handled a request stays alive (its state, deques and HTTP routes) after it closes:
    one per provisioned cluster in a long-lived flow process. Clearing the cache after a
    close drops them; live servers only recompute a signature check.
    """
    try:
        from distributed import core

        core._expects_comm.cache_clear()
    except Exception:  # another distributed version: nothing to clear
        logger.debug("no distributed.core._expects_comm cache to clear", exc_info=True)


def worker_threads() -> int:
    """Threads of the Dask worker this code runs in (1 outside a worker).

    ``Worker.state.nthreads`` (the worker state machine) has no public accessor.
    """
    try:
        from distributed import get_worker

        return max(1, int(get_worker().state.nthreads))
    except Exception:
        return 1
