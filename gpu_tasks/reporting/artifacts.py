"""The flow run's artifacts about its devices: the ``resource-ledger`` table and the ``device-timeline``
markdown. All but :func:`publish_run_artifacts` is pure."""

from __future__ import annotations

import datetime
import json
import logging
import re
import uuid
from collections.abc import Sequence
from typing import Any

from gpu_tasks.reporting.alerts import RunTotals
from gpu_tasks.reporting.events import usage_phrase
from gpu_tasks.reporting.ledger import DeviceSpan, LedgerRow, device_order, percent, right_size, wiring_advice
from gpu_tasks.reporting.measured import Measured, gib

logger = logging.getLogger(__name__)

LEDGER_ARTIFACT_KEY = "resource-ledger"
TIMELINE_ARTIFACT_KEY = "device-timeline"
STRIP_WIDTH = 24  # the UI keeps markdown to a reading width: a longer strip wraps
TABLE_ROW_CHARS = 90  # the most of a timeline table row the UI shows unwrapped (docs/operations.md)
WAITS = "waits_s devices/slots"
SKIPPED = "skipped (programs outside gpu-tasks)"
MEASURED = "measured (NVML)"  # SM % mean, peak memory of total, samples; or why not measured
NOT_MEASURED_CELL = "n/a"
NO_DEVICE = "none (CPU)"  # a "-" alone in a table cell renders as a list bullet
# the strip's characters: busy at least half of the held part of the column, busy less, held idle, not held
BUSY, PARTLY_BUSY, HELD_IDLE, NOT_HELD = "#", "+", "-", "."


def clock(ts: float) -> str:
    """``HH:MM:SS`` (UTC)."""
    return datetime.datetime.fromtimestamp(ts, tz=datetime.UTC).strftime("%H:%M:%S")


def clock_range(start: float, end: float) -> str:
    return f"{clock(start)}–{clock(end)}"


_REASONS = (
    (re.compile(r"^scaled down: idle for ([0-9.]+s).*$"), r"scaled down, idle \1"),
    (re.compile(r"^released its devices early: profile ('[^']*').*waiting for them$"), r"released for \1"),
)
REASON_WIDTH = 48


def short_reason(reason: str) -> str:
    """A close reason short enough for a table column (the Python ledger keeps it whole)."""
    for pattern, replacement in _REASONS:
        reason = pattern.sub(replacement, reason)
    return reason if len(reason) <= REASON_WIDTH else reason[: REASON_WIDTH - 1].rstrip() + "…"


def devices_text(row: LedgerRow, emulated_said: bool = False) -> str:
    """``0,1 (H100 80 GiB)``: a row's devices, grouped by model. ``emulated_said``: the table's
    description says EMULATED, so the cell does not repeat it."""
    if not row.devices:
        return NO_DEVICE
    models = {s.device: s.model.removesuffix(", emulated") if emulated_said else s.model for s in row.spans}
    groups: list[tuple[str, list[str]]] = []
    for device in row.devices:
        model = models.get(device, "")
        if groups and groups[-1][0] == model:
            groups[-1][1].append(device)
        else:
            groups.append((model, [device]))
    return "; ".join(f"{','.join(ds)} ({model})" if model else ",".join(ds) for model, ds in groups)


def summary(rows: Sequence[LedgerRow]) -> str:
    """``held 12.3 device-s, busy 4.5 (37%)``, ``, EMULATED`` when emulated."""
    totals = RunTotals.of(rows)
    if totals.held_seconds <= 0:
        return "no device held (CPU only)"
    emulated = ", EMULATED" if totals.emulated else ""
    return usage_phrase(totals.held_seconds, totals.busy_seconds, None) + emulated


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def ledger_description(rows: Sequence[LedgerRow]) -> str:
    """The table's description, short enough for the UI's artifact card: the totals first."""
    text = summary(rows)
    return text[0].upper() + text[1:] + "."


