"""A flow run of N tasks on an address profile: ``python priority_script.py ADDRESS N SECONDS OUT STARTS``.

Each task leaves a file in ``STARTS`` when its body starts; the run's priority is
``GPU_TASKS_PRIORITY`` from the environment.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(address: str, n: int, seconds: float, out: str, starts: str) -> None:
    from prefect import flow, task

    from gpu_tasks import ProfileTaskRunner, ResourceProfile

    shared = ResourceProfile(name="shared", gpus=1, address=address, idle_timeout=5)
    name = Path(out).stem

    @task(tags=["profile:shared"])
    def hold(i: int) -> dict:
        start = time.time()
        (Path(starts) / f"{name}-{i}").write_text(str(start))
        time.sleep(seconds)
        return {"i": i, "start": start, "end": time.time()}

    @flow(task_runner=ProfileTaskRunner(profiles=[shared]))
    def prioritized() -> list[dict]:
        return [f.result() for f in [hold.submit(i) for i in range(n)]]

    Path(out).write_text(json.dumps(prioritized()))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5])
