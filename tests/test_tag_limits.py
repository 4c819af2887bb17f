"""Edge cases of gpu-tasks' longer "no tag limits" answers (docs/runner.md, "Tagged task runs and
Prefect's tag-limit checks"), against the test server with real tag concurrency limits.

gpu-tasks keeps the "no limits" answers its own task runs learn in a cache of its own
(``GPU_TASKS_TUNE_TAG_LIMIT_CACHE_SECONDS``) and leaves Prefect's per-process cache as shipped;
these flows use a CPU profile (threads in the flow process), so the caches they fill are
this process's. gpu-tasks never reads Prefect's cache (private to Prefect,
``prefect.concurrency.services``); the tests put a fresh one in place with monkeypatch to show it
is left as shipped.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
import uuid

import cachetools
import pytest
from prefect import flow, task, unmapped
from prefect.concurrency import services
from prefect_api import api
from test_runner import gather

from gpu_tasks import ProfileTaskRunner, ResourceProfile

pytestmark = pytest.mark.usefixtures("no_leaked_processes", "emulated")

CPU = ResourceProfile(name="cpu", cpus=0.5)  # four threads on two cores


@task
def noop() -> None:
    return None


def _shipped_cache(monkeypatch, ttl: float = 5.0, frozen: bool = False) -> cachetools.TTLCache:
    """A cache as Prefect ships it; ``frozen``: its entries never expire (a clock that stands still)."""
    cache = cachetools.TTLCache(maxsize=1000, ttl=ttl, **({"timer": lambda: 0.0} if frozen else {}))
    monkeypatch.setattr(services, "_no_limits_cache", cache)
    return cache


def _cached(tag: str) -> bool:
    """Whether gpu-tasks' own cache holds a "no limits" answer for a tag set with ``tag``."""
    from gpu_tasks.compat.prefect import _OWN_NO_LIMITS

    return any(v and any(tag in name for name in key) for key, v in list(_OWN_NO_LIMITS["cache"].items()))


def _cached_by_prefect(tag: str) -> bool:
    return any(any(tag in name for name in key) for key in list(services._no_limits_cache.keys()))


def _run(*task_tags: str) -> None:
    @flow(task_runner=ProfileTaskRunner(profiles=[CPU]))
    def f():
        noop.with_options(tags=list(task_tags)).submit().result()

    f()


def test_zero_keeps_prefects_own_cache(monkeypatch):
    shipped = _shipped_cache(monkeypatch)
    monkeypatch.setenv("GPU_TASKS_TUNE_TAG_LIMIT_CACHE_SECONDS", "0")
    _run(f"t-{uuid.uuid4().hex[:8]}")
    assert services._no_limits_cache is shipped and shipped.ttl == 5.0


def test_the_cache_is_never_shortened(monkeypatch):
    longer = _shipped_cache(monkeypatch, ttl=90.0)
    monkeypatch.setenv("GPU_TASKS_TUNE_TAG_LIMIT_CACHE_SECONDS", "45")
    _run(f"t-{uuid.uuid4().hex[:8]}")
    assert services._no_limits_cache is longer and longer.ttl == 90.0


def test_prefects_cache_stays_as_shipped_and_gpu_tasks_keeps_its_own_answers(monkeypatch):
    shipped = _shipped_cache(monkeypatch, frozen=True)
    monkeypatch.setenv("GPU_TASKS_TUNE_TAG_LIMIT_CACHE_SECONDS", "60")
    tag = f"own-{uuid.uuid4().hex[:8]}"
    _run(tag)  # Prefect's engine learns "no limits" for this tag set from the server
    assert services._no_limits_cache is shipped and shipped.ttl == 5.0  # untouched
    assert _cached_by_prefect(tag)  # Prefect's own answer, kept its 5 s
    assert _cached(tag)  # and gpu-tasks' copy, kept 60 s for its own task runs


def test_only_no_limits_answers_are_cached(monkeypatch):
    _shipped_cache(monkeypatch)
    monkeypatch.setenv("GPU_TASKS_TUNE_TAG_LIMIT_CACHE_SECONDS", "60")
    limited, free = f"limited-{uuid.uuid4().hex[:8]}", f"free-{uuid.uuid4().hex[:8]}"
    code, body = api("POST", "/v2/concurrency_limits/", json={"name": f"tag:{limited}", "limit": 5})
    assert code == 201, body
    try:
        _run(limited)
        _run(free)
    finally:
        api("DELETE", f"/v2/concurrency_limits/tag:{limited}")
    assert _cached(free) and not _cached(limited)


