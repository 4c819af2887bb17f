"""A user's flow script on an address profile: ``python flow_script.py ADDRESS GPUS N SECONDS OUT``.

Each task records, from inside, which devices it was given and when it held them.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(address: str, gpus: float, n: int, seconds: float, out: str) -> None:
    from prefect import flow, task

    from gpu_tasks import ProfileTaskRunner, ResourceProfile, current_allocation

    shared = ResourceProfile(name="shared", gpus=gpus, address=address, idle_timeout=5)

    @task(tags=["profile:shared"])
    def hold(i: int) -> dict:
        start = time.time()
        alloc = current_allocation()
        time.sleep(seconds)
        return {
            "i": i,
            "devices": list(alloc.device_keys),
            "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "host": alloc.host,
            "emulated": alloc.emulated,
            "names": list(alloc.device_names),
            "fraction": alloc.fraction,
            "start": start,
            "end": time.time(),
        }

    @flow(task_runner=ProfileTaskRunner(profiles=[shared]))
    def shared_run() -> dict:
        from prefect.runtime import flow_run

        return {
            "flow_run_id": str(flow_run.id),
            "tasks": [f.result() for f in [hold.submit(i) for i in range(n)]],
        }

    result = shared_run()
    with open(out, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5])
