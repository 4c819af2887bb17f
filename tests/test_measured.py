"""Measured use: aggregation, right-size advice, the sampler against a fake NVML, and a flow run on
emulated devices that says ``not measured (emulated)`` with no invented numbers."""

from __future__ import annotations

import os
import time
import types
import uuid
from typing import Any

import pytest
from prefect import flow, task
from prefect.context import FlowRunContext

from gpu_tasks import ProfileTaskRunner, ResourceProfile, _gpu, profile
from gpu_tasks.devices import measure
from gpu_tasks.devices.discovery import Device
from gpu_tasks.reporting.artifacts import ledger_table, timeline_markdown
from gpu_tasks.reporting.events import right_size_resource
from gpu_tasks.reporting.ledger import Held, LedgerRow, Usage, right_size
from gpu_tasks.reporting.measured import (
    EMULATED_ADVICE,
    NOT_EMULATED,
    Measured,
    Sample,
    advice,
    aggregate,
    combine,
    oversized,
    suggested_memory,
    suggested_share,
)

GiB = 2**30
T0 = 1_800_000_000.0


def _samples(device: str = "0", sms=(20, 30, 19), used=(8 * GiB, 9.1 * GiB, 7 * GiB), proc=None):
    return [
        Sample(T0 + i, device, sm, int(u), 80 * GiB, ((4242, int(proc[i])),) if proc else ())
        for i, (sm, u) in enumerate(zip(sms, used, strict=True))
    ]


# ---------------------------------------------------------------- aggregation
def test_aggregate_means_sm_and_keeps_the_peaks_within_the_holding():
    samples = [*_samples(proc=(7 * GiB, 8 * GiB, 6 * GiB)), Sample(T0 + 10, "0", 100.0, 70 * GiB, 80 * GiB)]
    m = aggregate(samples, 1.0, T0, T0 + 5, busy=[(T0 + 1.5, T0 + 2.5)])  # the last one: after the holding
    assert m.samples == 3 and m.period == 1.0
    assert m.sm_mean == pytest.approx(23.0)
    assert m.peak_used == int(9.1 * GiB) and m.total == 80 * GiB
    assert m.process_peak == 8 * GiB and m.task_peak == 6 * GiB  # a task ran during the third sample only
    assert m.text() == (
        "SM 23% mean, peak 9.1 GiB of 80, worker process peak 8 GiB, 6 GiB while a task ran "
        "(3 samples every 1 s)"
    )


def test_no_sample_and_not_reported_figures_stay_absent():
    assert aggregate([], 1.0).samples == 0 and aggregate([], 1.0).sm_mean is None
    m = aggregate([Sample(T0, "0", None, None, None)], 1.0)
    assert m.samples == 1 and m.sm_mean is None and m.peak_used is None and m.process_peak is None


def test_combine_weights_the_sm_mean_by_samples_and_keeps_the_largest_peak():
    a = Measured(samples=1, period=1.0, sm_mean=90.0, peak_used=2 * GiB, total=80 * GiB)
    b = Measured(samples=3, period=1.0, sm_mean=10.0, peak_used=9 * GiB, total=80 * GiB)
    m = combine([a, b, Measured(note=NOT_EMULATED)])
    assert m.samples == 4 and m.sm_mean == pytest.approx(30.0) and m.peak_used == 9 * GiB


def test_not_measured_has_no_numbers():
    m = Measured(note=NOT_EMULATED)
    assert m.text() == NOT_EMULATED and not m.measured
    assert {k: v for k, v in m.as_dict().items() if v not in (None, 0)} == {"note": NOT_EMULATED}


# ---------------------------------------------------------------- advice
def test_the_example_line():
    m = Measured(samples=10, period=1.0, sm_mean=23.0, peak_used=int(9.1 * GiB), total=80 * GiB)
    assert advice("gpu-train", 1, m) == (
        "profile 'gpu-train' held 1 device; peak 9.1 GiB of 80, SM 23% mean: gpus=0.25 fits "
        "(12 GiB a task with headroom)"
    )


def test_the_thresholds_need_both_low_memory_and_low_sm():
    low = dict(samples=5, period=1.0, total=80 * GiB)
    assert oversized(Measured(sm_mean=49.0, peak_used=39 * GiB, **low))
    assert not oversized(Measured(sm_mean=50.0, peak_used=10 * GiB, **low))  # SM busy enough
    assert not oversized(Measured(sm_mean=10.0, peak_used=40 * GiB, **low))  # memory half used
    assert not oversized(Measured(sm_mean=None, peak_used=1 * GiB, **low))  # SM not reported
    assert advice("p", 1, Measured(sm_mean=80.0, peak_used=70 * GiB, **low)) is None