def ledger_table(rows: Sequence[LedgerRow]) -> list[dict[str, Any]]:
    """The ``resource-ledger`` table, oldest first; optional columns only where some row has them."""
    waited = any(r.wait_devices_seconds + r.wait_slots_seconds >= 0.05 for r in rows)
    measured_column = any(r.measured is not None and not r.emulated for r in rows)
    emulated_said = "EMULATED" in ledger_description(rows)
    table = []
    for row in sorted(rows, key=lambda r: (r.provisioned_at, r.closed_at)):
        item: dict[str, Any] = {
            "held (UTC)": clock_range(row.provisioned_at, row.closed_at),
            "profile": row.profile,
            "devices": devices_text(row, emulated_said),
            "held_s": round(row.held_seconds, 1),
            "busy_s": round(row.busy_seconds, 1),
            "busy %": percent(row.busy_seconds, row.held_seconds),
            "tasks": row.tasks,
            "reason": short_reason(row.reason),
        }
        if waited:
            item[WAITS] = f"{row.wait_devices_seconds:.1f} / {row.wait_slots_seconds:.1f}"
        if any(r.skipped for r in rows):
            item[SKIPPED] = "; ".join(row.skipped) or "-"
        if measured_column:
            item[MEASURED] = row.measured.text() if row.measured is not None else NO_DEVICE
        table.append(item)
    return table


def strip(
    start: float,
    end: float,
    busy: Sequence[tuple[float, float]],
    window: tuple[float, float],
    width: int = STRIP_WIDTH,
) -> str:
    """``width`` characters across ``window``: where the device was busy, held idle, or not held."""
    t0, t1 = window
    if t1 <= t0:
        return (BUSY if busy else HELD_IDLE) * width
    step = (t1 - t0) / width
    out = []
    for i in range(width):
        a, b = t0 + i * step, t0 + (i + 1) * step
        held = _overlap(start, end, a, b)
        worked = sum(_overlap(s, e, a, b) for s, e in busy)
        if held <= 0:
            out.append(NOT_HELD)
        else:
            out.append(BUSY if worked >= held / 2 else PARTLY_BUSY if worked > 0 else HELD_IDLE)
    return "".join(out)


def _overlap(s1: float, e1: float, s2: float, e2: float) -> float:
    return max(0.0, min(e1, e2) - max(s1, s2))


def device_models(spans: Sequence[DeviceSpan]) -> str:
    """``0, 1: H100 80 GiB, emulated``: devices of one model together."""
    by_model: dict[str, list[str]] = {}
    for span in spans:
        ids = by_model.setdefault(span.model or "model unknown", [])
        if span.device not in ids:
            ids.append(span.device)
    return "; ".join(f"{', '.join(ids)}: {model}" for model, ids in by_model.items())


def timeline_description(rows: Sequence[LedgerRow]) -> str:
    devices = {span.device for row in rows for span in row.spans}
    return f"{len(devices)} device{'s' if len(devices) != 1 else ''} {summary(rows)}."


def _measured_cells(m: Measured | None) -> tuple[str, str, str, str]:
    """SM % mean, peak GiB of the device's total, the worker process's peak GiB, samples."""
    if m is None or not m.measured:
        return (NOT_MEASURED_CELL,) * 4
    sm = f"{m.sm_mean:.0f}" if m.sm_mean is not None else NOT_MEASURED_CELL
    peak = f"{gib(m.peak_used)} of {gib(m.total)}" if m.peak_used is not None else NOT_MEASURED_CELL
    worker = gib(m.process_peak) if m.process_peak is not None else NOT_MEASURED_CELL
    return sm, peak, worker, str(m.samples)


