"""Raw calls to the test Prefect server's REST API (status code and JSON, never raising)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


def api(method: str, path: str, **kw: Any) -> tuple[int, Any]:
    """``(status, json or text)`` for one request to the server in ``PREFECT_API_URL``."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import PrefectHTTPStatusError

    async def call() -> tuple[int, Any]:
        async with get_client() as client:
            try:
                response = await client._client.request(method, path, **kw)
            except PrefectHTTPStatusError as exc:
                return exc.response.status_code, exc.response.text
            return response.status_code, (response.json() if response.content else None)

    return asyncio.run(call())


def stored_events(**event_filter: Any) -> list[Any]:
    """The first 50 stored events that match ``event_filter`` (the keys of the events API's
    ``filter``: ``event``, ``resource``, ``related``, ...), oldest first, of any time."""
    _, body = api(
        "POST",
        "/events/filter",
        json={
            "filter": {"occurred": {"since": "2000-01-01T00:00:00Z"}, "order": "ASC", **event_filter},
            "limit": 50,
        },
    )
    return list(body["events"])


def flow_run_events(
    flow_run_id: Any, event: dict[str, Any], at_least: int = 1, timeout: float = 15.0
) -> list[Any]:
    """Events related to the flow run that match ``event`` (``{"prefix": [...]}`` or ``{"name": [...]}``),
    oldest first, once at least ``at_least`` are stored (the server persists them asynchronously)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        events = stored_events(
            event=event, related={"resources_in_roles": [[f"prefect.flow-run.{flow_run_id}", "flow-run"]]}
        )
        if len(events) >= at_least or time.monotonic() > deadline:
            return events
        time.sleep(0.25)


def run_logs(flow_run_id: Any, words: str, timeout: float = 15.0) -> list[str]:
    """The flow run's log lines, as the server stored them, that contain ``words``: once one is
    there (this process's queued logs are sent first; the server stores them asynchronously), or
    none after ``timeout``."""
    import time

    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)
    deadline = time.monotonic() + timeout
    while True:
        _, logs = api("POST", "/logs/filter", json={"logs": {"flow_run_id": {"any_": [str(flow_run_id)]}}})
        found = [log["message"] for log in logs if words in log["message"]]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.25)


def flow_run_task_runs(
    flow_run_id: Any, until: Callable[[list[Any]], bool], timeout: float = 20.0
) -> list[Any]:
    """The flow run's task runs as the server recorded them, once ``until(runs)`` holds (it records
    them from their events, a moment after the runs), or as they are after ``timeout``."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        _, runs = api("POST", "/task_runs/filter", json={"flow_runs": {"id": {"any_": [str(flow_run_id)]}}})
        if until(runs) or time.monotonic() > deadline:
            return list(runs)
        time.sleep(0.25)
