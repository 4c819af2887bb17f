"""The flow-side sampler of measured use: NVML, on the real devices this flow run's local profiles hold.
See docs/shared-hosts.md, "Measured use"."""

from __future__ import annotations

import contextvars
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import psutil

from gpu_tasks import _gpu
from gpu_tasks.devices.discovery import Device
from gpu_tasks.reporting.ledger import Usage
from gpu_tasks.reporting.measured import Sample

logger = logging.getLogger(__name__)


class Measurable(Protocol):
    """What the sampler reads of a profile's cluster (gpu_tasks.cluster.local.ProfileCluster)."""

    @property
    def profile(self) -> Any: ...
    @property
    def emulated(self) -> bool: ...
    @property
    def running(self) -> bool: ...
    @property
    def usage(self) -> Usage: ...
    @property
    def specs(self) -> Sequence[Any]: ...  # WorkerSpec: .devices is a tuple of Device


def no_nvml_reason() -> str | None:
    """Why NVML cannot be sampled here, or ``None`` when it can."""
    reason = _gpu.why_unavailable("pynvml")
    return None if reason is None else f"not measured (no NVML: {reason})"


class Sampler:
    """Samples the real devices of the clusters it watches, in one daemon thread."""

    def __init__(self, period: float) -> None:
        self.period = period
        self._clusters: list[Measurable] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._own: dict[int, bool] = {}
        self.ticks = 0  # ticks that read at least one device
        self.readings = 0  # device readings
        self.seconds = 0.0  # spent reading them

    def watch(self, cluster: Measurable) -> None:
        """Sample ``cluster``'s devices while it holds them (a local GPU profile on real devices)."""
        prof = cluster.profile
        if not (prof.is_gpu and prof.is_local) or cluster.emulated:
            return  # emulated: ProfileCluster says so itself; other hosts: not ours to sample
        if self.period <= 0:
            cluster.usage.not_measured("not measured (GPU_TASKS_TUNE_GPU_SAMPLE_SECONDS=0)")
            return
        reason = no_nvml_reason()
        if reason is not None:
            cluster.usage.not_measured(reason)
            return
        with self._lock:
            self._clusters.append(cluster)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=contextvars.copy_context().run,
                    args=(self._run,),
                    name="gpu-tasks-sampler",
                    daemon=True,
                )
                self._thread.start()

    def close(self) -> None:
        """Stop the thread (the last readings are kept) and log what sampling cost."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            if self.readings:
                logger.info(
                    "gpu-tasks: sampled devices %d times (%d readings), %.2f ms a reading",
                    self.ticks,
                    self.readings,
                    1000 * self.seconds / self.readings,
                )

    def _run(self) -> None:
        try:
            nvml = _gpu.nvml_init()
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            with self._lock:
                for cluster in self._clusters:
                    cluster.usage.not_measured(f"not measured (no NVML: {type(exc).__name__}: {exc})")
            return
        handles: dict[str, Any] = {}
        try:
            while not self._stop.wait(self.period):
                with self._lock:
                    clusters = [c for c in self._clusters if c.running]
                t0 = time.perf_counter()
                n = 0
                for cluster in clusters:
                    for spec in list(cluster.specs):
                        for device in spec.devices:
                            sample = self._read(nvml, handles, device)
                            if sample is not None:
                                cluster.usage.sampled(sample, self.period)
                                n += 1
                if n:
                    self.ticks += 1
                    self.readings += n
                    self.seconds += time.perf_counter() - t0
        except Exception:  # sampling is for watching; never fail the run over it
            logger.warning("gpu-tasks: device sampling stopped", exc_info=True)
        finally:
            _gpu.nvml_shutdown(nvml)

    def _read(self, nvml: Any, handles: dict[str, Any], device: Device) -> Sample | None:
        try:
            handle = handles.get(device.address)
            if handle is None:
                handle = handles[device.address] = _gpu.nvml_handle(nvml, device.uuid, device.address)
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            sm = _gpu.reported(lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            procs = _gpu.reported(lambda: nvml.nvmlDeviceGetComputeRunningProcesses(handle)) or []
        except Exception:
            logger.debug("gpu-tasks: could not sample device %s", device.address, exc_info=True)
            return None
        own = []
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            if used is not None and used < _gpu.NVML_NOT_REPORTED and self._ours(int(p.pid)):
                own.append((int(p.pid), int(used)))
        return Sample(
            time.time(),
            device.address,
            None if sm is None else float(sm),
            int(mem.used),
            int(mem.total),
            tuple(own),
        )

    def _ours(self, pid: int) -> bool:
        """Whether ``pid`` is this flow process or one of its descendants."""
        known = self._own.get(pid)
        if known is None:
            me = os.getpid()
            try:
                proc = psutil.Process(pid)
                known = pid == me or any(parent.pid == me for parent in proc.parents())
            except psutil.Error:
                known = False
            self._own[pid] = known
        return known
