"""The one Prefect concurrency lease holder (gpu_tasks.prefect_api.concurrency_leases) that tag slots
and team quotas both use: a full limit's answer, renewal while held (a failed renewal is logged and
tried again), give-back on close, against the test server."""

from __future__ import annotations

import logging
import threading
import time
import uuid

import pytest
from prefect.client.orchestration import PrefectClient
from prefect_api import api

from gpu_tasks.prefect_api.concurrency_leases import LeaseHolder
from gpu_tasks.prefect_api.quotas import QuotaSlots
from gpu_tasks.prefect_api.tag_slots import LEASE_S, RENEW_EVERY_S, SlotGate

pytestmark = pytest.mark.usefixtures("prefect_server")


def test_tag_slots_and_quotas_hold_their_leases_through_one_holder():
    gate = SlotGate()
    assert isinstance(gate._leases, LeaseHolder)
    assert (gate._leases.lease_s, gate._leases.renew_every_s) == (LEASE_S, RENEW_EVERY_S) == (60.0, 20.0)
    quotas = QuotaSlots(10.0)
    assert isinstance(quotas.leases, LeaseHolder)
    assert (quotas.leases.lease_s, quotas.leases.renew_every_s) == (60.0, 20.0), "Prefect's minimum, a third"
    assert QuotaSlots(300.0).leases.renew_every_s == 100.0
    gate.close()
    quotas.close()  # nothing taken: no thread was started, nothing to give back


def _active(name: str) -> int:
    code, body = api("GET", f"/v2/concurrency_limits/{name}")
    assert code == 200, body
    return int(body["active_slots"])


def test_a_lease_is_renewed_while_held_a_failed_renewal_logged_and_close_gives_it_back(monkeypatch, caplog):
    name = f"lease-test-{uuid.uuid4().hex[:8]}"
    code, body = api("POST", "/v2/concurrency_limits/", json={"name": name, "limit": 1})
    assert code == 201, body
    renewed: list[uuid.UUID] = []
    fail = threading.Event()
    renew = PrefectClient.renew_concurrency_lease

    async def counted(self, lease_id, lease_duration):
        renewed.append(lease_id)
        if fail.is_set():
            raise ConnectionError("the server is away")
        return await renew(self, lease_id, lease_duration)

    monkeypatch.setattr(PrefectClient, "renew_concurrency_lease", counted)
    holder = LeaseHolder(
        "gpu-tasks-test-leases", 60.0, renew_every_s=0.2, log=logging.getLogger("gpu_tasks.test")
    )
    try:
        first = holder.take([name], 1, "a test's slot", ("flow_run", uuid.uuid4()))
        assert first.granted and first.limits == (name,) and first.lease_id is not None
        assert _active(name) == 1
        second = holder.take([name], 1, "a test's second slot")
        assert not second.granted and second.retry_after > 0, "the limit is full"
        assert any(t.name == "gpu-tasks-test-leases" for t in threading.enumerate())
        deadline = time.monotonic() + 10
        while len(renewed) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert renewed[:2] == [first.lease_id] * 2
        with caplog.at_level(logging.WARNING, logger="gpu_tasks.test"):
            fail.set()
            n = len(renewed)
            while len(renewed) < n + 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(renewed) >= n + 2, "a failed renewal is tried again next period"
        assert f"renewing the Prefect lease on a test's slot ({name}) failed" in caplog.text
        fail.clear()
    finally:
        holder.close(timeout=5)
    assert _active(name) == 0, "close gave the slot back"
    assert not any(t.name == "gpu-tasks-test-leases" for t in threading.enumerate())
    with pytest.raises(RuntimeError, match="closed"):
        holder.take([name], 1, "after close")
    api("DELETE", f"/v2/concurrency_limits/{name}")
