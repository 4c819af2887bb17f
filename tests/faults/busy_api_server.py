"""A real Prefect server (SQLite, 127.0.0.1) that answers the first ``BUSY_API_REFUSALS`` tag-slot
requests of each side (``POST /api/v2/concurrency_limits/increment-with-lease``) with 503 Service Unavailable,
as a Prefect server busy with tens of thousands of task runs does; the rest it serves as Prefect
does. Each refusal is counted in ``BUSY_API_COUNT_FILE``, with when it was made (``refused_at``) and
when the first request it then let through came (``accepted_at``), and every tag-slot request of
each side (``asked``).

``BUSY_API_FAULT=worker``: it refuses the worker's requests alone (the task engine's check of the
``tag:gpu:<id>`` placement tags), the flow process's it lets through.

    python tests/faults/busy_api_server.py PORT
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

FAULT_PATH = "/api/v2/concurrency_limits/increment-with-lease"


def _side(fault: str, body: bytes) -> str | None:
    """Whose tag-slot request it is, when it is one to refuse (``None``: let it through)."""
    side = "worker" if b"tag:gpu:" in body else "flow"
    return side if fault == "slots" or side == fault else None


def refusing(app: Any, refusals: int, count_file: Path, fault: str = "slots") -> Any:
    """``app``, less the first ``refusals`` requests to the tag-slot endpoint of each side (503
    instead): the flow process's (the task's own tags) and the worker's (Prefect's task engine,
    with the ``tag:gpu:<id>`` placement tags). ``count_file`` gets ``{"flow": n, "worker": n, ...}``."""
    served: dict[str, Any] = {"flow": 0, "worker": 0, "refused_at": [], "accepted_at": None, "asked": {}}

    async def busy(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != FAULT_PATH:
            await app(scope, receive, send)
            return
        body, more = b"", True
        while more:  # read the request to see whose it is, then hand it on unchanged
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        side = _side(fault, body)
        asker = "worker" if b"tag:gpu:" in body else "flow"  # every tag-slot request, by side
        served["asked"][asker] = served["asked"].get(asker, 0) + 1
        count_file.write_text(json.dumps(served))
        if side is not None and served[side] < refusals:
            served[side] += 1
            served["refused_at"].append(time.time())
            count_file.write_text(json.dumps(served))
            headers = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": b'{"detail": "busy (refused by the test)"}'})
            return
        if side is not None and served["accepted_at"] is None:
            served["accepted_at"] = time.time()
            count_file.write_text(json.dumps(served))
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return dict(await receive())

        await app(scope, replay, send)

    return busy


def main() -> None:
    import uvicorn
    from prefect.server.api.server import create_app

    app = refusing(
        create_app(final=True),
        int(os.environ["BUSY_API_REFUSALS"]),
        Path(os.environ["BUSY_API_COUNT_FILE"]),
        os.environ.get("BUSY_API_FAULT", "slots"),
    )
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")


if __name__ == "__main__":
    main()
