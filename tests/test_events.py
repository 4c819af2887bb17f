"""Events that read as sentences in the Prefect UI, their labels, and the shipped automation.

The first tests are pure (no server); the last run flows on emulated devices against the
session's real Prefect server and read the events, and the automation's own events, back.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml
from prefect import flow, task
from prefect.context import FlowRunContext
from prefect_api import api, flow_run_events, stored_events

from gpu_tasks import ProfileTaskRunner, ResourceProfile, profile
from gpu_tasks.errors import SettingsError
from gpu_tasks.reporting.alerts import AlertThresholds, RunTotals, alert_label, run_alerts
from gpu_tasks.reporting.events import (
    RunRef,
    cluster_resource,
    device_resource,
    feed_url,
    payload_labels,
    summary_payload,
    summary_resource,
    task_resource,
)
from gpu_tasks.reporting.ledger import LedgerRow
from gpu_tasks.settings import get_settings

AUTOMATION_FILE = Path(__file__).resolve().parents[1] / "infra" / "automations" / "gpu-waste.yaml"
RUN = RunRef(uuid.UUID("811667ab-0000-4000-8000-000000000001"), "crimson-otter")


def row(profile: str, devices: tuple[str, ...], held: float, busy: float, wait: float = 0.0) -> LedgerRow:
    return LedgerRow(
        profile=profile,
        workers=1,
        devices=devices,
        emulated=bool(devices),
        provisioned_at=0.0,
        closed_at=held,
        held_seconds=held,
        busy_seconds=busy,
        tasks=2,
        reason="flow run ended",
        wait_devices_seconds=wait,
    )


# ---------------------------------------------------------------- pure: what the UI shows
def test_a_closed_cluster_reads_as_a_sentence_with_string_labels():
    payload = {"reason": "scaled down: idle for 5.0s", "devices": ["0", "1"], "held_s": 12.3, "busy_s": 1.23}
    payload["tasks"] = 4
    resource = cluster_resource("closed", RUN, "gpu-etl", "local", ("0", "1"), True, True, payload)
    assert resource["prefect.resource.name"] == (
        "gpu-etl on GPU 0,1 (emulated): held 12.3 device-s, busy 1.2 (10%), 4 tasks; "
        "scaled down: idle for 5.0s"
    )
    assert resource["prefect.resource.id"] == f"gpu-tasks.cluster.{RUN.id}.gpu-etl"
    assert resource["gpu-tasks.devices"] == "0,1" and resource["gpu-tasks.reason"] == payload["reason"]
    assert resource["gpu-tasks.held-seconds"] == "12.3" and resource["gpu-tasks.busy-seconds"] == "1.23"
    assert resource["gpu-tasks.utilization"] == "0.1" and resource["gpu-tasks.tasks"] == "4"
    assert all(isinstance(v, str) for v in resource.values()), resource


def test_provisioned_scaled_and_cpu_clusters_read_as_sentences():
    started = {"workers": 2, "prepare_s": 0.1, "wait_devices_s": 3.25, "start_workers_s": 1.44}
    name = cluster_resource("provisioned", RUN, "train", "local", ("0", "1"), False, True, started)
    assert (
        name["prefect.resource.name"]
        == "train on GPU 0,1: 2 workers up in 1.4 s, after waiting 3.2 s for devices"
    )
    assert name["gpu-tasks.device-wait-seconds"] == "3.25" and name["gpu-tasks.workers"] == "2"
    scaled = cluster_resource(
        "scaled", RUN, "etl", "local", ("1",), True, True, {"workers": 2, "added": ["1"]}
    )
    assert scaled["prefect.resource.name"] == "etl on GPU 1 (emulated): added, 2 workers now"
    closed = {"reason": "flow run ended", "held_s": 3.0, "busy_s": 1.5, "tasks": 1}
    cpu = cluster_resource("closed", RunRef(), "cpu", "local", (), False, False, closed)
    assert cpu["prefect.resource.name"] == "cpu on CPU: held 3.0 s, busy 1.5 (50%), 1 task; flow run ended"
    assert cpu["prefect.resource.id"] == "gpu-tasks.cluster.local.cpu" and cpu["gpu-tasks.devices"] == "-"


def test_device_and_task_events_read_as_sentences():
    leased = device_resource("leased", "0", "gpu-etl", True, host="node-1")
    assert leased["prefect.resource.id"] == "gpu-tasks.device.node-1.0"
    assert leased["prefect.resource.name"] == "GPU 0 (emulated) to profile gpu-etl"
    released = device_resource("released", "node-2:1", "gpu-etl", False, "flow run ended", host="node-1")
    assert released["prefect.resource.id"] == "gpu-tasks.device.node-2.1"
    assert released["prefect.resource.name"] == "GPU node-2:1 from profile gpu-etl: flow run ended"
    assert released["gpu-tasks.reason"] == "flow run ended" and released["gpu-tasks.host"] == "node-2"
    waited = task_resource("slot-waited", RUN.id, "train", "gpu", {"seconds": 3.04, "limits": ["tag:serial"]})
    assert (
        waited["prefect.resource.name"]
        == "train on profile gpu waited 3.0 s for tag:serial, holding no device"
    )
    assert waited["gpu-tasks.wait-seconds"] == "3.04" and waited["gpu-tasks.limits"] == "tag:serial"
    escalated = task_resource(
        "escalated",
        RUN.id,
        "fit",
        "small",
        {"from_profile": "small", "to_profile": "big", "reason": "killed"},
    )
    assert escalated["prefect.resource.name"] == "fit moved from profile small to big: killed"
    assert escalated["gpu-tasks.to-profile"] == "big"


def test_the_flow_run_is_related_by_its_name():
    assert RUN.related() == [
        {
            "prefect.resource.id": f"prefect.flow-run.{RUN.id}",
            "prefect.resource.role": "flow-run",
            "prefect.resource.name": "crimson-otter",
        }
    ]
    assert RunRef().related() == []


def test_payload_labels_are_strings_for_every_payload_shape():
    labels = payload_labels(
        {"out_of_memory": True, "exitcode": -9, "pid": None, "held_s": 0.0, "busy_s": 0.0, "added": []}
    )
    assert labels == {
        "gpu-tasks.out-of-memory": "true",
        "gpu-tasks.exitcode": "-9",
        "gpu-tasks.held-seconds": "0",
        "gpu-tasks.busy-seconds": "0",
        "gpu-tasks.added-devices": "-",
        "gpu-tasks.utilization": "0",
    }


# ---------------------------------------------------------------- pure: the run summary and its alerts
def test_run_totals_count_device_rows_and_the_longest_device_wait():
    rows = [
        row("cpu", (), 50.0, 1.0),
        row("etl", ("1", "0"), 40.0, 10.0, wait=2.0),
        row("fit", ("0",), 20.0, 5.0, 7.5),
    ]
    totals = RunTotals.of(rows)
    assert (totals.held_seconds, totals.busy_seconds, totals.longest_device_wait) == (60.0, 15.0, 7.5)
    assert totals.devices == ("0", "1") and totals.profiles == ("etl", "fit") and totals.emulated
    assert totals.held_per_busy == 4.0 and totals.utilization == 0.25 and totals.tasks == 4
    assert RunTotals.of([row("gpu", ("0",), 5.0, 0.0)]).held_per_busy == math.inf
    assert RunTotals.of([]).held_per_busy == 0.0


@pytest.mark.parametrize(
    ("held", "busy", "wait", "thresholds", "expected"),
    [
        (100.0, 10.0, 0.0, AlertThresholds(), ("held-busy-over-2",)),
        (100.0, 60.0, 0.0, AlertThresholds(), ()),
        (30.0, 1.0, 0.0, AlertThresholds(), ()),  # under GPU_TASKS_TUNE_ALERT_MIN_HELD_SECONDS
        (30.0, 1.0, 0.0, AlertThresholds(min_held_seconds=0), ("held-busy-over-2",)),
        (100.0, 0.0, 0.0, AlertThresholds(held_busy=2.5), ("held-busy-over-2.5",)),
        (100.0, 90.0, 61.0, AlertThresholds(), ("device-wait-over-60",)),
        (100.0, 10.0, 90.0, AlertThresholds(), ("held-busy-over-2", "device-wait-over-60")),
        (100.0, 10.0, 90.0, AlertThresholds(held_busy=0, device_wait_seconds=0), ()),
    ],
)
def test_run_alerts(held, busy, wait, thresholds, expected):
    totals = RunTotals.of([row("gpu", ("0",), held, busy, wait)])
    assert run_alerts(totals, thresholds) == expected
    assert alert_label(expected) == (",".join(expected) or "none")


def test_alert_thresholds_come_from_settings(monkeypatch):
    monkeypatch.setenv("GPU_TASKS_TUNE_ALERT_HELD_BUSY", "3")
    monkeypatch.setenv("GPU_TASKS_TUNE_ALERT_DEVICE_WAIT_SECONDS", "0")
    monkeypatch.setenv("GPU_TASKS_TUNE_ALERT_MIN_HELD_SECONDS", "5")
    assert AlertThresholds.from_settings(get_settings()) == AlertThresholds(3.0, 0.0, 5.0)
    monkeypatch.setenv("GPU_TASKS_TUNE_ALERT_HELD_BUSY", "-1")
    with pytest.raises(SettingsError, match="GPU_TASKS_TUNE_ALERT_HELD_BUSY='-1'"):
        get_settings()


def test_the_summary_reads_as_a_sentence():
    totals = RunTotals.of([row("gpu-etl", ("0",), 95.2, 3.1)])
    resource = summary_resource(RUN, totals, AlertThresholds())
    assert resource["prefect.resource.name"] == (
        "flow run crimson-otter: gpu-etl on GPU 0 (emulated) held 95.2 device-s, busy 3.1 (3%), 2 tasks; "
        "longest device wait 0.0 s; alert: held-busy-over-2"
    )
    assert resource["prefect.resource.id"] == f"gpu-tasks.flow-run.{RUN.id}"
    assert resource["gpu-tasks.alert"] == "held-busy-over-2" and resource["gpu-tasks.held-busy"] == "30.71"


def test_the_summary_carries_the_priorities_its_profiles_queued_at():
    totals = RunTotals.of(
        [row("etl", ("0",), 10.0, 5.0), row("fit", ("1",), 10.0, 5.0), row("cpu", (), 1.0, 1.0)]
    )
    ran_at = {"etl": 0, "fit": 5, "never-held": 9}
    resource = summary_resource(RUN, totals, AlertThresholds(), ran_at)
    assert resource["gpu-tasks.priority"] == "5" and resource["gpu-tasks.priorities"] == "etl=0,fit=5"
    assert (
        resource["prefect.resource.name"]
        == summary_resource(RUN, totals, AlertThresholds())["prefect.resource.name"]
    ), "the sentence is unchanged"
    payload = summary_payload(totals, AlertThresholds(), ran_at)
    assert payload["priority"] == 5 and payload["priorities"] == {"etl": 0, "fit": 5}
    assert "gpu-tasks.priority" not in summary_resource(RUN, totals, AlertThresholds())
    assert summary_payload(totals, AlertThresholds())["priority"] is None


# ---------------------------------------------------------------- pure: the automation and the feed URL
def _trigger_matches(resource: dict[str, str]) -> bool:
    """Whether the shipped automation's trigger matches an event about ``resource``, by the
    server's own matching (globs, ``!`` negation)."""
    from prefect.server.events.schemas.events import ResourceSpecification

    trigger = yaml.safe_load(AUTOMATION_FILE.read_text())["trigger"]
    return ResourceSpecification(trigger["match"]).matches(resource)


