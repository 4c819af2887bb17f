"""The ledger's device spans and the two artifacts made from them, with fixed numbers (no server)."""

from __future__ import annotations

import datetime

import pytest

from gpu_tasks.cluster.address import AddressCluster
from gpu_tasks.cluster.remote_workers import RemoteWorker
from gpu_tasks.devices.discovery import model_text, parse_emulated
from gpu_tasks.profiles import ResourceProfile
from gpu_tasks.reporting.artifacts import (
    MEASURED,
    NO_DEVICE,
    TABLE_ROW_CHARS,
    WAITS,
    devices_text,
    ledger_description,
    ledger_table,
    short_reason,
    strip,
    timeline_description,
    timeline_markdown,
)
from gpu_tasks.reporting.ledger import (
    DeviceSpan,
    Held,
    LedgerRow,
    Usage,
    device_spans,
    merge_intervals,
    union_seconds,
)

# 2026-11-24 18:00:00 UTC: times of day in the artifacts are read against it
T0 = datetime.datetime(2026, 11, 24, 18, 0, 0, tzinfo=datetime.UTC).timestamp()
H100 = "H100 80 GiB, emulated"


# ---------------------------------------------------------------- the strip
def test_strip_shows_not_held_busy_and_held_idle_in_place():
    # a 40 s window, one character a second: held 10..30, busy 10..20
    assert strip(10, 30, [(10, 20)], (0, 40), width=40) == "." * 10 + "#" * 10 + "-" * 10 + "." * 10


def test_strip_marks_a_little_busy_time_as_partly_busy():
    # 4 characters of 10 s each; busy 2 s of the second one, 6 s of the third
    assert strip(10, 40, [(12, 14), (20, 26)], (0, 40), width=4) == ".+#-"


def test_strip_counts_busy_against_the_held_part_of_a_character():
    # the last character is held 5 s of its 10 and busy 4 of them: busy, not partly busy
    assert strip(0, 35, [(31, 35)], (0, 40), width=4) == "---#"


def test_strip_of_an_empty_window_is_whole():
    assert strip(5, 5, [(5, 5)], (5, 5), width=3) == "###"
    assert strip(5, 5, [], (5, 5), width=3) == "---"


# ---------------------------------------------------------------- spans in the ledger
def test_merge_intervals_and_union_seconds_agree():
    intervals = [(7.0, 8.0), (1.0, 3.0), (2.0, 5.0), (5.0, 6.0), (20.0, 30.0)]
    assert merge_intervals(intervals) == [(1.0, 6.0), (7.0, 8.0), (20.0, 30.0)]
    assert union_seconds(intervals) == pytest.approx(16.0)
    assert union_seconds([]) == 0


def test_device_spans_clip_busy_time_to_the_holding():
    [span] = device_spans("etl", [("0", H100)], 0.0, 25.0, [(1, 3), (2, 5), (7, 8), (20, 30), (40, 41)])
    assert span.busy == ((1, 5), (7, 8), (20, 25))
    assert span.tasks == 5 and span.held_seconds == 25 and span.busy_seconds == pytest.approx(10)
    assert span.label == "0 (H100 80 GiB, emulated)"


def test_usage_row_has_one_span_per_device_and_none_for_cpu_workers():
    usage = Usage()
    workers = [Held("w0", ("0", "1"), (H100, H100))]
    usage.held(workers, since=T0)
    usage.record("0,1", T0 + 1, T0 + 3)
    row = usage.row("train", workers, True, T0 + 10, "flow run ended")
    assert [(s.device, s.model, s.profile) for s in row.spans] == [("0", H100, "train"), ("1", H100, "train")]
    assert all(s.start == T0 and s.end == T0 + 10 and s.busy == ((T0 + 1, T0 + 3),) for s in row.spans)
    assert row.as_dict()["spans"][0]["busy_s"] == 2
    cpu = Usage()
    cpu.held([Held("c", ())], since=T0)
    cpu.record("cpu", T0, T0 + 1)
    assert cpu.row("cpu", [Held("c", ())], False, T0 + 2, "flow run ended").spans == ()


