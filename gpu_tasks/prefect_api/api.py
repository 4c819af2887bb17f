"""Which Prefect API a flow run reports to, and how its worker processes reach the same one, with
ephemeral servers switched off (docs/runner.md, "Faults: ... the ephemeral API")."""

from __future__ import annotations

import copy
import functools
import os
import ssl
from typing import Any

from gpu_tasks.errors import GpuTasksError

PROXY_VARIABLES = ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


@functools.cache
def _trusts_nothing() -> ssl.SSLContext:
    """A TLS context that trusts nothing: handed to a client of a plain-http API, it can never weaken one."""
    return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


def client_tls(api_url: str | None) -> dict[str, Any] | None:
    """``httpx_settings`` for a client of ``api_url``: over plain http, no certifi bundle loaded per
    client (docs/operations.md); ``None`` (Prefect's own) otherwise, or with a proxy (it may speak TLS)."""
    if any(os.environ.get(v) for v in PROXY_VARIABLES):
        return None
    if api_url and api_url.lower().startswith("http://"):
        return {"verify": _trusts_nothing()}
    return None


def sync_client(timeout: float | None = None) -> Any:
    """Prefect's ``get_client(sync_client=True)`` for the current settings (:func:`client_tls`), its
    requests given up after ``timeout`` s (``None``: Prefect's own)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    settings = client_tls(str(url) if url else None)
    if timeout is not None:
        settings = {**(settings or {}), "timeout": timeout}
    return get_client(sync_client=True, httpx_settings=settings)


# (pid, URL) of the ephemeral server this process last found: a forked child finds none of its parent's
_SEEN_EPHEMERAL: list[tuple[int, str]] = []


def ephemeral_api_url() -> str | None:
    """The URL of the ephemeral server the context in force talks to, remembered; never starts one.
    Prefect keeps it in no setting, only as the ``api_url`` of the client a run's context holds."""
    from prefect.context import AsyncClientContext, FlowRunContext, SyncClientContext, TaskRunContext
    from prefect.settings import get_current_settings

    if get_current_settings().api.url:
        return None
    for context in (SyncClientContext, AsyncClientContext, FlowRunContext, TaskRunContext):
        client = getattr(context.get(), "client", None)
        if client is not None:
            return _remember(str(client.api_url))
    return None


def _remember(url: str) -> str:
    url = url.rstrip("/")
    _SEEN_EPHEMERAL[:] = [(os.getpid(), url)]
    return url


def last_ephemeral_api_url() -> str | None:
    """The ephemeral server URL this process last found, for code outside any run's context."""
    return next((url for pid, url in _SEEN_EPHEMERAL if pid == os.getpid()), None)


def flow_api_url() -> str | None:
    """The API URL this process's Prefect clients use: the setting, else its ephemeral server's. Never
    starts a server."""
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    return str(url) if url else ephemeral_api_url() or last_ephemeral_api_url()


def require_flow_api_url(profile: str) -> str:
    """``flow_api_url()``, starting Prefect's ephemeral server as its client would if needed;
    ``GpuTasksError`` when there is no API URL and ephemeral servers are off."""
    url = flow_api_url()
    if url is not None:
        return url
    from prefect.client.orchestration import get_client

    try:
        client = get_client(sync_client=True)  # starts the ephemeral server when that is allowed
    except ValueError as exc:
        raise GpuTasksError(
            f"profile {profile!r} runs tasks in worker processes, which report to the flow run's "
            "Prefect API, but there is none: set PREFECT_API_URL (or allow Prefect's ephemeral "
            "server with PREFECT_SERVER_EPHEMERAL_ENABLED=true)"
        ) from exc
    return _remember(str(client.api_url))


def worker_env(api_url: str) -> dict[str, str]:
    """Environment for worker processes: the flow run's API, credentials, no server of their own."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    env = {
        "PREFECT_API_URL": api_url,
        "PREFECT_SERVER_EPHEMERAL_ENABLED": "false",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    if settings.api.key:
        env["PREFECT_API_KEY"] = settings.api.key.get_secret_value()
    if settings.api.auth_string:
        env["PREFECT_API_AUTH_STRING"] = settings.api.auth_string.get_secret_value()
    return env


def for_workers(serialized: dict[str, Any], api_url: str) -> dict[str, Any]:
    """Serialized ``SettingsContext`` fields with the flow run's API URL and no ephemeral server."""
    out = dict(serialized)
    settings = copy.deepcopy(dict(out.get("settings") or {}))
    settings.setdefault("api", {})["url"] = api_url
    settings.setdefault("server", {}).setdefault("ephemeral", {})["enabled"] = False
    from prefect.settings import get_current_settings

    key = get_current_settings().api.key
    if key is not None:  # workers on other hosts have no PREFECT_API_KEY of their own
        settings["api"]["key"] = key.get_secret_value()
    out["settings"] = settings
    return out


def api_headers() -> dict[str, str]:
    """The headers this process's Prefect client sends: its auth string, else its API key, if any."""
    import base64

    from prefect.settings import get_current_settings

    api = get_current_settings().api
    if api.auth_string:
        auth = base64.b64encode(api.auth_string.get_secret_value().encode()).decode()
        return {"Authorization": f"Basic {auth}"}
    if api.key:
        return {"Authorization": f"Bearer {api.key.get_secret_value()}"}
    return {}


def unreachable_api_error(profile: str, api_url: str, scheduler: str, failed: dict[str, str]) -> str:
    """The message for workers of ``scheduler`` that could not reach ``api_url`` (``failed``: worker ->
    what went wrong there)."""
    from urllib.parse import urlsplit

    which = "; ".join(f"{w}: {why}" for w, why in sorted(failed.items()))
    local = _is_loopback(urlsplit(api_url).hostname or "")
    return (
        f"profile {profile!r}: {len(failed)} worker(s) of {scheduler} cannot reach this flow run's Prefect "
        f"API at {api_url} ({which})"
        + (", an address each worker takes for its own host" if local else "")
        + ". Their tasks could not report to it. Expose the API on an address the workers can reach "
        "(`prefect server start --host 0.0.0.0`, or behind a proxy) and set PREFECT_API_URL to it, "
        "e.g. http://<this host's name>:4200/api, or use Prefect Cloud"
    )


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host in ("localhost", "localhost.localdomain") or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