def test_the_automation_file_is_valid_and_matches_only_alerts():
    from prefect.events.schemas.automations import AutomationCore

    automation = AutomationCore.model_validate(yaml.safe_load(AUTOMATION_FILE.read_text()))
    assert automation.trigger.expect == {"gpu-tasks.flow-run.summary"}
    totals = [
        RunTotals.of([row("gpu", ("0",), 100.0, 10.0)]),  # held/busy 10
        RunTotals.of([row("gpu", ("0",), 100.0, 90.0, 75.0)]),  # waited 75 s for devices
        RunTotals.of([row("gpu", ("0",), 100.0, 10.0, 75.0)]),  # both
    ]
    for t in totals:
        assert _trigger_matches(summary_resource(RUN, t, AlertThresholds())), t
    quiet = RunTotals.of([row("gpu", ("0",), 100.0, 90.0, 1.0)])
    assert not _trigger_matches(summary_resource(RUN, quiet, AlertThresholds()))


def test_feed_urls_use_each_uis_search_parameter_format():
    run_id = "811667ab-0000-4000-8000-000000000001"
    v2 = urlsplit(feed_url("http://127.0.0.1:4200/", run_id))
    assert v2.path == "/v2/events"
    query = parse_qs(v2.query)  # the React UI (TanStack Router) JSON-parses each value
    assert json.loads(query["events"][0]) == ["gpu-tasks.*"]
    assert json.loads(query["resource"][0]) == [f"prefect.flow-run.{run_id}"]
    assert (
        feed_url("http://127.0.0.1:4200") == "http://127.0.0.1:4200/v2/events?events=%5B%22gpu-tasks.*%22%5D"
    )
    assert feed_url("http://127.0.0.1:4200", v1=True) == "http://127.0.0.1:4200/events?events=gpu-tasks.*"