def measured_lines(spans: Sequence[DeviceSpan]) -> list[str]:
    """What NVML measured of each holding, a table of its own so that the holding rows stay narrow."""
    with_figures = [s.measured for s in spans if s.measured is not None and s.measured.measured]
    if not with_figures:
        notes = sorted({span.measured.text() for span in spans if span.measured is not None})
        return ["", f"GPU use: {_cell('; '.join(notes))}."] if notes else []
    every = f", a sample every {with_figures[0].period:g} s" if with_figures[0].period else ""
    lines = [
        "",
        f"Measured by NVML while held{every}: SM % mean, peak memory used (GiB of the device's), "
        "the worker process's peak (GiB).",
        "",
        "| device | profile | SM % | peak GiB | worker GiB | samples |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    unmeasured = []
    for span in spans:
        sm, peak, worker, samples = _measured_cells(span.measured)
        lines.append(
            f"| {_cell(span.device)} | {_cell(span.profile)} | {sm} | {peak} | {worker} | {samples} |"
        )
        if span.measured is not None and not span.measured.measured:
            unmeasured.append(f"device {span.device} ({span.profile}): {span.measured.text()}")
    if unmeasured:
        lines += ["", _cell("Not measured: " + "; ".join(unmeasured) + ".")]
    return lines


def timeline_markdown(rows: Sequence[LedgerRow], width: int = STRIP_WIDTH) -> str | None:
    """The ``device-timeline`` markdown, a row per device holding; ``None`` if no device was held."""
    spans = sorted(
        (s for row in rows for s in row.spans), key=lambda s: (device_order(s.device), s.start, s.end)
    )
    if not spans:
        return None
    t0 = min([r.provisioned_at for r in rows] + [s.start for s in spans])
    t1 = max([r.closed_at for r in rows] + [s.end for s in spans])
    emulated = any(r.emulated for r in rows if r.devices)
    lines = [
        f"**{timeline_description(rows)}**"
        + (
            " Devices were emulated: the scheduling is real, the compute ran on the CPU, and GPU use "
            "was not measured."
            if emulated
            else ""
        ),
        "",
        f"Times of day in UTC. Each strip spans the run's {t1 - t0:.1f} s from {clock(t0)} to {clock(t1)}, "
        f"{(t1 - t0) / width:.2g} s a character: `{BUSY}` busy, `{PARTLY_BUSY}` partly busy, "
        f"`{HELD_IDLE}` held idle, `{NOT_HELD}` not held.",
        "",
        "Devices: " + device_models(spans) + ".",
        "",
        "| device | profile | held (UTC) | held s | busy % | tasks | across the run |",
        "| --- | --- | --- | ---: | ---: | ---: | --- |",
    ]
    for span in spans:
        lines.append(
            f"| {_cell(span.device)} | {_cell(span.profile)} | {clock_range(span.start, span.end)} "
            f"| {span.held_seconds:.1f} | {percent(span.busy_seconds, span.held_seconds)} | {span.tasks} "
            f"| `{strip(span.start, span.end, span.busy, (t0, t1), width)}` |"
        )
    gangs = [r for r in rows if r.gang and r.worst_link]
    if gangs:  # each gang's devices and its worst link (a line each, not a column: rows stay narrow)
        lines += ["", "Gangs (devices, the worst link between two of them):", ""]
        lines += [
            _cell(f"- profile {r.profile}: {','.join(r.gang)}, worst {r.worst_link}")
            + (_cell(f"; better wired: {r.better_set}") if r.better_set else "")
            for r in gangs
        ]
        wiring = wiring_advice(rows)
        if wiring:
            lines += ["", "Wiring:", ""] + [f"- {_cell(line)}" for _, line in wiring]
    if not emulated:
        lines += measured_lines(spans)
        advice = [line for _, line, measured in right_size(rows) if measured is not None]  # wiring: above
        if advice:
            lines += ["", "Right-size (measured use much less than held):", ""]
            lines += [f"- {_cell(line)}" for line in advice]
    skipped = [(row.profile, reason) for row in rows for reason in row.skipped]
    if skipped:
        lines += ["", "Devices skipped because programs outside gpu-tasks used them:", ""]
        lines += [f"- profile {_cell(p)}: {_cell(reason)}" for p, reason in skipped]
    return "\n".join(lines) + "\n"


def publish_run_artifacts(rows: Sequence[LedgerRow], flow_run_id: uuid.UUID | None) -> None:
    """Attach the run's artifacts to the flow run (best effort: never fails the run)."""
    if not rows or flow_run_id is None:
        return
    try:
        from prefect.client.schemas.actions import ArtifactCreate

        from gpu_tasks.prefect_api.api import sync_client

        timeline = timeline_markdown(rows)
        ledger = json.dumps(ledger_table(rows), default=str)
        made = [(LEDGER_ARTIFACT_KEY, "table", ledger, ledger_description(rows))]
        if timeline is not None:
            made.append((TIMELINE_ARTIFACT_KEY, "markdown", timeline, timeline_description(rows)))
        artifacts = [
            ArtifactCreate(key=key, type=kind, data=data, description=text, flow_run_id=flow_run_id)
            for key, kind, data, text in made
        ]
        with sync_client() as client:
            for artifact in artifacts:
                client.create_artifact(artifact)
    except Exception:  # the artifacts must never fail a flow run that succeeded
        logger.warning("could not publish the resource ledger and device timeline artifacts", exc_info=True)