def test_the_process_peak_is_what_the_advice_counts_when_nvml_lists_it():
    m = Measured(samples=5, period=1.0, sm_mean=5.0, peak_used=60 * GiB, total=80 * GiB, process_peak=3 * GiB)
    assert oversized(m)  # the device's 60 GiB are mostly other programs'
    assert "peak 3 GiB of 80" in (advice("p", 1, m) or "")


def test_suggestion_arithmetic():
    assert suggested_memory(int(9.1 * GiB)) == 12 * GiB  # 9.1 * 1.25 = 11.4, up to 12
    assert suggested_memory(1) == GiB
    assert suggested_share(int(9.1 * GiB), 80 * GiB, 23.0) == 0.25  # SM 23% needs a quarter
    assert suggested_share(1 * GiB, 80 * GiB, 1.0) == pytest.approx(1 / 64)  # 1.6% fits 1/64
    assert suggested_share(30 * GiB, 80 * GiB, 5.0) == 0.5  # 37.5 GiB with headroom
    assert suggested_share(79 * GiB, 80 * GiB, 5.0) == 1.0


def test_emulated_devices_get_one_line_without_numbers():
    assert advice("p", 1, Measured(note=NOT_EMULATED), emulated=True) == EMULATED_ADVICE


# ---------------------------------------------------------------- ledger and artifacts
def _usage_row(usage: Usage, emulated: bool = False) -> LedgerRow:
    usage.held([Held("w0", ("0",), ("H100 80 GiB",))], since=T0 - 1)
    usage.record("0", T0, T0 + 2)
    return usage.row("gpu-train", [Held("w0", ("0",), ("H100 80 GiB",))], emulated, T0 + 3, "flow run ended")


def test_a_sampled_row_carries_the_figures_to_its_span_table_and_advice():
    usage = Usage()
    for s in _samples(proc=(7 * GiB, 9 * GiB, 6 * GiB)):
        usage.sampled(s, 1.0)
    row = _usage_row(usage)
    assert row.measured is not None and row.measured.sm_mean == pytest.approx(23.0)
    assert row.spans[0].measured == row.measured
    assert row.as_dict()["measured"]["peak_used_gib"] == pytest.approx(9.1, abs=0.01)
    [item] = ledger_table([row])
    assert item["measured (NVML)"].startswith("SM 23% mean, peak 9.1 GiB of 80")
    [(name, line, measured)] = right_size([row])
    assert name == "gpu-train" and line.startswith("profile 'gpu-train' held 1 device; peak 9 GiB of 80")
    markdown = timeline_markdown([row]) or ""
    assert "Measured by NVML" in markdown and "| 0 | gpu-train | 23 | 9.1 of 80 |" in markdown, markdown
    assert f"Right-size (measured use much less than held):\n\n- {line}" in markdown
    resource = right_size_resource(name, line, measured or Measured(), _run())
    assert resource["prefect.resource.name"] == line and resource["gpu-tasks.sm-mean-pct"] == "23"


def _run() -> Any:
    from gpu_tasks.reporting.events import RunRef

    return RunRef(uuid.uuid4(), "crimson-otter")


def test_an_emulated_row_says_not_measured_without_a_column_of_it():
    """The row's figures say why nothing was measured; the artifacts say it once, in the summary
    (EMULATED), not in a column that repeats it on every row, and no right-size heading."""
    usage = Usage()
    usage.not_measured(NOT_EMULATED)
    row = _usage_row(usage, emulated=True)
    assert row.measured == Measured(note=NOT_EMULATED)
    assert "measured (NVML)" not in ledger_table([row])[0]
    assert right_size([row]) == [("", EMULATED_ADVICE, None)]
    markdown = timeline_markdown([row]) or ""
    assert "GPU use was not measured" in markdown and "Right-size" not in markdown, markdown


# ---------------------------------------------------------------- the sampler
class _Cluster:
    def __init__(self, emulated: bool = False, is_local: bool = True) -> None:
        self.profile = types.SimpleNamespace(is_gpu=True, is_local=is_local, name="gpu-train")
        self.emulated = emulated
        self.running = True
        self.usage = Usage()
        self.specs = [
            types.SimpleNamespace(devices=(Device(address="0", index=0, name="H100", uuid="GPU-0"),))
        ]


