"""bench/many_flows.py: many flow-run processes against one server and one lease directory."""

from __future__ import annotations

import pytest

from bench.many_flows import PER_DEVICE, most_at_once, packing, queue_order, results_ok


def _flow(index: int, results: list[dict], holds: list[dict]) -> dict:
    return {"index": index, "results": results, "holds": holds}


def _task(flow: int, x: int, device: str, start: float, end: float) -> dict:
    return {"flow": flow, "x": x, "devices": [device], "fraction": 0.25, "start": start, "end": end}


def test_most_at_once_counts_overlaps_not_touches():
    assert most_at_once([]) == 0
    assert most_at_once([(0, 1), (1, 2)]) == 1  # one ends as the next starts
    assert most_at_once([(0, 3), (1, 2), (1.5, 4), (3, 5)]) == 3


def test_packing_counts_tasks_and_flow_runs_per_device_over_all_flows():
    a = _flow(0, [_task(0, i, "0", 0, 2) for i in range(4)] + [_task(0, 4, "1", 0, 1)], [])
    b = _flow(1, [_task(1, i, "0", 1, 3) for i in range(2)], [])
    pack = packing([a, b])
    assert pack["tasks_at_once"] == {"0": 6, "1": 1} and pack["tasks"] == {"0": 6, "1": 1}
    assert pack["flow_runs_at_once"] == {"0": 2, "1": 1}  # two flow runs' tasks on device 0 at once
    assert pack["tasks_at_once"]["0"] > PER_DEVICE
    c = _flow(1, [_task(1, 0, "0", 2, 3)], [{"device": "0", "start": 2, "end": 3}])
    a["holds"] = [{"device": "0", "start": 0, "end": 2}]
    assert packing([a, c])["flow_runs_at_once"]["0"] == 1 and packing([a, c])["holders_at_once"]["0"] == 1


def test_results_ok_names_missing_and_wrong_results():
    fl = _flow(3, [_task(3, 0, "0", 0, 1), _task(2, 1, "0", 0, 1)], [])
    assert results_ok(fl, 2) == ["result 1: 2/1"]
    assert results_ok(fl, 3)[0] == "2 results, not 3"


def test_queue_order_counts_flow_runs_served_out_of_arrival_order():
    def held(i: int, start: float, waited: float) -> dict:
        return _flow(i, [], [{"device": "0", "start": start, "end": start + 1, "wait_devices_s": waited}])

    fair = queue_order([held(2, 16, 3), held(0, 10, 0), held(1, 15, 4)])  # arrived 13, 10, 11
    assert fair["arrival_order"] == [0, 1, 2] and fair["service_order"] == [0, 1, 2]
    assert fair["out_of_order"] == []
    late = queue_order([held(0, 20, 18), held(1, 12, 8)])  # 0 arrived at 2, 1 at 4, 1 served first
    assert late["out_of_order"] == [(0, 1)]
    close = queue_order([held(0, 20, 18.5), held(1, 12, 10)])  # arrived 0.5 s apart: either may go first
    assert close["out_of_order"] == []


@pytest.mark.slow
def test_many_flow_runs_share_two_devices(prefect_server, emulated, no_leaked_processes, tmp_path):
    """Three flow-run processes of 12 ``gpus=0.25`` tasks each, at once, on one server and one lease
    directory: every result back, no device over-packed or held by two flow runs at once, every task
    run recorded Completed on the server, and the finish times reported."""
    from bench.many_flows import run

    res = run(flows=3, tasks=12, sleep=0.05, timeout=240)
    checks = res["checks"]
    assert checks["all_flow_runs_finished"] and not res["failed_flow_runs"], res["failed_flow_runs"]
    assert checks["all_results"], [r["wrong_results"] for r in res["rows"]]
    assert checks["no_device_over_packed"], res["packing"]
    assert max(res["packing"]["tasks_at_once"].values()) <= PER_DEVICE
    assert checks["all_task_runs_recorded"], [
        (r["task_runs_recorded"], r["task_runs_completed"]) for r in res["rows"]
    ]
    assert sum(res["packing"]["tasks"].values()) == 3 * 12
    assert {r["server_state"] for r in res["rows"]} == {"COMPLETED"}
    assert res["machine"]["emulated"] and len(res["machine"]["devices"]) == 2
    assert res["finish_spread_s"] is not None and res["finish_spread_s"] >= 0
    assert all(r["flow_s"] > 0 and r["devices"] for r in res["rows"])
    from bench import report

    text = report.write({"many_flows": res}, tmp_path).read_text()
    assert "## Many flow runs" in text and "**missed**" not in text and "EMULATED" in text
    assert (tmp_path / "results" / "many_flows.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
