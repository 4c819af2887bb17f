"""Prefect events about clusters, devices, task runs and flow runs, each related to its flow run (best
effort: never fail a run over one). The builders are pure; the ``emit_*`` functions send."""

from __future__ import annotations

import contextlib
import logging
import math
import re
import socket
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from gpu_tasks.reporting.alerts import AlertThresholds, RunTotals, alert_label, run_alerts
from gpu_tasks.reporting.ledger import percent

if TYPE_CHECKING:
    from gpu_tasks.profiles import ResourceProfile
    from gpu_tasks.reporting.ledger import LedgerRow
    from gpu_tasks.reporting.measured import Measured

logger = logging.getLogger(__name__)

Resource = dict[str, str]


class ClusterView(Protocol):
    """What the events read of a profile's cluster: reporting sits below the clusters, imports none."""

    @property
    def profile(self) -> ResourceProfile: ...
    @property
    def devices(self) -> Sequence[str]: ...
    @property
    def queue_priority(self) -> int | None: ...
    @property
    def emulated(self) -> bool: ...
    @property
    def dashboard_link(self) -> str | None: ...


_DEVICE_EVENTS = {  # the device event that each cluster event implies for the devices it names
    "provisioned": "leased",
    "scaled": "leased",
    "closed": "released",
    "crashed": "released",
    "preempted": "released",
}

_LABELS = {  # payload keys that are also resource labels (strings), so automations can match on them
    "reason": "gpu-tasks.reason",
    "workers": "gpu-tasks.workers",
    "added": "gpu-tasks.added-devices",
    "held_s": "gpu-tasks.held-seconds",
    "busy_s": "gpu-tasks.busy-seconds",
    "tasks": "gpu-tasks.tasks",
    "wait_devices_s": "gpu-tasks.device-wait-seconds",
    "start_workers_s": "gpu-tasks.start-seconds",
    "out_of_memory": "gpu-tasks.out-of-memory",
    "exitcode": "gpu-tasks.exitcode",
    "seconds": "gpu-tasks.wait-seconds",
    "limits": "gpu-tasks.limits",
    "from_profile": "gpu-tasks.from-profile",
    "to_profile": "gpu-tasks.to-profile",
    "state": "gpu-tasks.state",
    "priority": "gpu-tasks.priority",
    "kind": "gpu-tasks.wait-kind",
}


@dataclass(frozen=True)
class RunRef:
    """The flow run that events relate to, named for the UI."""

    id: uuid.UUID | None = None
    name: str | None = None

    @classmethod
    def current(cls) -> RunRef:
        """The flow run of the current Prefect run context (none outside a flow run)."""
        from prefect.context import FlowRunContext

        ctx = FlowRunContext.get()
        run = ctx.flow_run if ctx is not None else None
        return cls(run.id, run.name) if run is not None else cls()

    def related(self) -> list[Resource]:
        """The flow run as a related resource; none without a run."""
        return [_related("flow-run", self.id, self.name)] if self.id is not None else []


def _related(role: str, run_id: uuid.UUID, name: str | None) -> Resource:
    """Prefect's ``<role>`` (``flow-run``, ``task-run``) as a related resource, named where known."""
    resource = {"prefect.resource.id": f"prefect.{role}.{run_id}", "prefect.resource.role": role}
    return resource | ({"prefect.resource.name": name} if name else {})


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _number(value: float) -> str:
    """A label's number: ``12.345``, ``0``, ``inf``."""
    if math.isinf(value):
        return "inf"
    return f"{value:.3f}".rstrip("0").rstrip(".")


def _label_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return _number(value)
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value) or "-"
    return str(value)


def payload_labels(payload: Mapping[str, Any]) -> Resource:
    """``gpu-tasks.*`` labels (strings) for the payload keys automations may match on."""
    labels = {_LABELS[k]: _label_value(v) for k, v in payload.items() if k in _LABELS and v is not None}
    held, busy = payload.get("held_s"), payload.get("busy_s")
    if isinstance(held, int | float) and isinstance(busy, int | float):
        labels["gpu-tasks.utilization"] = _number(busy / held if held > 0 else 0.0)
    return labels


