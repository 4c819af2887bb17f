"""Several tasks starting at once in a fresh worker process never hang it.

Prefect 3.8.8 configures logging on a worker lazily, in the first task's context
hydration, with no lock: one thread in ``logging.config.dictConfig`` (holding logging's
module lock) flushes Prefect's API log handler and waits for Prefect's service-instance
lock, while another thread holds that lock creating the process's first ``EventsWorker``
and waits for logging's lock. ``gpu_tasks.worker.engine.prepare_process`` (called first by
every task a worker runs) sets logging up once while the other task threads wait.

Each case is a fresh interpreter whose threads meet at a barrier and then do what a first
task does there, in both orders; without ``prepare_process`` about half of such
interpreters hang (8 threads, measured on 2 cores), so five in a row pass by chance about
one time in thirty.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

THREADS = 8
INTERPRETERS = 5

SCRIPT = textwrap.dedent(
    f"""
    import os, threading, time
    import prefect.task_engine  # what a worker has imported before its first task
    from prefect.events.worker import EventsWorker
    from prefect.logging.configuration import ensure_logging_setup
    from gpu_tasks.worker.engine import prepare_process

    barrier = threading.Barrier({THREADS})

    def first_task(i):
        barrier.wait()
        prepare_process()  # what run_on_worker does first
        steps = [ensure_logging_setup, EventsWorker.instance]
        for step in steps if i % 2 else steps[::-1]:  # hydrated_context, then the first event
            step()

    threads = [threading.Thread(target=first_task, args=(i,), daemon=True) for i in range({THREADS})]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    for t in threads:
        t.join(max(0.01, deadline - time.monotonic()))
    print("hung" if any(t.is_alive() for t in threads) else "ok", flush=True)
    os._exit(0)
    """
)


@pytest.mark.timeout(400)
def test_tasks_starting_together_in_a_fresh_worker_process_never_hang_it():
    env = {
        **os.environ,
        "PREFECT_API_URL": "http://127.0.0.1:9/api",  # nothing listens: no server is needed here
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    for _ in range(INTERPRETERS):
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.stdout.strip() == "ok", (done.stdout, done.stderr[-2000:])
