"""Run on a remote worker (``Client.run``): can it reach the flow run's Prefect API? Only the right
server knows the flow run by its id; another one (another user's, the worker's own) answers 404."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


def probe_api(api_url: str, flow_run_id: str | None, headers: dict[str, str], timeout: float) -> str | None:
    """``None`` when ``api_url`` answers for ``flow_run_id`` (without one, any ``/health`` answer);
    else why not, in words."""
    path = f"/flow_runs/{flow_run_id}" if flow_run_id else "/health"
    request = urllib.request.Request(api_url.rstrip("/") + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        if exc.code == 404 and flow_run_id:
            return (
                f"a server answered but knows no flow run {flow_run_id} (HTTP 404): not this flow run's API"
            )
        return f"HTTP {exc.code} {exc.reason}"
    except urllib.error.URLError as exc:
        return _reason(exc.reason)
    except OSError as exc:  # a timeout while reading, a reset connection
        return _reason(exc)
    if not flow_run_id:
        return None
    try:
        answered = json.loads(body).get("id")
    except (ValueError, AttributeError):
        answered = None
    if answered != flow_run_id:
        return f"a server answered but not with flow run {flow_run_id}: not this flow run's API"
    return None


def _reason(exc: object) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower() if exc.errno else str(exc)
    return f"{type(exc).__name__}: {exc}"