def devices_phrase(devices: Sequence[str], emulated: bool, gpu: bool = True) -> str:
    """``GPU 0,1 (emulated)``, ``CPU``; ``GPU`` for a GPU profile whose devices are not known yet."""
    if not devices:
        return "GPU" if gpu else "CPU"
    return f"GPU {','.join(devices)}" + (" (emulated)" if emulated else "")


def usage_phrase(held: float, busy: float, tasks: int | None, devices: bool = True) -> str:
    unit = "device-s" if devices else "s"
    text = f"held {held:.1f} {unit}, busy {busy:.1f} ({percent(busy, held)}%)"
    return text + (f", {plural(tasks, 'task')}" if tasks is not None else "")


def cluster_sentence(what: str, who: str, payload: Mapping[str, Any], devices: bool = True) -> str:
    """The resource name of a ``gpu-tasks.cluster.<what>`` event about ``who``."""
    if what == "provisioned":
        text = f"{who}: {plural(int(payload.get('workers', 0)), 'worker')} up"
        if "start_workers_s" in payload:
            text += f" in {float(payload['start_workers_s']):.1f} s"
        wait = float(payload.get("wait_devices_s") or 0.0)
        return text + (f", after waiting {wait:.1f} s for devices" if wait >= 0.05 else "")
    if what == "scaled":
        return f"{who}: added, {plural(int(payload.get('workers', 0)), 'worker')} now"
    if what == "preempting" and "holders" not in payload:  # on a shared scheduler's waiter board
        return (
            f"{who}: queued {float(payload.get('waited_s') or 0):.1f} s on a shared scheduler at priority "
            f"{payload.get('priority') or 0}: asking preemptible work of lower priority for room"
        )
    if what == "preempted" and "by" in payload and "held_s" not in payload:  # tasks interrupted
        by = payload["by"] or {}
        run = f" of flow run {by['flow_run_name']}" if by.get("flow_run_name") else ""
        return (
            f"{who}: interrupted {plural(int(payload.get('tasks') or 0), 'task')} on worker "
            f"{payload.get('worker')} for {by.get('profile')}{run} (priority {by.get('priority') or 0})"
        )
    if what == "preempting":
        holders = "; ".join(
            f"{h.get('profile')}"
            + (f" of flow run {h['flow_run_name']}" if h.get("flow_run_name") else "")
            + f" (priority {h.get('priority') or 0})"
            for h in payload.get("holders") or ()
        )
        return f"{who}: preempting {holders}"
    if "held_s" in payload and "busy_s" in payload:
        usage = usage_phrase(
            float(payload["held_s"]), float(payload["busy_s"]), payload.get("tasks"), devices
        )
        return f"{who}: {usage}; {payload.get('reason', what)}"
    return f"{who}: {payload.get('reason', what)}"


def cluster_resource(
    what: str,
    run: RunRef,
    profile: str,
    kind: str,
    devices: Sequence[str],
    emulated: bool,
    gpu: bool,
    payload: Mapping[str, Any],
) -> Resource:
    """The resource of a ``gpu-tasks.cluster.<what>`` event."""
    return {
        "prefect.resource.id": f"gpu-tasks.cluster.{run.id or 'local'}.{profile}",
        "prefect.resource.name": cluster_sentence(
            what, f"{profile} on {devices_phrase(devices, emulated, gpu)}", payload, bool(devices)
        ),
        "gpu-tasks.profile": profile,
        "gpu-tasks.devices": ",".join(devices) or "-",
        "gpu-tasks.emulated": str(emulated).lower(),
        "gpu-tasks.kind": kind,
        **payload_labels(payload),
    }