# ---------------------------------------------------------------- against the real server
@task
def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


CPU = ResourceProfile(name="cpu", cpus=0.5)


def _drain() -> None:
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all(timeout=10)


@pytest.mark.usefixtures("no_leaked_processes", "emulated")
def test_cluster_events_carry_a_readable_name_and_labels():
    gpu = ResourceProfile(name="gpu-etl", gpus=1, idle_timeout=30)

    @flow(task_runner=ProfileTaskRunner(profiles=[CPU, gpu], default="cpu"))
    def readable():
        nap.with_options(tags=[profile("gpu-etl")]).submit(0.2).result()
        run = FlowRunContext.get().flow_run
        return run.id, run.name

    run_id, run_name = readable()
    _drain()
    events = flow_run_events(run_id, {"prefix": ["gpu-tasks."]}, at_least=5)
    by_name = {e["event"]: e for e in events}
    assert set(by_name) == {
        "gpu-tasks.cluster.provisioned",
        "gpu-tasks.device.leased",
        "gpu-tasks.cluster.closed",
        "gpu-tasks.device.released",
        "gpu-tasks.flow-run.summary",
    }, [e["event"] for e in events]
    for event in events:  # the UI names the flow run (and only this one), not its id
        runs = [r for r in event["related"] if r["prefect.resource.id"].startswith("prefect.flow-run.")]
        assert runs and all(r["prefect.resource.id"] == f"prefect.flow-run.{run_id}" for r in runs), event
        assert all(r.get("prefect.resource.name") == run_name for r in runs), event
        assert all(isinstance(v, str) for v in event["resource"].values()), event["resource"]
    closed = by_name["gpu-tasks.cluster.closed"]
    [device] = closed["payload"]["devices"]
    name = closed["resource"]["prefect.resource.name"]
    assert re.fullmatch(
        rf"gpu-etl on GPU {device} \(emulated\): held \d+\.\d device-s, busy \d+\.\d \(\d+%\), 1 task; "
        r"flow run ended",
        name,
    ), name
    labels = closed["resource"]
    assert labels["gpu-tasks.profile"] == "gpu-etl" and labels["gpu-tasks.devices"] == device
    assert labels["gpu-tasks.reason"] == "flow run ended" and labels["gpu-tasks.tasks"] == "1"
    assert labels["gpu-tasks.priority"] == "0" and closed["payload"]["priority"] == 0, "the profile's own"
    assert float(labels["gpu-tasks.held-seconds"]) == closed["payload"]["held_s"] > 0
    assert float(labels["gpu-tasks.busy-seconds"]) == closed["payload"]["busy_s"] >= 0.2
    started = by_name["gpu-tasks.cluster.provisioned"]["resource"]["prefect.resource.name"]
    assert re.fullmatch(rf"gpu-etl on GPU {device} \(emulated\): 1 worker up in \d+\.\d s.*", started), (
        started
    )
    summary = by_name["gpu-tasks.flow-run.summary"]["resource"]
    assert summary["prefect.resource.name"].startswith(
        f"flow run {run_name}: gpu-etl on GPU {device} (emulated)"
    )
    assert summary["gpu-tasks.held-seconds"] == labels["gpu-tasks.held-seconds"]
    assert summary["gpu-tasks.priorities"] == "gpu-etl=0"