def test_usage_row_counts_a_task_still_running_at_the_close_as_busy_and_interrupted():
    usage = Usage()
    workers = [Held("w0", ("0",), (H100,))]
    usage.held(workers, since=T0)
    usage.record("0", T0 + 1, T0 + 2)
    usage.record("0", T0 + 3, T0 + 10, interrupted=True)  # the runner closed at T0 + 10
    row = usage.row("train", workers, True, T0 + 10, "flow run ended with TerminationSignal")
    assert (row.tasks, row.interrupted, row.busy_seconds) == (2, 1, pytest.approx(8.0))
    assert row.as_dict()["interrupted"] == 1
    usage.reset()
    usage.held(workers, since=T0)
    assert usage.row("train", workers, True, T0 + 1, "flow run ended").interrupted == 0


def test_a_remote_row_spans_its_tasks_with_the_workers_device_models():
    cluster = AddressCluster(ResourceProfile(name="shared", gpus=1, address="tcp://h:8786"), {}, 10.0)
    cluster.remote = {
        "tcp://h:1": RemoteWorker("tcp://h:1", "w", "h", 1.0, ("0",), ("L4 (emulated)",), (24 * 2**30,), True)
    }
    cluster.record("h:0", T0 + 2, T0 + 4)
    cluster.record("h:0", T0 + 6, T0 + 7)
    row = cluster._busy_row(None, 1, "flow run ended", T0 + 20)
    [span] = row.spans
    assert (span.device, span.model, span.start, span.end, span.tasks) == (
        "h:0",
        "L4 24 GiB, emulated",
        T0 + 2,
        T0 + 7,
        2,
    )


# ---------------------------------------------------------------- device names
def test_model_text_names_the_model_memory_and_emulation():
    assert model_text("NVIDIA H100 80GB HBM3", 85520809984, False) == "NVIDIA H100 80GB HBM3 79.6 GiB"
    assert model_text("EMU (emulated)", 16 * 2**30, True) == "EMU 16 GiB, emulated"
    assert model_text("GPU (from discovery command)", None, False) == "GPU (from discovery command)"
    assert [d.model() for d in parse_emulated("H100:80GiB,L4:24GiB")] == [H100, "L4 24 GiB, emulated"]


# ---------------------------------------------------------------- the two artifacts
def _row(profile: str, start: float, end: float, spans: tuple[DeviceSpan, ...], **kw) -> LedgerRow:
    held = sum(s.held_seconds for s in spans) if spans else end - start
    busy = sum(s.busy_seconds for s in spans) if spans else 0.0
    defaults = dict(
        profile=profile,
        workers=1,
        devices=tuple(s.device for s in spans),
        emulated=bool(spans),
        provisioned_at=start,
        closed_at=end,
        held_seconds=held,
        busy_seconds=busy,
        tasks=sum(s.tasks for s in spans),
        reason="flow run ended",
        spans=spans,
    )
    return LedgerRow(**(defaults | kw))


def _run() -> list[LedgerRow]:
    """etl on device 0 (10..20 s), then train on devices 0 and 1 (21..41 s), a CPU cluster all along;
    listed out of time order (rows are written as clusters close or workers die)."""
    etl = device_spans("etl", [("0", H100)], T0 + 10, T0 + 20, [(T0 + 11, T0 + 15)])
    train = device_spans("train", [("0", H100), ("1", H100)], T0 + 21, T0 + 41, [(T0 + 25, T0 + 40)])
    return [
        _row("train", T0 + 21, T0 + 41, train),
        _row("cpu", T0, T0 + 42, (), tasks=3),
        _row(
            "etl",
            T0 + 10,
            T0 + 20,
            etl,
            reason="released its devices early: profile 'train' is waiting for them",
        ),
    ]


