"""Which kind of cluster a profile gets: the one place that tells the three apart.

- :class:`~gpu_tasks.cluster.local.ProfileCluster`: this host's leased devices (or CPUs).
- :class:`~gpu_tasks.cluster.address.AddressCluster` (``address=``): an existing scheduler.
- :class:`~gpu_tasks.cluster.managed.ManagedCluster` (``cluster_class=``): a cluster manager's.

The flow side holds every kind as a :class:`ProfileCluster` and calls the same methods on each
(``start``, ``scale_to``, ``submit``, ``close``); nothing above this module
switches on the kind.
"""

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
    """Whether ``profile``'s workers run on this host's devices, so this host's inventory tells at
    submit whether it can ever be satisfied (the other kinds' workers are checked when they start)."""
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
    """The cluster of ``profile`` in one flow run (not started: ``start`` provisions it).

    ``inventory``: this host's devices, asked for only by a local GPU profile (discovering them
    costs NVML's start; the other kinds get none). ``on_board``: called with
    ``("preempting" | "preempted", info)`` when an ``address`` GPU profile's entry on its shared
    scheduler's board goes up or it interrupts tasks for another's.
    """
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