def test_a_limit_created_after_the_first_check_waits_for_the_cache(monkeypatch, tmp_path):
    """Documented: a limit created mid-run applies within the cache time (60 s), not at once."""
    _shipped_cache(monkeypatch)
    monkeypatch.setenv("GPU_TASKS_TUNE_TAG_LIMIT_CACHE_SECONDS", "60")
    tag = f"late-limit-{uuid.uuid4().hex[:8]}"

    @flow(task_runner=ProfileTaskRunner(profiles=[CPU]))
    def f():
        noop.with_options(tags=[tag]).submit().result()  # "no limits" for this tag set, cached
        code, body = api("POST", "/v2/concurrency_limits/", json={"name": f"tag:{tag}", "limit": 1})
        assert code == 201, body
        # two tasks that only finish together: under a limit of 1 they could never meet
        met = gather.with_options(tags=[tag])
        return [
            x.result() for x in met.map(unmapped(str(tmp_path)), range(2), unmapped(2), limit=unmapped(20))
        ]

    try:
        rows = f()
    finally:
        api("DELETE", f"/v2/concurrency_limits/tag:{tag}")
    assert all(r["met"] for r in rows), "the cached answer let both run at once"


def test_a_prefect_with_another_cache_is_left_as_it_is(monkeypatch):
    """Another Prefect release (no TTLCache there): gpu-tasks neither reads nor replaces Prefect's
    cache, and tasks still run."""
    other = {}
    monkeypatch.setattr(services, "_no_limits_cache", other)
    monkeypatch.setenv("GPU_TASKS_TUNE_TAG_LIMIT_CACHE_SECONDS", "60")
    _run(f"t-{uuid.uuid4().hex[:8]}")
    assert services._no_limits_cache is other


def test_tasks_queued_at_the_slot_gate_ask_the_server_once_when_no_limit_exists(monkeypatch):
    """When the cached "no limits" answer has expired, a map's GPU tasks all queue at the flow's
    slot gate, whose requests go out one at a time: the first answer lets the others through
    without a request each (700 requests in a row took a 1,000-task map from 7 to 28 s)."""
    import concurrent.futures
    import contextvars

    from prefect.client.orchestration import PrefectClient

    from gpu_tasks.compat.prefect import use_no_limits_cache
    from gpu_tasks.prefect_api.tag_answers import limited_names
    from gpu_tasks.prefect_api.tag_slots import SlotGate, slot_names

    _shipped_cache(monkeypatch)
    # gpu-tasks' own answers, set up as a flow process's runner does: the test passed only where an
    # earlier flow of the same test process had (alone, or first on its xdist worker, it failed)
    use_no_limits_cache(60, limited_names)
    asked: list[list[str]] = []
    increment = PrefectClient.increment_concurrency_slots_with_lease

    async def counted(self, *args, **kwargs):  # the real request, counted
        asked.append(list(kwargs.get("names") or args[0]))
        return await increment(self, *args, **kwargs)

    monkeypatch.setattr(PrefectClient, "increment_concurrency_slots_with_lease", counted)
    names = slot_names({f"no-limit-{uuid.uuid4().hex[:8]}", "gpu-tasks-test"})
    gate = SlotGate()
    ready: dict[uuid.UUID, concurrent.futures.Future] = {}
    try:
        for _ in range(40):
            done: concurrent.futures.Future = concurrent.futures.Future()
            holder = uuid.uuid4()
            ready[holder] = done
            gate.take(names, holder, contextvars.copy_context(), done.set_result, done.set_exception)
        holds = [f.result(timeout=60) for f in ready.values()]
    finally:
        gate.close()
    assert all(h.state in ("held", "released") and h.limits == [] for h in holds)
    assert asked == [names]  # one request for all 40


