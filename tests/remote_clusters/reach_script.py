"""``python reach_script.py ADDRESS N SECONDS OUT``: N tasks of an address profile; what each
ended with (its host and devices, or its error) and how long the flow run took, to OUT."""

from __future__ import annotations

import json
import sys
import time


def main(address: str, n: int, seconds: float, out: str) -> None:
    started = time.monotonic()
    from prefect import flow, task

    from gpu_tasks import ProfileTaskRunner, ResourceProfile, current_allocation

    net = ResourceProfile(name="net", gpus=1, address=address)

    @task(tags=["profile:net"])
    def where(i: int) -> dict:
        alloc = current_allocation()
        time.sleep(seconds)
        return {"host": alloc.host, "devices": list(alloc.device_keys)}

    @flow(task_runner=ProfileTaskRunner(profiles=[net]))
    def reach() -> dict:
        from prefect.runtime import flow_run

        flow_started = time.monotonic()
        outcomes = [f.result(raise_on_failure=False) for f in [where.submit(i) for i in range(n)]]
        return {
            "flow_run_id": str(flow_run.id),
            "tasks_s": time.monotonic() - flow_started,
            "results": [
                o if isinstance(o, dict) else {"error": f"{type(o).__name__}: {o}"} for o in outcomes
            ],
        }

    result = reach()
    result["seconds"] = time.monotonic() - started
    with open(out, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4])
