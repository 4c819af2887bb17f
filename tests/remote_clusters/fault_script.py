"""``python fault_script.py ADDRESS N SECONDS DIR``: N tasks of ``gpus=1`` on an address profile,
each sleeping SECONDS, for the fault tests. The flow process writes its pid to ``DIR/flow.pid`` and
its task run ids to ``DIR/ids.json``;
each task attempt writes ``DIR/start-<i>-<host>-<time>`` when it starts and ``DIR/done-...`` when
it completes (files both the test and every host see); the results, and each task run's state,
run count and state history as the API has them, go to ``DIR/out.json``."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main(address: str, n: int, seconds: float, out: str) -> None:
    from netns import recorded, summary  # this script's folder
    from prefect import flow, task
    from prefect.client.orchestration import get_client

    from gpu_tasks import ProfileTaskRunner, ResourceProfile, current_allocation

    where = Path(out)
    (where / "flow.pid").write_text(str(os.getpid()))
    net = ResourceProfile(name="net", gpus=1, address=address)

    @task(tags=["profile:net"])
    def hold(i: int) -> dict:
        start = time.time()
        host = current_allocation().host
        (where / f"start-{i}-{host}-{start:.3f}").write_text("")
        while time.time() - start < seconds:  # Python between short sleeps: an interrupt lands at once
            time.sleep(0.1)
        end = time.time()
        (where / f"done-{i}-{host}-{end:.3f}").write_text("")
        return {"i": i, "host": host, "start": start, "end": end}

    @flow(task_runner=ProfileTaskRunner(profiles=[net]))
    def faulty() -> dict:
        from prefect.runtime import flow_run

        began = time.time()
        futures = [hold.submit(i) for i in range(n)]
        (where / "ids.json").write_text(json.dumps([str(f.task_run_id) for f in futures]))
        return {
            "flow_run_id": str(flow_run.id),
            "began": began,
            "ids": [str(f.task_run_id) for f in futures],
            "results": [f.result() for f in futures],
        }

    start = time.time()
    result = faulty()
    result["seconds"] = time.time() - start
    with get_client(sync_client=True) as client:
        # the server records the task runs from their events, a moment after the results came back
        deadline = time.monotonic() + 30
        while True:
            runs = [recorded(client, i) for i in result["ids"]]
            if (
                all(r and r.state_type and r.state_type.value == "COMPLETED" for r in runs)
                or time.monotonic() > deadline
            ):
                break
            time.sleep(0.25)
        result["runs"] = [summary(client, r) for r in runs]
    (where / "out.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4])
