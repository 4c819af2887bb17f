"""``python cut_script.py ADDRESS MARKER OUT SLEEP``: one task with a retry on an address profile.
Its first attempt writes its host's name to MARKER and sleeps SLEEP s (its link is cut
meanwhile); a later attempt returns at once. Every attempt that completes writes
``MARKER.done-<host>-<time>`` (the side effect the tests count). Its outcome, states and the
flow run's task runs still running go to OUT."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(address: str, marker: str, out: str, sleep: float) -> None:
    from netns import recorded, summary  # this script's folder
    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from gpu_tasks import ProfileTaskRunner, ResourceProfile, current_allocation

    net = ResourceProfile(name="net", gpus=1, address=address)

    @task(tags=["profile:net"], retries=1)
    def cut_off() -> dict:
        host = current_allocation().host
        first = Path(marker + ".first")
        if not first.exists():
            first.write_text("")
            Path(marker).write_text(host)
            time.sleep(sleep)
        end = time.time()
        Path(f"{marker}.done-{host}-{end:.3f}").write_text("")
        return {"host": host, "end": end}

    @flow(task_runner=ProfileTaskRunner(profiles=[net]))
    def cut() -> dict:
        from prefect.runtime import flow_run

        future = cut_off.submit()
        ids = {"flow_run_id": str(flow_run.id), "task_run_id": str(future.task_run_id)}
        return {**ids, "result": future.result()}

    result = cut()
    with get_client(sync_client=True) as client:
        # the server records the task run from its events, a moment after the result came back
        deadline = time.monotonic() + 30
        while True:
            run = recorded(client, result["task_run_id"])
            done = (
                run is not None
                and run.state_type is not None
                and run.state_type.value == "COMPLETED"
                and run.run_count >= 2
            )
            if done or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        result.update(summary(client, run))
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[result["flow_run_id"]]))
        )
        result["running"] = [str(r.id) for r in runs if r.state_type and r.state_type.value == "RUNNING"]
    with open(out, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]))
