"""A worker process on its devices' CPUs: the flow side decides (:func:`plan`) and passes them in
:data:`ENV`; the worker preload applies them. With :data:`ENV` set, dask-cuda's own CPU-affinity
plugin is left out: one owner of the worker's CPUs."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence

from gpu_tasks.devices.topology import format_cpus, parse_cpus, worker_cores

logger = logging.getLogger(__name__)

ENV = "_GPU_TASKS_WORKER_CPUS"  # the CPU list to pin the worker to; "" leaves its CPUs as they are
OFF = "off (cpu_affinity=False)"
UNSUPPORTED = "not applied: this platform cannot set a process's CPU affinity"
_said: list[object] = []  # what this process has said once at INFO


def supported() -> bool:
    """Whether this platform sets a process's CPU affinity (Linux)."""
    return hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity")


def plan(enabled: bool, cpus: Sequence[str | None]) -> tuple[str, str]:
    """``(value of ENV, what the ledger records)`` for a worker whose devices have ``cpus``."""
    if not enabled:
        return "", OFF
    if not supported():
        if not _said:
            _said.append(True)
            logger.info("workers keep their CPUs: %s", UNSUPPORTED.removeprefix("not applied: "))
        return "", UNSUPPORTED
    cores, record = worker_cores(cpus, os.sched_getaffinity(0))
    if cores is None:
        # once per process and reason at INFO, then DEBUG
        logger.log(logging.DEBUG if record in _said else logging.INFO, "worker CPU affinity %s", record)
        _said.append(record)
        return "", record
    return format_cpus(cores), record


def apply_from_env() -> None:
    """Pin every thread of this process to the CPUs :data:`ENV` names (later threads inherit them)."""
    text = os.environ.get(ENV, "")
    if not text or not supported():
        return
    try:
        cores = parse_cpus(text) & os.sched_getaffinity(0)
        if not cores:
            logger.warning("worker %d: CPUs %s are not available to it; left as they are", os.getpid(), text)
            return
        for tid in _threads():
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setaffinity(tid, cores)
    except (OSError, ValueError):
        logger.warning("worker %d: could not pin it to CPUs %s", os.getpid(), text, exc_info=True)
        return
    logger.info("worker %d: on CPUs %s (its devices')", os.getpid(), format_cpus(cores))


def _threads() -> list[int]:
    """This process's thread ids (Linux: /proc/self/task); the calling thread alone elsewhere."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]
