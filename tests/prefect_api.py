"""Raw calls to the test Prefect server's REST API (status code and JSON, never raising)."""

from __future__ import annotations

import asyncio
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