def device_resource(
    what: str, address: str, profile: str, emulated: bool, reason: str | None = None, host: str | None = None
) -> Resource:
    """The resource of a ``gpu-tasks.device.<leased|released>`` event (``0``, or ``<host>:0``)."""
    here = host or socket.gethostname()
    where, _, device = address.rpartition(":") if ":" in address else (here, "", address)
    name = f"{devices_phrase([address], emulated)} {'to' if what == 'leased' else 'from'} profile {profile}"
    resource = {
        "prefect.resource.id": f"gpu-tasks.device.{where}.{device}",
        "prefect.resource.name": name + (f": {reason}" if reason else ""),
        "gpu-tasks.profile": profile,
        "gpu-tasks.devices": address,
        "gpu-tasks.host": where,
        "gpu-tasks.emulated": str(emulated).lower(),
    }
    if reason:
        resource["gpu-tasks.reason"] = reason
    return resource


def device_payload(profile: str, reason: str | None, cluster_payload: Mapping[str, Any]) -> dict[str, Any]:
    """The payload of a ``gpu-tasks.device.*`` event, with a gang's wiring where the cluster's has it."""
    wiring = {k: cluster_payload[k] for k in ("gang", "worst_link") if cluster_payload.get(k)}
    return {"profile": profile, **({"reason": reason} if reason else {}), **wiring}


def task_sentence(what: str, task_name: str, profile: str, payload: Mapping[str, Any]) -> str:
    """The resource name of a ``gpu-tasks.task.<what>`` event."""
    if what == "escalated":
        return (
            f"{task_name} moved from profile {payload.get('from_profile')} to {payload.get('to_profile')}: "
            f"{payload.get('reason', 'out of memory')}"
        )
    if what == "slot-waited":
        limits = ", ".join(payload.get("limits") or ()) or "a concurrency slot"
        return (
            f"{task_name} on profile {profile} waited {float(payload.get('seconds', 0)):.1f} s for {limits}, "
            "holding no device"
        )
    if what == "quota-waited":
        return (
            f"{task_name} on profile {profile} waited {float(payload.get('seconds', 0)):.1f} s for room in "
            f"quota {payload.get('quota')}, holding no device"
        )
    if what == "waiting":
        return f"{task_name} on profile {profile} waits: {payload.get('text') or payload.get('kind')}"
    if what == "cache-hit":
        return f"{task_name} on profile {profile}: result from Prefect's cache, no device leased"
    if what == "preempted":
        why = payload.get("reason", "preempted")
        return f"{task_name} on profile {profile}: {why}; runs again when devices free"
    return f"{task_name} on profile {profile}: {what}"


def task_resource(
    what: str, task_run_id: uuid.UUID, task_name: str, profile: str, payload: Mapping[str, Any]
) -> Resource:
    """The resource of a ``gpu-tasks.task.<what>`` event."""
    return {
        "prefect.resource.id": f"gpu-tasks.task.{task_run_id}",
        "prefect.resource.name": task_sentence(what, task_name, profile, payload),
        "gpu-tasks.profile": profile,
        "gpu-tasks.task": task_name,
        **payload_labels(payload),
    }


def summary_sentence(run_name: str | None, totals: RunTotals, alerts: Sequence[str]) -> str:
    who = f"flow run {run_name}" if run_name else "flow run"
    where = f"{', '.join(totals.profiles)} on {devices_phrase(totals.devices, totals.emulated)}"
    text = (
        f"{who}: {where} {usage_phrase(totals.held_seconds, totals.busy_seconds, totals.tasks)}; "
        f"longest device wait {totals.longest_device_wait:.1f} s"
    )
    return text + (f"; alert: {', '.join(alerts)}" if alerts else "")


def run_priorities(totals: RunTotals, priorities: Mapping[str, int] | None) -> dict[str, int]:
    """The priorities (by profile) that the run's device-holding profiles queued for devices at."""
    return {p: int(priorities[p]) for p in totals.profiles if priorities and p in priorities}