@pytest.mark.usefixtures("no_leaked_processes", "emulated")
def test_exit_time_events_of_a_subflow_relate_to_it_not_to_its_parent():
    """A subflow's runner exits after Prefect left the subflow's run context and is back in
    the parent's: its closed, released and summary events still relate to the subflow only."""
    gpu = ResourceProfile(name="gpu-sub", gpus=1, idle_timeout=30)

    @flow(task_runner=ProfileTaskRunner(profiles=[CPU, gpu], default="cpu"))
    def child():
        nap.with_options(tags=[profile("gpu-sub")]).submit(0.05).result()
        return FlowRunContext.get().flow_run.id

    @flow
    def parent():
        return FlowRunContext.get().flow_run.id, child()

    parent_id, child_id = parent()
    _drain()
    events = flow_run_events(child_id, {"prefix": ["gpu-tasks."]}, at_least=5)
    assert {"gpu-tasks.cluster.closed", "gpu-tasks.flow-run.summary"} <= {e["event"] for e in events}
    for event in events:
        runs = {
            r["prefect.resource.id"]
            for r in event["related"]
            if r["prefect.resource.id"].startswith("prefect.flow-run.")
        }
        assert runs == {f"prefect.flow-run.{child_id}"}, (event["event"], runs, parent_id)