def test_a_long_wait_at_the_slot_gate_is_logged_while_it_lasts(monkeypatch, caplog):
    """A task run waiting for a full tag limit is logged while it waits (every 20 s after 30 s;
    shortened here), then gets the slot once the holder gives it back."""
    import concurrent.futures
    import contextvars
    import logging

    from gpu_tasks.prefect_api import tag_slots as _slotgate
    from gpu_tasks.prefect_api.tag_slots import SlotGate, slot_names

    monkeypatch.setattr(_slotgate, "RENEW_EVERY_S", 0.3)
    monkeypatch.setattr(_slotgate, "WAIT_LOGGED_S", 0.5)
    tag = f"serial-{uuid.uuid4().hex[:8]}"
    code, body = api("POST", "/v2/concurrency_limits/", json={"name": f"tag:{tag}", "limit": 1})
    assert code == 201, body
    gate = SlotGate()
    firsts: list[concurrent.futures.Future] = [concurrent.futures.Future() for _ in range(2)]
    try:
        with caplog.at_level(logging.INFO, logger="gpu_tasks.runner"):
            for done in firsts:
                gate.take(
                    slot_names({tag}),
                    uuid.uuid4(),
                    contextvars.copy_context(),
                    done.set_result,
                    done.set_exception,
                )
            holder = firsts[0].result(timeout=30)
            assert holder.limits == [f"tag:{tag}"]
            # the second alone waits now (on a loaded machine the first's own take can outlast
            # WAIT_LOGGED_S: the lines before say "2 task run(s)", which is true then)
            want = f"1 task run(s) waiting for Prefect tag concurrency slots (tag:{tag})"
            deadline = time.monotonic() + 10
            while want not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not firsts[1].done()
            gate.release(holder)
            second = firsts[1].result(timeout=30)
        assert second.limits == [f"tag:{tag}"] and second.waited >= 0.5
        line = next(r.getMessage() for r in caplog.records if want in r.getMessage())
        assert "they hold no device meanwhile" in line, line
    finally:
        gate.close()
        api("DELETE", f"/v2/concurrency_limits/tag:{tag}")


def test_remembered_answers_are_renewed_and_a_limit_created_since_drops_its_answer(monkeypatch):
    """Every third of the time-to-live the process asks the server again (GET, no slot taken): a tag set
    still without a limit keeps its answer, one whose limit was created since loses it, so its
    next task run asks Prefect's check and takes the slot. A long map's task runs then never all
    miss at once when an answer expires."""
    from gpu_tasks.compat.prefect import known_without_limits, remember_without_limits, use_no_limits_cache
    from gpu_tasks.prefect_api.tag_answers import refresh_no_limits

    use_no_limits_cache(60)
    free, limited = f"tag:free-{uuid.uuid4().hex[:8]}", f"tag:limited-{uuid.uuid4().hex[:8]}"
    remember_without_limits([free])
    remember_without_limits([limited, free])
    code, body = api("POST", "/v2/concurrency_limits/", json={"name": limited, "limit": 1})
    assert code == 201, body
    try:
        renewed, dropped = refresh_no_limits()
    finally:
        api("DELETE", f"/v2/concurrency_limits/{limited}")
    assert dropped >= 1 and renewed >= 1
    assert known_without_limits([free])
    assert not known_without_limits([limited, free])


def test_an_answer_that_expired_during_its_renewal_read_comes_back():
    """A renewal read that takes longer than an answer has left (a busy server, a loaded host) still
    renews it: the read just said the tag set has no limit. An answer a task run turned to "ask
    Prefect" meanwhile (a limit found, or no answer) stays so, and a dropped one goes."""
    from gpu_tasks.compat import prefect as compat

    compat.use_no_limits_cache(60)
    cache = compat._OWN_NO_LIMITS["cache"]
    expired, asked, gone = (frozenset([f"tag:{w}-{uuid.uuid4().hex[:6]}"]) for w in ("old", "asked", "gone"))
    cache.update({asked: False, gone: True})  # `expired` was read, then its time ran out: not in the cache
    assert compat.renew_answers([expired, asked], [gone]) == 1
    assert compat.known_without_limits(sorted(expired))
    assert cache.get(asked) is False and gone not in cache


