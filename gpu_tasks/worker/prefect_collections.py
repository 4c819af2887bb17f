"""Imported by the warm-pool fork server (:data:`gpu_tasks.worker.warm.WARM_IMPORTS`): Prefect's
collections, the packages of its ``prefect.collections`` entry points (prefect-redis and the
like), loaded once there.

Prefect loads them on a process's first block (a task's result storage, in a worker), and its
result is cached per process: without this each warm worker paid it at its first task (about
0.4 s of CPU with prefect-redis installed), now each fork server does once, and the processes it
forks inherit the loaded modules. A collection that fails to load is reported by Prefect as it
would be in the worker.
"""

from __future__ import annotations

from prefect.plugins import load_prefect_collections

load_prefect_collections()
