"""Which kind of cluster a profile gets (this host's, ``address=``, ``cluster_class=``): the one place
that tells them apart; the flow side holds each as a :class:`ProfileCluster`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpu_tasks.cluster.address import AddressCluster
from gpu_tasks.cluster.local import ProfileCluster
from gpu_tasks.cluster.managed import ManagedCluster
from gpu_tasks.devices.book import DeviceBook
from gpu_tasks.devices.discovery import Inventory
from gpu_tasks.profiles import ResourceProfile

# This host's workers run the flow process's own Prefect against the API it already checked: no
# server version check (docs/runner.md); the other kinds' workers may run another Prefect.
SAME_PREFECT_ENV = {"PREFECT_CLIENT_SERVER_VERSION_CHECK_ENABLED": "false"}


def placed_on_this_host(profile: ResourceProfile) -> bool:
    """Whether ``profile``'s workers run on this host, whose inventory tells at submit if it can ever run."""
    return profile.is_local


def starts_processes_here(profile: ResourceProfile) -> bool:
    """Whether ``profile``'s workers are processes this host starts (the warm pool's candidates)."""
    return profile.is_local and profile.uses_processes


def new_cluster(
    profile: ResourceProfile,
    *,
    inventory: Callable[[], Inventory],
    worker_env: dict[str, str],
    provision_timeout: float,
    dashboard: bool,
    book: DeviceBook,
    pool: Any,
    api_url: str | None,
    on_board: Callable[[str, dict[str, Any]], None] | None,
) -> ProfileCluster:
    """The cluster of ``profile`` in one flow run, not started. ``inventory`` is called only for a local
    GPU profile (it costs NVML's start); ``on_board`` hears an address profile's preemptions."""
    if profile.is_local:
        return ProfileCluster(
            profile,
            inventory() if profile.is_gpu else Inventory(),
            {**worker_env, **SAME_PREFECT_ENV},
            provision_timeout,
            dashboard=dashboard,
            book=book,
            pool=pool,
        )
    if profile.address is not None:
        return AddressCluster(profile, worker_env, provision_timeout, dashboard, api_url, on_board=on_board)
    return ManagedCluster(profile, worker_env, provision_timeout, dashboard, api_url)
