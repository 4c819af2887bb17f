"""The per-task path of a GPU profile: hand-offs to Dask in batches, inputs walked cheaply,
tag checks answered from gpu-tasks' "no limits" answers, tasks prepared once per allocation."""

from __future__ import annotations

import concurrent.futures
import uuid

import pytest
from prefect import flow, task
from prefect.client.schemas.objects import State
from prefect.futures import PrefectConcurrentFuture
from prefect.utilities.annotations import quote
from pydantic import BaseModel

from gpu_tasks import ProfileTaskRunner, ResourceProfile, current_allocation, profile
from gpu_tasks.allocation import Allocation
from gpu_tasks.cluster.backends import DaskBackend
from gpu_tasks.prefect_api.futures import futures_to_states, pending_futures

PROFILES = [
    ResourceProfile(name="cpu", cpus=0.5),
    ResourceProfile(name="quarter", gpus=0.25, idle_timeout=30),
]


def _future(done: bool) -> PrefectConcurrentFuture[int]:
    cf: concurrent.futures.Future[int] = concurrent.futures.Future()
    if done:
        cf.set_result(1)
    return PrefectConcurrentFuture(task_run_id=uuid.uuid4(), wrapped_future=cf)


class Holder(BaseModel):
    model_config = {"arbitrary_types_allowed": True}
    inner: object


def test_pending_futures_finds_them_in_plain_data_and_in_what_only_prefects_walk_knows():
    waiting, done = _future(False), _future(True)
    assert pending_futures(({"x": 1, "ys": [2.0, "a", None, (waiting,)]}, [done])) == [waiting]
    assert pending_futures(({"x": 1, "ys": [2, 3]}, [])) == []
    # a pydantic model is walked by Prefect's visit_collection, which looks inside its fields
    assert pending_futures(({"m": Holder(inner=waiting)}, [])) == [waiting]
    # an annotation (quote, allow_failure) is unwrapped by Prefect's walk, as before
    assert pending_futures(({"q": quote([waiting])}, [])) == [waiting]


def test_futures_to_states_returns_plain_data_as_it_is_and_replaces_futures():
    plain = {"x": 1, "ys": [1, 2, {"z": "a"}]}
    assert futures_to_states(plain) is plain
    done = _future(True)
    out = futures_to_states({"x": [done, 3]})
    assert out["x"][1] == 3 and isinstance(out["x"][0], State)  # the future became its state


@pytest.mark.parametrize(
    ("url", "proxy", "built"),
    [
        ("http://127.0.0.1:9/api", None, 0),
        ("https://127.0.0.1:9/api", None, 1),
        ("http://127.0.0.1:9/api", "https://127.0.0.1:8/", 1),
    ],
)
def test_a_workers_api_client_builds_a_tls_context_only_for_an_https_api(monkeypatch, url, proxy, built):
    """A worker thread's Prefect client: over plain http no TLS context is built (Prefect's client
    loads certifi's bundle into a new one, about 38 ms of CPU per worker process), and the one it
    is handed trusts nothing; over https, or through a proxy (which may speak TLS), Prefect builds
    its own, as always."""
    import ssl
    import threading

    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_CLIENT_SERVER_VERSION_CHECK_ENABLED,
        temporary_settings,
    )

    from gpu_tasks.prefect_api.api import PROXY_VARIABLES, client_tls
    from gpu_tasks.worker import engine

    for variable in PROXY_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    if proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy)
    made: list[object] = []
    real, here = ssl.create_default_context, threading.get_ident()

    def counted(*a: object, **k: object) -> ssl.SSLContext:
        # this thread's only: a Prefect client another thread of the test process builds meanwhile
        # (an earlier test's events or logs worker) is not the worker's (it made this fail once)
        if threading.get_ident() == here:
            made.append(k)
        return real(*a, **k)

    monkeypatch.setattr(ssl, "create_default_context", counted)
    key = f"test-{uuid.uuid4().hex}"
    with temporary_settings({PREFECT_API_URL: url, PREFECT_CLIENT_SERVER_VERSION_CHECK_ENABLED: False}):
        client = engine._thread_client(key)
        try:
            assert len(made) == built, made
            assert engine._thread_client(key) is client  # one per thread and settings
        finally:
            client.__exit__(None, None, None)
            engine._WORKER_THREAD.client = None
    handed = client_tls(url)
    if built:
        assert handed is None  # Prefect's own context
    else:  # the one handed over plain http trusts nothing: never a weaker TLS
        assert handed is not None and handed["verify"].verify_mode == ssl.CERT_REQUIRED
        assert not handed["verify"].get_ca_certs()