def _create_automation_with_the_documented_command() -> str:
    """``prefect automation create --from-file infra/automations/gpu-waste.yaml``; its id."""
    from prefect.settings import PREFECT_API_URL

    prefect_cli = Path(sys.executable).with_name("prefect")
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    done = subprocess.run(
        [str(prefect_cli), "automation", "create", "--from-file", str(AUTOMATION_FILE)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    match = re.search(r"with id\s+([0-9a-f-]{36})", done.stdout)  # rich may wrap the line
    assert match, done.stdout
    return match.group(1)


def _automation_events(automation_id: str, summary_id: str, want: set[str], timeout: float = 60.0) -> dict:
    """The automation's own events caused by the summary event ``summary_id``, by name, once
    all of ``want`` are stored (the server evaluates triggers and persists events asynchronously)."""
    deadline = time.monotonic() + timeout
    found: dict = {}
    while True:
        events = stored_events(
            event={"prefix": ["prefect.automation."]},
            resource={"id": [f"prefect.automation.{automation_id}"]},
        )
        for event in events:
            caused = (event["payload"].get("triggering_event") or {}).get("id") == summary_id or any(
                r["prefect.resource.id"] == f"prefect.event.{summary_id}" for r in event["related"]
            )
            if caused:
                found[event["event"]] = event
        if want <= set(found) or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


@pytest.mark.usefixtures("no_leaked_processes", "emulated")
def test_the_shipped_automation_fires_on_a_mostly_idle_run(monkeypatch):
    """The documented command creates the automation; a run that holds its device mostly idle
    raises held-busy-over-2 on its summary, and the server fires the automation for it."""
    monkeypatch.setenv("GPU_TASKS_TUNE_ALERT_HELD_BUSY", "2")
    monkeypatch.setenv("GPU_TASKS_TUNE_ALERT_MIN_HELD_SECONDS", "0")  # a test run holds seconds, not minutes
    monkeypatch.setenv("GPU_TASKS_TUNE_ALERT_DEVICE_WAIT_SECONDS", "60")
    automation_id = _create_automation_with_the_documented_command()
    try:
        idle = ResourceProfile(name="gpu-idle", gpus=1, idle_timeout=5)

        @flow(task_runner=ProfileTaskRunner(profiles=[CPU, idle], default="cpu"))
        def mostly_idle():
            nap.with_options(tags=[profile("gpu-idle")]).submit(0.05).result()
            time.sleep(2.0)  # the device stays leased and idle (idle_timeout 5 s) until the run ends
            return FlowRunContext.get().flow_run.id

        run_id = mostly_idle()
        _drain()
        [summary] = flow_run_events(run_id, {"name": ["gpu-tasks.flow-run.summary"]})
        resource = summary["resource"]
        assert resource["gpu-tasks.alert"] == "held-busy-over-2", resource
        assert float(resource["gpu-tasks.held-busy"]) > 2 and summary["payload"]["alerts"] == [
            "held-busy-over-2"
        ]
        fired = _automation_events(
            automation_id,
            summary["id"],
            {"prefect.automation.triggered", "prefect.automation.action.executed"},
        )
        assert "prefect.automation.triggered" in fired, f"the automation did not fire for {summary['id']}"
        triggered = fired["prefect.automation.triggered"]
        assert triggered["resource"]["prefect.resource.name"] == "gpu-tasks: GPUs held idle or waited for"
        assert triggered["payload"]["triggering_event"]["resource"]["gpu-tasks.alert"] == "held-busy-over-2"
        assert "prefect.automation.action.executed" in fired, sorted(fired)
    finally:
        api("DELETE", f"/automations/{automation_id}")