def _priority_labels(priorities: Mapping[str, int]) -> Resource:
    if not priorities:
        return {}
    return {
        "gpu-tasks.priority": str(max(priorities.values())),
        "gpu-tasks.priorities": ",".join(f"{p}={v}" for p, v in priorities.items()),
    }


def summary_resource(
    run: RunRef, totals: RunTotals, thresholds: AlertThresholds, priorities: Mapping[str, int] | None = None
) -> Resource:
    """The resource of a ``gpu-tasks.flow-run.summary`` event (automations match ``gpu-tasks.alert``)."""
    alerts = run_alerts(totals, thresholds)
    return {
        "prefect.resource.id": f"gpu-tasks.flow-run.{run.id or 'local'}",
        "prefect.resource.name": summary_sentence(run.name, totals, alerts),
        "gpu-tasks.profiles": ",".join(totals.profiles) or "-",
        "gpu-tasks.devices": ",".join(totals.devices) or "-",
        "gpu-tasks.emulated": str(totals.emulated).lower(),
        "gpu-tasks.held-seconds": _number(totals.held_seconds),
        "gpu-tasks.busy-seconds": _number(totals.busy_seconds),
        "gpu-tasks.utilization": _number(totals.utilization),
        "gpu-tasks.held-busy": _number(totals.held_per_busy),
        "gpu-tasks.device-wait-seconds": _number(totals.longest_device_wait),
        "gpu-tasks.tasks": str(totals.tasks),
        "gpu-tasks.alert": alert_label(alerts),
        **_priority_labels(run_priorities(totals, priorities)),
    }


def summary_payload(
    totals: RunTotals, thresholds: AlertThresholds, priorities: Mapping[str, int] | None = None
) -> dict[str, Any]:
    """The numbers of a ``gpu-tasks.flow-run.summary`` event, with the thresholds they met."""
    held_busy = totals.held_per_busy
    ran_at = run_priorities(totals, priorities)
    return {
        "held_s": round(totals.held_seconds, 3),
        "busy_s": round(totals.busy_seconds, 3),
        "utilization": round(totals.utilization, 3),
        "held_busy": None if math.isinf(held_busy) else round(held_busy, 3),
        "longest_device_wait_s": round(totals.longest_device_wait, 3),
        "devices": list(totals.devices),
        "profiles": list(totals.profiles),
        "tasks": totals.tasks,
        "alerts": list(run_alerts(totals, thresholds)),
        "priority": max(ran_at.values()) if ran_at else None,
        "priorities": ran_at,
        "thresholds": {
            "held_busy": thresholds.held_busy,
            "device_wait_s": thresholds.device_wait_seconds,
            "min_held_s": thresholds.min_held_seconds,
        },
    }


def feed_url(ui_url: str, flow_run_id: uuid.UUID | str | None = None, v1: bool = False) -> str:
    """The Prefect UI's feed of gpu-tasks events, of one flow run if given; ``v1``: the older Vue UI's
    ``/events`` (plain parameters), not ``/v2`` (JSON arrays)."""
    from urllib.parse import quote

    base = ui_url.rstrip("/")
    if v1:
        query = "events=gpu-tasks.*" + (f"&resource=prefect.flow-run.{flow_run_id}" if flow_run_id else "")
        return f"{base}/events?{query}"
    query = "events=" + quote('["gpu-tasks.*"]', safe="*")
    if flow_run_id:
        query += "&resource=" + quote(f'["prefect.flow-run.{flow_run_id}"]')
    return f"{base}/v2/events?{query}"


@contextlib.contextmanager
def _sending(event: str) -> Iterator[Any]:
    """Prefect's ``emit_event``; an error building or sending ``event`` is logged, never raised."""
    try:
        from prefect.events import emit_event

        yield emit_event
    except Exception:  # events are for watching; never fail the run over one
        logger.debug("could not emit %s", event, exc_info=True)


