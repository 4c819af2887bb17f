"""What a bound warm process runs: one Dask worker or profile's scheduler (which, in the flow process,
shared its interpreter lock and, starved, dropped its workers), until the flow process closes it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from multiprocessing.connection import Connection
from typing import Any


async def serve_worker(
    conn: Connection, scheduler: str, worker_kwargs: dict[str, Any], cuda: dict[str, Any] | None
) -> None:
    """A Dask ``Worker`` of ``scheduler``; says ``("up", address)`` on ``conn`` once started."""
    from distributed import Worker

    try:
        if cuda is not None:  # a real GPU: dask-cuda's worker setup, now that the device is set
            from gpu_tasks.compat.dask_cuda import without_cpu_affinity, worker_options
            from gpu_tasks.worker.affinity import ENV

            worker_kwargs = {**worker_kwargs, **worker_options(cuda, worker_kwargs)}
            if ENV in os.environ:  # gpu-tasks sets its CPUs, not dask-cuda
                worker_kwargs["plugins"] = without_cpu_affinity(worker_kwargs.get("plugins"))
        worker = Worker(scheduler, **worker_kwargs)
        await worker
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    await _serve(conn, worker, lambda: worker.close(nanny=False, reason="gpu-tasks: closed by the runner"))


async def serve_scheduler(conn: Connection, scheduler_kwargs: dict[str, Any]) -> None:
    """A Dask ``Scheduler``; says ``("up", address)`` on ``conn`` once started."""
    from distributed import Scheduler

    try:
        scheduler = Scheduler(**scheduler_kwargs)
        await scheduler
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    await _serve(conn, scheduler, lambda: scheduler.close(reason="gpu-tasks: closed by the runner"))


async def _serve(conn: Connection, server: Any, close: Any) -> None:
    """Say the server is up, then run it until "close" arrives or the pipe closes with the flow process."""
    conn.send(("up", server.address))
    loop = asyncio.get_running_loop()

    def close_once() -> None:
        # a server Dask closes already (a scheduler asked by its cluster, on Ctrl-C) ends its loop
        # soon: a close started now was left pending there ("Task was destroyed but it is pending!")
        if server.status.name not in ("closing", "closing_gracefully", "closed", "failed"):
            asyncio.ensure_future(close())

    def wait_for_close() -> None:
        with contextlib.suppress(EOFError, OSError):
            conn.recv()
        with contextlib.suppress(RuntimeError):  # the loop has ended already
            loop.call_soon_threadsafe(close_once)

    threading.Thread(target=wait_for_close, name="gpu-tasks-warm-close", daemon=True).start()
    await server.finished()
