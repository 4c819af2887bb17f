"""Shared fixtures: one real Prefect test server per session, emulated devices, leak checks."""

from __future__ import annotations

import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
# rich tables (gpu-tasks devices, profiles, quotas) as wide as on a terminal, in every test process
os.environ["COLUMNS"] = "200"
# Scripts the tests run on Prefect's ephemeral API (and their children) inherit this: its server
# is polled until it answers, for up to 180 s rather than Prefect's 20 s, which a loaded 2-core
# machine can pass just importing the server ("Timed out while attempting to connect").
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
# Device leases of this test session stay in this session: a developer's own flow runs
# (or a second test session) never wait on the tests' emulated devices, nor they on them.
import tempfile

os.environ["GPU_TASKS_LEASE_DIR"] = tempfile.mkdtemp(prefix="gpu-tasks-test-leases-")
# and so do their presence records (host-wide by default: /tmp/gpu-tasks-presence): each test
# process (pytest-xdist worker) has lease and presence directories of its own, or its tests would
# wait on the emulated devices that tests of the other processes hold (up to the lease timeout)
os.environ["GPU_TASKS_PRESENCE_DIR"] = tempfile.mkdtemp(prefix="gpu-tasks-test-presence-")
# One warm-pool fork server per test process for its whole session (a flow process keeps it 60 s
# by default): each of the 15 restarts a clean-clone run had in its three test processes imported
# Prefect and distributed again (about 2 s of CPU). It ends with its process; scripts a test starts
# inherit the setting and end theirs as they exit.
os.environ.setdefault("GPU_TASKS_TUNE_WARM_SERVER_KEEP_SECONDS", "3600")

# Prefect's home (its database, profiles and settings) of this test session, never the user's
# ~/.prefect: a database there that a newer Prefect migrated cannot be opened by this one. scripts/test
# sets one too; a PREFECT_HOME given explicitly is kept (tests/test_environment.py collects the
# suite on a broken one).
if "PREFECT_HOME" not in os.environ:
    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="gpu-tasks-test-prefect-home-")
    # (pytest-xdist's workers inherit it: only the process that made it removes it)
    os.environ["GPU_TASKS_TEST_HOME_MADE_BY"] = str(os.getpid())

import contextlib
import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from faults._procs import SEEDED_SERVER
from hypothesis import settings as _hypothesis
from tiers import FAST_MODULES, HEAVY_MODULES

# Every Prefect server the tests start skips registering Prefect's block types (2.3 s of CPU a
# server start): tests/faults/_procs.py SEEDED_SERVER (Prefect itself is imported later)
for _k, _v in SEEDED_SERVER.items():
    os.environ.setdefault(_k, _v)

# No wall-clock deadline on property tests (hypothesis' default fails an example slower than
# 200 ms, which a loaded 2-core CI machine makes of a fast one): speed is measured in bench/
_hypothesis.register_profile("gpu-tasks", deadline=None)
_hypothesis.load_profile("gpu-tasks")


# The directories this process made above (pytest_unconfigure removes them)
_OWN_DIRS = [os.environ["GPU_TASKS_LEASE_DIR"], os.environ["GPU_TASKS_PRESENCE_DIR"]]
if os.environ.get("GPU_TASKS_TEST_HOME_MADE_BY") == str(os.getpid()):
    _OWN_DIRS.append(os.environ["PREFECT_HOME"])


