"""A flow run of N tasks on an address profile (priority, quota and preemption tests).

``python priority_script.py ADDRESS N SECONDS OUT STARTS [OPTIONS]``.

Each task leaves a file in ``STARTS`` when its body starts; the run's priority is
``GPU_TASKS_PRIORITY`` from the environment. ``OPTIONS`` is JSON of more profile fields
(``quota``, ``preemptible``), ``per_second``: submit that many tasks a second, and ``go``: a
file the flow waits for before it submits (a run started early arrives when the test says,
its start-up done; it leaves ``STARTS/<name>-ready`` once it waits), ``warm``: run one empty task
on the profile before that (its client connected to the scheduler, so the first real submit is
not on the connect's clock; ``idle_timeout`` keeps it connected), and ``release``: a file
each task waits for, after its SECONDS, before it ends (the test says when the workers become
free; at most RELEASE_MAX_S). A task sleeps in short steps, so a preemption interrupts it within
one.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

RELEASE_MAX_S = 300.0  # a task waits at most this long for its release file


def main(address: str, n: int, seconds: float, out: str, starts: str, options: str = "{}") -> None:
    from prefect import flow, task
    from prefect.context import get_run_context

    from gpu_tasks import ProfileTaskRunner, ResourceProfile

    fields = json.loads(options)
    per_second = int(fields.pop("per_second", 0))  # a stream: this many submits a second, not all at once
    go = fields.pop("go", None)
    release = fields.pop("release", None)
    warm = bool(fields.pop("warm", False))
    fields.setdefault("idle_timeout", 5)
    shared = ResourceProfile(name="shared", gpus=1, address=address, **fields)
    name = Path(out).stem

    @task(tags=["profile:shared"])
    def hold(i: int) -> dict:
        start = time.time()
        (Path(starts) / f"{name}-{i}-{start}.start").write_text(str(start))
        while time.time() - start < seconds or (
            release and not Path(release).exists() and time.time() - start < RELEASE_MAX_S
        ):
            time.sleep(0.05)
        run = get_run_context().task_run
        return {
            "i": i,
            "start": start,
            "end": time.time(),
            "task_run": str(run.id),
            "flow_run": str(run.flow_run_id),
        }

    @task(tags=["profile:shared"])
    def connect() -> int:
        return 0

    @flow(task_runner=ProfileTaskRunner(profiles=[shared]))
    def prioritized() -> list[dict]:
        if warm:
            connect.submit().result()
        if go:  # in its flow run, its start-up done
            (Path(starts) / f"{name}-ready").write_text(str(time.time()))
        while go and not Path(go).exists():
            time.sleep(0.02)
        (Path(starts) / f"{name}-submitted").write_text(str(time.time()))
        if not per_second:
            return [f.result() for f in [hold.submit(i) for i in range(n)]]
        futures = []
        for i in range(n):
            futures.append(hold.submit(i))
            if (i + 1) % per_second == 0:
                time.sleep(1.0)
        return [f.result() for f in futures]

    Path(out).write_text(json.dumps(prioritized()))


if __name__ == "__main__":
    main(*sys.argv[1:2], int(sys.argv[2]), float(sys.argv[3]), *sys.argv[4:])