def test_a_task_is_prepared_once_per_allocation_on_a_worker():
    from gpu_tasks.worker.engine import _prepared

    @task(tags=["mine"])
    def work() -> int:
        return 1

    on0 = Allocation(profile="quarter", devices=("0",), fraction=0.25, worker="w0", emulated=True)
    on1 = Allocation(profile="quarter", devices=("1",), fraction=0.25, worker="w1", emulated=True)
    first = _prepared(work, on0)
    assert {"mine", "gpu:0", "gpu-tasks:emulated"} <= set(first.tags)
    assert _prepared(work, on0) is first  # not built again for the next task run
    other = _prepared(work, on1)
    assert other is not first and "gpu:1" in other.tags and "gpu:0" not in other.tags
    assert "gpu:0" not in work.tags  # the submitted task is left as it was


@pytest.mark.usefixtures("no_leaked_processes", "emulated")
def test_a_map_reaches_the_cluster_in_batches_and_every_task_runs_once(monkeypatch):
    sent: list[int] = []
    real = DaskBackend.submit_many

    def counted(self, fn, argss, keys, resources):
        sent.append(len(argss))
        return real(self, fn, argss, keys, resources)

    monkeypatch.setattr(DaskBackend, "submit_many", counted)

    @task(tags=[profile("quarter")])
    def where(x: int) -> tuple[int, str]:
        return x, current_allocation().worker

    @flow(task_runner=ProfileTaskRunner(profiles=PROFILES))
    def forty() -> list[tuple[int, str]]:
        return [f.result() for f in where.map(range(40))]

    out = forty()
    assert sorted(x for x, _ in out) == list(range(40))
    assert all(w != "in-process" for _, w in out)
    # the tasks queued while the cluster started leave together: fewer graphs than tasks
    assert sum(sent) == 40 and len(sent) < 40 and max(sent) > 1


@pytest.mark.usefixtures("no_leaked_processes", "emulated")
def test_a_batch_the_cluster_refuses_fails_its_tasks_with_the_reason(monkeypatch):
    def refuse(self, fn, argss, keys, resources):
        raise RuntimeError("scheduler refused the graph")

    monkeypatch.setattr(DaskBackend, "submit_many", refuse)

    @task(tags=[profile("quarter")])
    def one(x: int) -> int:
        return x

    @flow(task_runner=ProfileTaskRunner(profiles=PROFILES))
    def three() -> list:
        return [f.wait() or f.state for f in one.map(range(3))]

    states = three()
    assert len(states) == 3
    assert all(s.is_failed() and "scheduler refused the graph" in (s.message or "") for s in states)


@pytest.mark.usefixtures("prefect_server")
def test_tag_checks_the_cache_answers_do_not_reach_prefects_slot_service(monkeypatch):
    import prefect.concurrency._sync as slots

    from gpu_tasks.compat.prefect import ours, tag_slots_held_by_flow, use_no_limits_cache
    from gpu_tasks.prefect_api.tag_answers import limited_names

    asked: list[list[str]] = []
    real = slots.acquire_concurrency_slots_with_lease

    def counted(names, *args, **kwargs):
        asked.append(list(names))
        return real(names, *args, **kwargs)

    monkeypatch.setattr(slots, "acquire_concurrency_slots_with_lease", counted)
    use_no_limits_cache(60, limited_names)  # as a worker process does for its first flow run
    with tag_slots_held_by_flow(uuid.uuid4(), ()):  # installs gpu-tasks' check in the engine
        pass
    tag = f"gt-no-limit-{uuid.uuid4().hex[:8]}"

    @task(tags=[tag])
    def tagged() -> int:
        return 7

    with ours():  # as in a task run gpu-tasks runs
        assert tagged() == 7
        # first: Prefect's check asks the server, then gpu-tasks reads that the tag has no limit
        assert asked == [[f"tag:{tag}"]]
        assert tagged() == 7 and tagged() == 7
        assert asked == [[f"tag:{tag}"]]  # then gpu-tasks' answer, with no slot request made
    assert tagged() == 7  # a task run gpu-tasks does not run: Prefect's slot service, as shipped
    assert asked == [[f"tag:{tag}"]] * 2


