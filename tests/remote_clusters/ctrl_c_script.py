"""A user's flow script on an address profile, interrupted with Ctrl-C:
``python ctrl_c_script.py ADDRESS MARKERS READY``. Three 12 s tasks on two GPUs: one queues.
A task that ends writes ``end-<i>``."""

from __future__ import annotations

import sys
import time
from pathlib import Path


def main(address: str, markers: str, ready: str) -> None:
    from prefect import flow, task
    from prefect.runtime import flow_run

    from gpu_tasks import ProfileTaskRunner, ResourceProfile

    shared = ResourceProfile(name="shared", gpus=1, address=address)

    @task(tags=["profile:shared"])
    def long_gpu_task(i: int) -> int:
        start = time.time()
        Path(markers, str(i)).write_text(str(start))
        while time.time() - start < 12:  # Python between short sleeps: an interrupt lands at once
            time.sleep(0.1)
        Path(markers, f"end-{i}").write_text(str(time.time()))
        return i

    @flow(task_runner=ProfileTaskRunner(profiles=[shared]))
    def interrupted() -> list[int]:
        Path(ready).write_text(str(flow_run.id))
        futures = [long_gpu_task.submit(i) for i in range(3)]
        return [f.result() for f in futures]

    interrupted()


if __name__ == "__main__":
    main(*sys.argv[1:4])
