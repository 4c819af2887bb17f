"""The one guarded place where GPU libraries (cuDF, dask-cuda, rmm, pynvml) are imported: lazily,
with the outcome cached and *why* one is unavailable kept, so logs and the CLI can say so.
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

NVML_NOT_REPORTED = 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE, where pynvml does not turn it into None


class GpuLibraryUnavailable(ImportError):
    """A GPU library could not be imported; ``reason`` says why."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name} is not available: {reason}")
        self.reason = reason


@functools.cache
def _try_import(name: str) -> ModuleType | str:
    try:
        return importlib.import_module(name)
    except Exception as exc:  # ImportError, but also CUDA errors raised at import
        if isinstance(exc, ModuleNotFoundError):
            return "install the GPU extra: pip install 'gpu-tasks[gpu]'"
        return f"{type(exc).__name__}: {exc}"


def load(name: str) -> ModuleType:
    """Import a GPU library (``cudf``, ``rmm``, ``pynvml``...), or raise GpuLibraryUnavailable."""
    outcome = _try_import(name)
    if isinstance(outcome, str):
        raise GpuLibraryUnavailable(name, outcome)
    return outcome


def available(name: str) -> bool:
    """Whether ``name`` imports on this machine (the result is cached)."""
    return not isinstance(_try_import(name), str)


def why_unavailable(name: str) -> str | None:
    """The reason ``name`` does not import, or ``None`` when it does."""
    outcome = _try_import(name)
    return outcome if isinstance(outcome, str) else None


def nvml_init() -> Any:
    """``pynvml``, initialized (:func:`nvml_shutdown` after use); raises what ``nvmlInit`` raises."""
    lib = load("pynvml")
    lib.nvmlInit()
    return lib


def nvml_problem(exc: Exception) -> str:
    """Why :func:`nvml_init` raised ``exc``, in words."""
    if isinstance(exc, GpuLibraryUnavailable):
        return f"NVML not available ({exc.reason})"
    return f"no NVIDIA driver ({type(exc).__name__})"  # NVMLError_LibraryNotFound, DriverNotLoaded, ...


def nvml_shutdown(lib: Any) -> None:
    """``nvmlShutdown``; a failure is harmless, only logged."""
    try:
        lib.nvmlShutdown()
    except Exception:  # pragma: no cover
        logger.warning("nvmlShutdown failed", exc_info=True)


def nvml_handle(lib: Any, uuid: str | None, address: str) -> Any:
    """The NVML handle of a device: by ``uuid`` where known, else by its index ``address``."""
    if uuid:
        return lib.nvmlDeviceGetHandleByUUID(uuid)
    if address.isdigit():
        return lib.nvmlDeviceGetHandleByIndex(int(address))
    raise ValueError(f"no UUID or index for device {address!r}")


def reported(read: Any) -> Any:
    """``read()``, or ``None`` where it raises (an NVML call unsupported here: MIG, vGPU, old driver)."""
    try:
        return read()
    except Exception:
        return None


def text(value: Any) -> str:
    """An NVML string (``bytes`` in older pynvml) as ``str``."""
    return value.decode() if isinstance(value, bytes) else str(value)