def test_a_worker_process_resolves_each_serializer_name_once(monkeypatch):
    import prefect.serializers as serializers
    from prefect.utilities.importtools import from_qualified_name

    from gpu_tasks.compat.prefect import cache_qualified_names, ours

    resolved: list[str] = []

    def counted(name: str):
        resolved.append(name)
        return from_qualified_name(name)

    monkeypatch.setattr(serializers, "from_qualified_name", counted)  # restored after the test
    plain = serializers.JSONSerializer().dumps({"a": [1, 2]})
    assert len(resolved) == 2  # Prefect resolves its json module and encoder at every dumps
    assert cache_qualified_names() and cache_qualified_names()  # idempotent
    resolved.clear()
    with ours():  # in a task run gpu-tasks runs
        for _ in range(3):
            assert serializers.JSONSerializer().dumps({"a": [1, 2]}) == plain
        assert sorted(resolved) == sorted(set(resolved)) and len(resolved) == 2  # once each, not 3 times
        with pytest.raises(ImportError):  # a name that does not resolve fails as with Prefect's own
            serializers.JSONSerializer(jsonlib="no_such_module_here").dumps({})
    resolved.clear()
    assert serializers.JSONSerializer().dumps({"a": [1, 2]}) == plain  # any other: as Prefect ships
    assert len(resolved) == 2


@pytest.mark.usefixtures("prefect_server")
def test_an_in_process_profile_resolves_each_serializer_name_once_in_its_task_runs(monkeypatch):
    """A CPU profile runs its tasks in the flow process: there too each task run's cache key is
    computed with the names resolved once (a failed import per key waits for the interpreter lock
    otherwise); a thread pool's task runs in the same process resolve them as Prefect ships."""
    import threading

    import prefect.serializers as serializers
    from prefect.task_runners import ThreadPoolTaskRunner
    from prefect.utilities.importtools import from_qualified_name

    from gpu_tasks.worker import engine

    resolved: list[str] = []

    def counted(name: str):
        resolved.append(name)
        return from_qualified_name(name)

    monkeypatch.setattr(serializers, "from_qualified_name", counted)  # restored after the test
    monkeypatch.setattr(engine, "_NAMES_CACHED", threading.Event())  # as in a fresh flow process

    @task
    def keyed(x: int) -> int:  # Prefect's default cache policy: a cache key for every run
        return x + 1

    def mapped(runner):
        @flow(task_runner=runner)
        def run_them() -> list[int]:
            return [f.result() for f in keyed.map(range(n))]

        resolved.clear()
        assert run_them() == [i + 1 for i in range(n)]
        return len(resolved)

    n = 12
    theirs = mapped(ThreadPoolTaskRunner(max_workers=2))
    ours = mapped(ProfileTaskRunner(profiles=[ResourceProfile(name="cpu", cpus=1)]))
    assert theirs >= 2 * n  # two names resolved at every cache key (json module, encoder)
    assert ours <= theirs - 2 * n + 2, (ours, theirs)  # the tasks' keys: each name once


def test_finished_tasks_results_are_fetched_in_batches_and_each_reaches_its_task():
    import threading

    from distributed import Client, LocalCluster, wait

    from gpu_tasks.runner.results import Landings

    got: dict[int, tuple[object, BaseException | None]] = {}
    fetches: list[int] = []
    all_in = threading.Event()

    def deliver(item, value, error):
        got[item] = (value, error)
        if len(got) == 21:
            all_in.set()

    def fails() -> None:
        raise ValueError("task body failed")

    with (
        LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None) as cluster,
        Client(cluster) as client,
    ):
        landings = Landings(deliver, name="test-results")
        real = landings._fetch
        landings._fetch = lambda batch: (fetches.append(len(batch)), real(batch))[1]
        futures = client.map(lambda x: x * 2, range(20), pure=False)
        wait(futures)  # all finished before they are queued: they leave as one batch
        bad = client.submit(fails, pure=False)
        wait([bad])
        for i, f in enumerate(futures):
            assert landings.put(i, f)
        assert landings.put(20, bad)
        assert all_in.wait(30)
        landings.close()
        assert not landings.put(21, futures[0])  # closed: the caller fetches it itself
    assert {i: got[i][0] for i in range(20)} == {i: i * 2 for i in range(20)}
    assert got[20][0] is None and isinstance(got[20][1], ValueError)  # fetched on its own, its error
    assert sum(fetches) == 21 and len(fetches) < 21
    assert not any(t.name == "test-results" for t in threading.enumerate())  # the thread ended