def _fake_nvml(sm: int = 23, used: int = 9 * GiB) -> types.SimpleNamespace:
    me = os.getpid()
    return types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByUUID=lambda u: u,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(
            used=used, total=80 * GiB, free=80 * GiB - used
        ),
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=sm),
        # this test process stands in for a worker process; pid 1 is not ours
        nvmlDeviceGetComputeRunningProcesses=lambda h: [
            types.SimpleNamespace(pid=me, usedGpuMemory=5 * GiB),
            types.SimpleNamespace(pid=1, usedGpuMemory=3 * GiB),
        ],
    )


def test_the_sampler_reads_sm_memory_and_its_own_processes(monkeypatch):
    monkeypatch.setattr(measure, "no_nvml_reason", lambda: None)
    monkeypatch.setattr(measure._gpu, "load", lambda name: _fake_nvml())
    sampler = measure.Sampler(0.02)
    cluster = _Cluster()
    sampler.watch(cluster)
    deadline = time.monotonic() + 5
    while sampler.readings < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    sampler.close()
    [sample, *_] = cluster.usage.samples.by_device["0"]
    assert sample.sm == 23.0 and sample.used == 9 * GiB and sample.total == 80 * GiB
    assert sample.processes == ((os.getpid(), 5 * GiB),)  # pid 1 is another program's
    assert sampler.seconds >= 0 and sampler.readings >= 3


def test_no_sampler_thread_for_emulated_remote_or_switched_off(monkeypatch):
    sampler = measure.Sampler(1.0)
    sampler.watch(_Cluster(emulated=True))
    sampler.watch(_Cluster(is_local=False))
    assert sampler._thread is None
    off = _Cluster()
    measure.Sampler(0.0).watch(off)
    assert off.usage.samples.note == "not measured (GPU_TASKS_TUNE_GPU_SAMPLE_SECONDS=0)"


def test_nvml_absent_says_why(monkeypatch):
    monkeypatch.setattr(_gpu, "why_unavailable", lambda name: "install the GPU extra")
    cluster = _Cluster()
    sampler = measure.Sampler(1.0)
    sampler.watch(cluster)
    assert sampler._thread is None
    row = _usage_row(cluster.usage)
    assert row.measured == Measured(note="not measured (no NVML: install the GPU extra)")
    assert right_size([row]) == []


@pytest.mark.gpu
def test_a_real_device_is_sampled():
    from gpu_tasks.devices.discovery import nvml_devices

    found, note = nvml_devices()
    if not found:
        pytest.skip(f"no NVIDIA device found by NVML: {note}")
    cluster = _Cluster()
    cluster.specs = [types.SimpleNamespace(devices=(found[0],))]
    sampler = measure.Sampler(0.05)
    sampler.watch(cluster)
    time.sleep(0.5)
    sampler.close()
    samples = cluster.usage.samples.by_device[found[0].address]
    assert samples and all(s.total and s.used is not None for s in samples)
    assert sampler.seconds / sampler.readings < 0.05  # a reading costs well under its period


# ---------------------------------------------------------------- end to end, emulated
@task
def _hold(seconds: float) -> int:
    time.sleep(seconds)
    return 1


@pytest.mark.processes
@pytest.mark.usefixtures("no_leaked_processes", "emulated")
def test_a_flow_run_on_emulated_devices_says_not_measured(caplog):
    gpu = ResourceProfile(name="gpu-train", gpus=1, idle_timeout=30)
    box = []

    @flow(task_runner=ProfileTaskRunner(profiles=[gpu]))
    def f() -> uuid.UUID:
        box.append(FlowRunContext.get().task_runner)  # type: ignore[union-attr]
        _hold.with_options(tags=[profile("gpu-train")]).submit(0.3).result()
        return FlowRunContext.get().flow_run.id  # type: ignore[union-attr]

    with caplog.at_level("INFO", logger="gpu_tasks"):
        run_id = f()
    [row] = [r for r in box[0].ledger if r.devices]
    assert row.emulated and row.measured == Measured(note=NOT_EMULATED)
    assert all(s.measured == Measured(note=NOT_EMULATED) for s in row.spans)
    assert EMULATED_ADVICE in caplog.text and "SM " not in caplog.text
    from prefect_api import flow_run_events

    assert flow_run_events(run_id, {"name": ["gpu-tasks.profile.right-size"]}, timeout=1.0) == []