def test_a_worker_learns_a_tag_set_after_prefects_check_by_reading_the_limits(monkeypatch):
    """Where the flow process did not learn a tag set (a worker's own tags), gpu-tasks' wrapper of
    the engine's slot check reads the limits by name after Prefect's check (public API; Prefect's
    cache is not read): a tag set without limits is skipped from then on, one with a limit keeps
    Prefect's check and is not read again before its answer expires."""
    import prefect.task_engine as engine
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder

    from gpu_tasks.compat.prefect import _OWN_NO_LIMITS, known_without_limits, ours, use_no_limits_cache
    from gpu_tasks.prefect_api import tag_answers

    read: list[list[str]] = []

    def counted(names):  # the real reads, counted
        read.append(sorted(names))
        return tag_answers.limited_names(names)

    free, limited = f"tag:w-free-{uuid.uuid4().hex[:8]}", f"tag:w-limited-{uuid.uuid4().hex[:8]}"
    # Prefect's own cache, made to say the limited set has none: gpu-tasks does not read it
    _shipped_cache(monkeypatch, frozen=True)[frozenset([limited])] = True
    use_no_limits_cache(60, tag_answers.limited_names)  # as a worker process has it
    monkeypatch.setitem(_OWN_NO_LIMITS, "ask", counted)  # its reads counted, for this test only
    code, body = api("POST", "/v2/concurrency_limits/", json={"name": limited, "limit": 5})
    assert code == 201, body
    try:
        for _ in range(3):
            for names in ([free], [limited]):
                holder = ConcurrencyLeaseHolder(type="task_run", id=uuid.uuid4())
                with ours(), engine._concurrency(names=names, holder=holder):
                    pass
    finally:
        api("DELETE", f"/v2/concurrency_limits/{limited}")
    assert known_without_limits([free]) and not known_without_limits([limited])
    assert read == [[free], [limited]]  # once each: the answers are kept, both of them


RENEWED = textwrap.dedent(
    """
    import json, threading, time
    from prefect import flow, task
    from gpu_tasks import ProfileTaskRunner, ResourceProfile, profile

    @task
    def first():
        return 1

    @task
    def later():  # in the worker process: its answers, kept past their time-to-live or not
        from gpu_tasks.compat.prefect import _OWN_NO_LIMITS, remembered_tag_sets

        ttl, learned = remembered_tag_sets()
        time.sleep(3 * ttl)  # each answer expires within this unless it is renewed
        cache = _OWN_NO_LIMITS["cache"]
        deadline = time.monotonic() + 2 * ttl  # a renewal read under way when it expired brings it back
        while time.monotonic() < deadline and not all(k in cache for k in learned):
            time.sleep(0.1)  # nothing else asks in this process meanwhile: only a renewal can
        return {
            "ttl": ttl,
            "learned": [sorted(k) for k in learned],
            "kept": [sorted(k) for k in learned if k in cache],
            "threads": [t.name for t in threading.enumerate()],
        }

    GPU = ResourceProfile(name="gpu", gpus=1)

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="cpu", cpus=0.5), GPU], default="cpu"))
    def renewed():
        for name in ("gpu", "cpu"):
            first.with_options(tags=[profile(name)]).submit().result()
        waits = {name: later.with_options(tags=[profile(name)]).submit() for name in ("gpu", "cpu")}
        return {name: f.result() for name, f in waits.items()}

    print("RESULT", json.dumps(renewed()))
    """
)


def test_answers_are_renewed_on_prefects_ephemeral_api(tmp_path):
    """A plain script on Prefect's default ephemeral API (no server started), as a user runs it: a
    GPU profile's worker process and the flow process (a CPU profile's threads) renew the "no tag
    limits" answers their task runs learned, so they do not all expire at once mid-map. Neither
    process's own settings name a server there. A worker's renewing thread was started from them and
    never ran: every answer expired after GPU_TASKS_TUNE_TAG_LIMIT_CACHE_SECONDS and the next task
    runs queued at Prefect's slot check (a 1,000-task map took 17-36 ms a task instead of 5). The
    flow process renewed nothing there: it now asks the ephemeral server it runs."""
    from faults._procs import clean_env, kill_marked, wait_gone

    marker = uuid.uuid4().hex
    (tmp_path / "renewed.py").write_text(RENEWED)
    env = clean_env(
        marker,
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        GPU_TASKS_EMULATED_GPUS="1",
        # renewed every second; an answer that expires during a slow read comes back after it (a
        # renewal every 1.5 s lost one once, with four test processes beside the compat stage)
        GPU_TASKS_TUNE_TAG_LIMIT_CACHE_SECONDS="3",
    )
    try:
        proc = subprocess.run(
            [sys.executable, "renewed.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        _, left = wait_gone(marker, timeout=10)
        assert not left, f"processes outlived the script: {left}"
    finally:
        kill_marked(marker)
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    for name, out in json.loads(line.removeprefix("RESULT ")).items():  # the worker's, the flow process's
        assert out["ttl"] == 3.0, name
        assert any(any(name in tag for tag in key) for key in out["learned"]), (name, out)
        assert out["kept"] == out["learned"], (name, out)
        assert "gpu-tasks-tag-limits" in out["threads"], (name, out["threads"])