def test_ledger_table_is_in_time_order_with_device_names_and_no_bullets():
    table = ledger_table(_run())
    assert [r["profile"] for r in table] == ["cpu", "etl", "train"]
    assert [r["held (UTC)"] for r in table] == ["18:00:00–18:00:42", "18:00:10–18:00:20", "18:00:21–18:00:41"]
    assert [r["devices"] for r in table] == [
        NO_DEVICE,
        "0 (H100 80 GiB)",  # the description says EMULATED; the narrow cell does not repeat it
        "0,1 (H100 80 GiB)",
    ]
    assert all(str(v).strip() != "-" for r in table for v in r.values())
    assert table[1]["reason"] == "released for 'train'"
    assert (table[1]["held_s"], table[1]["busy_s"], table[1]["busy %"], table[1]["tasks"]) == (
        10.0,
        4.0,
        40,
        1,
    )
    assert (table[2]["held_s"], table[2]["busy_s"], table[2]["busy %"]) == (40.0, 30.0, 75)
    assert WAITS not in table[0] and "emulated" not in table[0] and "provisioned_at" not in table[0]


def test_ledger_table_shows_waits_only_when_some_row_waited():
    rows = _run()
    rows[0].wait_devices_seconds = 1.25  # train
    table = ledger_table(rows)
    assert [r[WAITS] for r in table] == ["0.0 / 0.0"] * 2 + ["1.2 / 0.0"]


def test_reasons_are_short():
    assert short_reason("scaled down: idle for 2.0s (idle_timeout=2s), nothing running or queued") == (
        "scaled down, idle 2.0s"
    )
    assert short_reason("flow run ended with KeyboardInterrupt") == "flow run ended with KeyboardInterrupt"
    long = short_reason("worker crashed: " + "x" * 100)
    assert len(long) == 48 and long.endswith("…")


def test_descriptions_are_short_complete_sentences_with_the_totals_first():
    rows = _run()
    assert ledger_description(rows) == "Held 50.0 device-s, busy 34.0 (68%), EMULATED."
    assert timeline_description(rows) == "2 devices held 50.0 device-s, busy 34.0 (68%), EMULATED."
    cpu_only = [_row("cpu", T0, T0 + 5, ())]
    assert ledger_description(cpu_only) == "No device held (CPU only)."
    for text in (ledger_description(rows), timeline_description(rows)):
        assert len(text) <= 60 and "..." not in text and "…" not in text


def test_devices_of_different_models_are_named_each():
    spans = device_spans("mix", [("0", H100), ("1", "L4 24 GiB, emulated")], T0, T0 + 1, [])
    assert (
        devices_text(_row("mix", T0, T0 + 1, spans)) == "0 (H100 80 GiB, emulated); 1 (L4 24 GiB, emulated)"
    )


def _table_rows(markdown: str) -> list[list[str]]:
    lines = [line for line in markdown.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[2:]]  # after the header


def test_the_timeline_has_a_row_per_device_holding_in_time_order_with_its_strip():
    markdown = timeline_markdown(_run(), width=42)  # one character a second over the run's 42 s
    assert markdown is not None
    first = markdown.splitlines()[0]
    assert first == "**2 devices held 50.0 device-s, busy 34.0 (68%), EMULATED.** " + (
        "Devices were emulated: the scheduling is real, the compute ran on the CPU, and GPU use was not "
        "measured."
    )
    assert "Times of day in UTC" in markdown and "from 18:00:00 to 18:00:42" in markdown
    rows = _table_rows(markdown)
    assert [r[:3] for r in rows] == [
        ["0", "etl", "18:00:10–18:00:20"],
        ["0", "train", "18:00:21–18:00:41"],
        ["1", "train", "18:00:21–18:00:41"],
    ]
    assert "\nDevices: 0, 1: H100 80 GiB, emulated.\n" in markdown
    assert [r[3:6] for r in rows] == [["10.0", "40", "1"], ["20.0", "75", "1"], ["20.0", "75", "1"]]
    assert rows[0][6] == "`" + "." * 10 + "-" + "#" * 4 + "-" * 5 + "." * 22 + "`"
    assert rows[1][6] == "`" + "." * 21 + "-" * 4 + "#" * 15 + "-" + "." + "`"
    assert rows[2][6] == rows[1][6]


