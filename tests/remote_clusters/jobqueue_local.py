"""dask-jobqueue's local job class, made safe to use in a long test session.

``dask_jobqueue.local.LocalJob`` (0.9.0, with distributed 2026.7) stops reading a job's
stderr once its worker registered and never reads its stdout, so a chatty worker blocks
on a full pipe; it leaves killed jobs as zombies, cannot close a job that failed to
start, and never marks a closed job closed (``SpecCluster.close`` asserts it is). Those
are faults of the local stand-in, not of the job-queue machinery the tests exercise.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from dask_jobqueue.local import LocalJob
from distributed.core import Status
from tornado.iostream import StreamClosedError


class DrainedLocalJob(LocalJob):
    """A ``LocalJob`` that drains its job's output, reaps it and is marked closed."""

    async def _submit_job(self, script_filename: str) -> Any:
        job_id = await super()._submit_job(script_filename)

        async def drain(stream: Any) -> None:
            with contextlib.suppress(StreamClosedError):
                while True:
                    await stream.read_bytes(65536, partial=True)

        self._drains = [asyncio.ensure_future(drain(s)) for s in (self.process.stdout, self.process.stderr)]
        return job_id

    async def close(self) -> None:
        proc = getattr(getattr(self, "process", None), "proc", None)
        pid = self.job_id or (proc.pid if proc is not None else None)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                await self._close_job(str(pid), self.cancel_command)
        if proc is not None:
            with contextlib.suppress(Exception):
                await asyncio.get_running_loop().run_in_executor(None, proc.wait, 5)
            for stream in (self.process.stdout, self.process.stderr):
                with contextlib.suppress(Exception):
                    stream.close()
        self.status = Status.closed
        self._event_finished.set()