def emit_cluster_event(
    what: str,
    cluster: ClusterView,
    run: RunRef,
    payload: dict[str, Any],
    devices: Sequence[str] | None = None,
) -> None:
    """``gpu-tasks.cluster.<what>`` about ``cluster`` (and the device events it implies)."""
    with _sending(f"gpu-tasks.cluster.{what}") as emit_event:
        name = cluster.profile.name
        devices = tuple(cluster.devices if devices is None else devices)
        if cluster.queue_priority is not None:  # the priority this flow run queued for devices at
            payload = {**payload, "priority": cluster.queue_priority}
        related = run.related()
        resource = cluster_resource(
            what, run, name, cluster.profile.kind, devices, cluster.emulated, cluster.profile.is_gpu, payload
        )
        emit_event(event=f"gpu-tasks.cluster.{what}", resource=resource, related=related, payload=payload)
        lease_event = _DEVICE_EVENTS.get(what)
        reason = payload.get("reason") if lease_event == "released" else None
        for address in devices if lease_event else ():
            emit_event(
                event=f"gpu-tasks.device.{lease_event}",
                resource=device_resource(lease_event or "", address, name, cluster.emulated, reason),
                related=related,
                payload=device_payload(name, reason, payload),
            )


def emit_task_event(
    what: str,
    task_run_id: uuid.UUID,
    task_name: str,
    profile: str,
    run: RunRef,
    payload: dict[str, Any],
    task_run_name: str | None = None,
) -> None:
    """``gpu-tasks.task.<what>`` about one task run."""
    with _sending(f"gpu-tasks.task.{what}") as emit_event:
        emit_event(
            event=f"gpu-tasks.task.{what}",
            resource=task_resource(what, task_run_id, task_name, profile, payload),
            # before it started, its run's name is not known yet: the task's, not the UI's bare id
            related=[_related("task-run", task_run_id, task_run_name or task_name), *run.related()],
            payload=payload,
        )


def emit_run_summary(
    rows: Sequence[LedgerRow],
    run: RunRef,
    thresholds: AlertThresholds,
    priorities: Mapping[str, int] | None = None,
) -> None:
    """``gpu-tasks.flow-run.summary`` for a run whose ledger ``rows`` held devices (none otherwise)."""
    totals = RunTotals.of(rows)
    if not totals.devices:
        return
    with _sending("gpu-tasks.flow-run.summary") as emit_event:
        emit_event(
            event="gpu-tasks.flow-run.summary",
            resource=summary_resource(run, totals, thresholds, priorities),
            related=run.related(),
            payload=summary_payload(totals, thresholds, priorities),
        )


def right_size_resource(profile: str, line: str, measured: Measured, run: RunRef) -> Resource:
    return {
        "prefect.resource.id": f"gpu-tasks.profile.{run.id or 'local'}.{profile}",
        "prefect.resource.name": line,
        "gpu-tasks.profile": profile,
        **{
            f"gpu-tasks.{k.replace('_', '-')}": _label_value(v)
            for k, v in measured.as_dict().items()
            if k != "note" and v is not None
        },
    }


def emit_right_size(profile: str, line: str, measured: Measured, run: RunRef) -> None:
    """``gpu-tasks.profile.right-size``: ``profile`` used much less than it held."""
    with _sending("gpu-tasks.profile.right-size") as emit_event:
        emit_event(
            event="gpu-tasks.profile.right-size",
            resource=right_size_resource(profile, line, measured, run),
            related=run.related(),
            payload={"profile": profile, "advice": line, **measured.as_dict()},
        )


def publish_dashboard(cluster: ClusterView) -> None:
    """A link artifact to the cluster's Dask dashboard, when dashboards are on (best effort)."""
    link = cluster.dashboard_link
    if not link:
        return
    try:
        from prefect.artifacts import create_link_artifact

        name = cluster.profile.name
        create_link_artifact(
            link=link,
            link_text=f"Dask dashboard of profile {name!r}",
            key=f"dask-dashboard-{re.sub(r'[^a-z0-9-]', '-', name.lower())}",
        )
    except Exception:
        logger.warning("could not publish the dashboard link artifact", exc_info=True)