def pytest_unconfigure(config: pytest.Config) -> None:
    """The directories this test process made for itself go with it (each process of a run made
    its own: a run on three processes left nine in the temporary folder, and hundreds piled up)."""
    for d in _OWN_DIRS:
        shutil.rmtree(d, ignore_errors=True)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--serial-tests",
        choices=("with", "only", "skip"),
        default="with",
        help="tests marked serial (they compare times across processes, which other tests' load "
        "would skew): run them with the rest (default), only them, or none (scripts/test runs the "
        "rest on several processes, then these one after another)",
    )
    parser.addoption(
        "--serial-lane",
        choices=("timing", "scheduler"),
        default=None,
        help="with --serial-tests=only: the serial tests of this lane alone (the `lane` of their "
        "`serial` mark, `timing` when it names none); scripts/test runs the two lanes side by side, "
        "each in a pytest process of its own",
    )


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """With ``--serial-tests=only``, a test module whose text never marks a test ``serial`` is not
    imported: collecting all 73 modules to keep 6 tests took each serial lane 5.4 s of CPU and
    9 s at the start of the serial phase. A module named on the command line is still collected."""
    if config.getoption("--serial-tests") != "only" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_") or collection_path in {
        Path(a.split("::")[0]).resolve() for a in config.args
    }:
        return None
    return b"mark.serial" not in collection_path.read_bytes()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.split("::")[0] in FAST_MODULES:
            item.add_marker(pytest.mark.fast)
    tier = os.environ.get("GPU_TASKS_TEST_TIER")
    if tier in ("fast", "rest"):  # the fast tier, or everything else (scripts/test runs them apart)

        def in_tier(item: pytest.Item) -> bool:
            fast = (
                item.get_closest_marker("fast") is not None and item.get_closest_marker("processes") is None
            )
            return fast == (tier == "fast")

        config.hook.pytest_deselected(items=[item for item in items if not in_tier(item)])
        items[:] = [item for item in items if in_tier(item)]
    mode = config.getoption("--serial-tests")
    if mode == "with":
        return
    lane = config.getoption("--serial-lane")
    keep, drop = [], []
    for item in items:
        mark = item.get_closest_marker("serial")
        wanted = (mark is not None) == (mode == "only")
        if wanted and lane is not None and mark is not None:
            wanted = mark.kwargs.get("lane", "timing") == lane
        (keep if wanted else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        items[:] = _heavy_modules_first(items, workers)


def _heavy_modules_first(items: list[pytest.Item], workers: int) -> list[pytest.Item]:
    """The order pytest-xdist's worksteal scheduler hands out: it gives process i the i-th of
    ``workers`` contiguous slices of the collection, and an idle process takes the far half of the
    longest queue. So each slice starts with heavy modules (greedy: the heaviest left to the slice
    with the least so far) and is filled up with the other tests in their collected order: no long
    module starts last and stretches the phase, and the netns module stays whole in one process
    (its tests in other processes waited for its host lock). Every process collects the same order."""
    by_module: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_module.setdefault(item.nodeid.split("::")[0], []).append(item)
    lanes: list[list[pytest.Item]] = [[] for _ in range(workers)]
    load = [0.0] * workers
    for module, seconds in sorted(HEAVY_MODULES.items(), key=lambda kv: -kv[1]):
        if module in by_module:
            lane = load.index(min(load))
            lanes[lane] += by_module.pop(module)
            load[lane] += seconds
    light = [item for module in by_module.values() for item in module]
    # the slice sizes worksteal's first hand-out gives: len(pending) // processes left
    sizes, left = [], len(items)
    for i in range(workers):
        sizes.append(left // (workers - i))
        left -= sizes[-1]
    out: list[pytest.Item] = []
    for lane, size in zip(lanes, sizes, strict=True):
        take = max(0, size - len(lane))
        out += lane + light[:take]
        light = light[take:]
    out += light
    assert sorted(i.nodeid for i in out) == sorted(i.nodeid for i in items), "a test was lost"
    return out


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # type: ignore[no-untyped-def]
    """With GPU_TASKS_TEST_TIMELINE=DIR: each test's start and end (setup to teardown) and its test
    process, one JSON line a test in DIR/<process>-py<minor>.jsonl, to see how the processes share
    the suite."""
    out = os.environ.get("GPU_TASKS_TEST_TIMELINE")
    start, cpu = time.time(), _cpu_seconds()
    yield
    if out:
        import json

        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        line = {"test": item.nodeid, "start": start, "end": time.time(), "cpu": _cpu_seconds() - cpu}
        import sys

        # the Python in the name keeps the compat stage's processes apart from the main suite's
        with open(os.path.join(out, f"{worker}-py{sys.version_info[1]}.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")


def _cpu_seconds() -> float:
    """CPU time of this test process and of its children that ended (a module's fixture processes
    are counted at the test after which they end)."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.fixture(scope="session")
def prefect_server():
    """A temporary SQLite-backed Prefect server on 127.0.0.1 for the whole session (Prefect's test
    harness), on a database already migrated (:func:`seeded_harness_dir`)."""
    from prefect.settings import PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL as FLUSH
    from prefect.settings import get_current_settings, temporary_settings
    from prefect.testing import utilities as harness

    from gpu_tasks.prefect_api.server import recorder_settings

    # 240: the compat stage runs at nice 10 beside the parallel phase (.ci/run), where a saturated
    # machine gave its server start a few per cent of a core; 120 timed out there (48 errors at
    # a6f37fb). Prefect counts this bound in polls of 0.1 s, so it is at least that many seconds;
    # pytest-timeout (300 s, setup included) still ends a real hang.
    # its task-run recorder batches its writes, as the embedded server's does (docs/operations.md,
    # "Network"): the tests' task runs cost the session's server less CPU on the 2-core machine
    # Its event persister writes a partial batch every second, not every 5 s (Prefect's default):
    # the tests that wait for a gpu-tasks event to be stored wait for that flush
    updates = {**recorder_settings(get_current_settings()), FLUSH: 1.0}
    batched = temporary_settings(updates=updates)
    with seeded_harness_dir(harness) as seeded, batched:
        with harness.prefect_test_harness(server_startup_timeout=240):
            import prefect.settings

            url = str(prefect.settings.PREFECT_SERVER_DATABASE_CONNECTION_URL.value())
            if not any(url.endswith(os.path.join(d, "prefect-test.db")) for d in seeded):
                warnings.warn(
                    f"Prefect's test harness runs on {url}, not the migrated database: tests/conftest.py",
                    stacklevel=1,
                )
            server = prefect.settings.get_current_settings().server
            if server.register_blocks_on_start or server.memoize_block_auto_registration:
                warnings.warn(
                    "this Prefect no longer reads SEEDED_SERVER's settings: each server start registers "
                    "block types again (tests/faults/_procs.py)",
                    stacklevel=1,
                )
            yield


@contextlib.contextmanager
def seeded_harness_dir(harness: Any) -> Iterator[list[str]]:
    """Prefect's test harness puts its database, ``prefect-test.db``, in a new ``mkdtemp()``
    directory, and its server runs every migration on it (about 6 s of CPU and 10 s at the start of
    each test process on the 2-core machine). Here that directory already holds the database a
    home has after its first server start (tests/faults/_procs.py ``migrated_db``), so the server
    finds it at the newest revision. A harness that no longer calls ``mkdtemp`` or names its
    database otherwise still works, on a database it migrates (:func:`prefect_server` warns).
    Yields the directories it made."""
    from faults._procs import migrated_db

    made: list[str] = []
    real = getattr(harness, "mkdtemp", None)

    def seeded_mkdtemp(*args: Any, **kwargs: Any) -> str:
        d = tempfile.mkdtemp(*args, **kwargs)
        shutil.copyfile(migrated_db(), os.path.join(d, "prefect-test.db"))
        made.append(d)
        return d

    if real is not None:
        harness.mkdtemp = seeded_mkdtemp
    try:
        yield made
    finally:
        if real is not None:
            harness.mkdtemp = real


# per-interpreter singletons that end with the interpreter: multiprocessing's resource tracker
# (the first spawned process starts it) and gpu-tasks' warm-pool fork server, shared by the flow
# runs of one process and kept GPU_TASKS_TUNE_WARM_SERVER_KEEP_SECONDS after its last pool closes
# (tests/test_warm_pool.py checks that it ends)
SINGLETONS = ("resource_tracker", "multiprocessing.forkserver")


def _descendants() -> set[int]:
    """Child processes, less the interpreter's singletons (:data:`SINGLETONS`: this process's own
    children; a worker forked from the fork server has its command line too, and counts)."""
    out = set()
    me = os.getpid()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.ppid() == me and any(s in " ".join(p.cmdline()) for s in SINGLETONS):
                continue
        except psutil.Error:
            continue
        out.add(p.pid)
    return out


@pytest.fixture
def no_leaked_processes(prefect_server):
    """Fail the test if a process started during it is still alive at its end."""
    before = _descendants()
    yield
    deadline = 10.0
    leftover: set[int] = set()
    for _ in range(int(deadline / 0.25)):
        leftover = {pid for pid in _descendants() - before if psutil.pid_exists(pid)}
        if not leftover:
            return
        psutil.wait_procs([psutil.Process(p) for p in leftover if psutil.pid_exists(p)], timeout=0.25)
    procs = []
    for pid in leftover:
        try:
            procs.append(" ".join(psutil.Process(pid).cmdline())[:200])
        except psutil.Error:
            continue
    if procs:
        pytest.fail(f"processes outlived the flow: {procs}")


@pytest.fixture
def emulated(monkeypatch):
    """Two emulated devices (an H100 and an L4) and a short default idle timeout."""
    monkeypatch.setenv("GPU_TASKS_EMULATED_GPUS", "H100:80GiB,H100:80GiB")
    monkeypatch.setenv("GPU_TASKS_IDLE_TIMEOUT", "30")
    monkeypatch.delenv("GPU_TASKS_PROFILES_FILE", raising=False)
    monkeypatch.delenv("GPU_TASKS_DISCOVERY_COMMAND", raising=False)
    return "H100:80GiB,H100:80GiB"


@pytest.fixture
def lease_dir(tmp_path, monkeypatch):
    """A fresh device lease directory (GPU_TASKS_LEASE_DIR) and no lease timeout override."""
    path = tmp_path / "leases"
    monkeypatch.setenv("GPU_TASKS_LEASE_DIR", str(path))
    monkeypatch.delenv("GPU_TASKS_LEASE_TIMEOUT", raising=False)
    return path


@pytest.fixture(autouse=True)
def no_processes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """In the fast tier (GPU_TASKS_TEST_TIER=fast), a test that starts a process fails, naming the
    fix: its module does not belong in FAST_MODULES."""
    if os.environ.get("GPU_TASKS_TEST_TIER") != "fast":
        return
    if "prefect_server" in request.fixturenames:
        raise AssertionError(
            f"{request.node.nodeid} needs a Prefect server: mark it `processes` to leave it to the full suite"
        )
    import multiprocessing.process
    import subprocess

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(
            f"{request.node.nodeid} starts a process: the fast tier is pure logic and in-process "
            "checks; take its module out of FAST_MODULES (tests/conftest.py)"
        )

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
