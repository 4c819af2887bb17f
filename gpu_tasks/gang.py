"""Gang start for data-parallel training: one Dask worker per allocated device, all or none.

A task that holds several devices (``gpus=n``) starts a private cluster with one
worker process per device, each owning its device through ``CUDA_VISIBLE_DEVICES``,
and hands out a client only once *every* worker is up. If one cannot start, all
are stopped and the task fails: no partial start.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gpu_tasks.allocation import Allocation
from gpu_tasks.clusters import LOCALHOST
from gpu_tasks.errors import ClusterError

logger = logging.getLogger(__name__)


@contextmanager
def gang_client(alloc: Allocation, timeout: float = 120.0) -> Iterator[Any]:
    """A Dask client over one worker per device of ``alloc``, once all are up."""
    from distributed import Client, Nanny, Scheduler, SpecCluster

    if len(alloc.devices) < 2:
        raise ClusterError(f"a gang needs at least two devices; this task holds {list(alloc.devices)}")
    workers = {
        f"gang-{dev}": {
            "cls": Nanny,
            "options": {
                "nthreads": 1, "host": LOCALHOST, "resources": {"GPU": 1.0},
                "env": {"CUDA_VISIBLE_DEVICES": dev}, "dashboard_address": f"{LOCALHOST}:0",
                "silence_logs": logging.WARNING,
            },
        }
        for dev in alloc.devices
    }
    scheduler = {"cls": Scheduler, "options": {"host": LOCALHOST, "dashboard": False, "dashboard_address": f"{LOCALHOST}:0"}}
    cluster = client = None
    try:
        cluster = SpecCluster(workers=workers, scheduler=scheduler, name="gpu-tasks-gang", silence_logs=logging.WARNING)
        client = Client(cluster, set_as_default=False, timeout=timeout)
        client.wait_for_workers(len(workers), timeout=timeout)
    except Exception as exc:
        for thing in (client, cluster):
            if thing is not None:
                thing.close()
        raise ClusterError(
            f"gang of {len(workers)} workers on devices {','.join(alloc.devices)} did not all start "
            f"within {timeout:g}s; released all of them: {exc}"
        ) from exc
    logger.info("gang of %d workers up on devices %s", len(workers), ",".join(alloc.devices))
    try:
        # Current for the caller's context: xgboost.dask calls distributed.wait(), which looks
        # the client up; inside a Dask worker it would otherwise find the worker's own client
        # (the profile cluster's) and block forever.
        with client.as_current():
            yield client
    finally:
        client.close()
        cluster.close()