def test_no_timeline_when_no_device_was_held():
    assert timeline_markdown([_row("cpu", T0, T0 + 5, ())]) is None


def test_a_pipe_in_a_device_name_does_not_break_the_table():
    spans = device_spans("p", [("0", "A|B 1 GiB")], T0, T0 + 1, [])
    markdown = timeline_markdown([_row("p", T0, T0 + 1, spans)])
    assert markdown is not None and "\nDevices: 0: A|B 1 GiB.\n\n" in markdown  # a paragraph, not the table
    [row] = _table_rows(markdown)
    assert row[:2] == ["0", "p"] and len(row) == 7


# ---------------------------------------------------------------- the timeline fits the page
def _measured_run(emulated: bool) -> list[LedgerRow]:
    """The run of :func:`_run` with what the sampler records: on emulated devices why nothing was
    measured; on real ones NVML's figures (an 80 GiB device, 12 samples a second apart)."""
    from gpu_tasks.reporting.measured import NOT_EMULATED, Measured

    figures = Measured(
        samples=12,
        period=1.0,
        sm_mean=23.4,
        peak_used=int(9.1 * 2**30),
        total=80 * 2**30,
        process_peak=int(8.9 * 2**30),
        task_peak=int(8.9 * 2**30),
    )
    m = Measured(note=NOT_EMULATED) if emulated else figures
    model = H100 if emulated else "NVIDIA H100 80GB HBM3 79.6 GiB"
    out = []
    for row in _run():
        spans = tuple(
            DeviceSpan(s.device, model, s.profile, s.start, s.end, s.busy, s.tasks, m) for s in row.spans
        )
        out.append(
            LedgerRow(
                **(
                    row.__dict__
                    | {"spans": spans, "emulated": emulated and bool(spans), "measured": m if spans else None}
                )
            )
        )
    return out


def _table_lines(markdown: str) -> list[str]:
    return [line for line in markdown.splitlines() if line.startswith("|")]


@pytest.mark.parametrize("emulated", [True, False])
def test_every_timeline_table_row_fits_the_page(emulated: bool):
    """A 1600 px page holds about TABLE_ROW_CHARS of a markdown table row without wrapping."""
    markdown = timeline_markdown(_measured_run(emulated)) or ""
    widest = max(_table_lines(markdown), key=len)
    assert len(widest) <= TABLE_ROW_CHARS, (len(widest), widest)


def test_an_emulated_timeline_says_once_that_nothing_was_measured():
    rows = _measured_run(emulated=True)
    markdown = timeline_markdown(rows) or ""
    assert markdown.count("not measured") == 1 and "GPU use was not measured." in markdown.splitlines()[0]
    assert "Right-size" not in markdown and "NVML" not in markdown, markdown
    assert {len(r) for r in _table_rows(markdown)} == {7}, "no measured column"
    assert all(MEASURED not in item for item in ledger_table(rows)), "nor in the ledger table"


def test_a_real_timeline_keeps_the_figures_in_a_narrow_table_of_their_own():
    rows = _measured_run(emulated=False)
    markdown = timeline_markdown(rows) or ""
    assert "Measured by NVML while held, a sample every 1 s" in markdown, markdown
    figures = [line for line in _table_lines(markdown) if line.startswith("| 0 | etl | 23 ")]
    assert figures == ["| 0 | etl | 23 | 9.1 of 80 | 8.9 | 12 |"], markdown
    assert ledger_table(rows)[1][MEASURED].startswith("SM 23% mean, peak 9.1 GiB of 80")  # etl
