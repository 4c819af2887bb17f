"""The compat layer (gpu_tasks.compat): every private or undocumented name of Prefect, distributed,
dask-cuda and CPython that gpu-tasks uses passes its feature check on the installed releases (a
release that changes one FAILS here, it does not silently degrade), no module outside the layer
touches such a name, and what gpu-tasks changes in Prefect applies to the task runs it runs alone."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest

from gpu_tasks import compat
from gpu_tasks.compat.prefect import CONTEXT_KEYS

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = ROOT / "gpu_tasks"

USES = compat.uses()


@pytest.mark.parametrize("use", USES, ids=[f"{u.library}:{u.name}" for u in USES])
def test_each_private_name_is_as_gpu_tasks_uses_it(use):
    try:
        problem = use.check()
    except compat.NotInstalled as exc:
        pytest.skip(f"{use.library} is not installed here: {exc}")
    assert problem is None, (
        f"{use.library} changed {use.name}: {problem}. gpu-tasks uses it to {use.why}; update "
        "gpu_tasks/compat and its tested range"
    )


def test_a_changed_name_is_reported_not_silently_ignored(monkeypatch):
    """The checks look at the installed release: take a name away and its check (and
    warn_if_changed's log line) says so."""
    import prefect.client.base as base

    monkeypatch.delattr(base, "clamped_poisson_interval")
    changed = {u.name: why for u, why in compat.verify()}
    assert "prefect.client.base.clamped_poisson_interval" in changed, changed
    import distributed

    monkeypatch.delattr(distributed.Nanny, "_on_worker_exit_sync")
    changed = {u.name: why for u, why in compat.verify()}
    assert "distributed.Nanny._on_worker_exit_sync" in changed, changed


def test_tag_slots_taken_elsewhere_by_the_engine_fail_the_check(monkeypatch):
    """The engine keeps ``_concurrency`` but no longer takes its task run's tag slots through it:
    gpu-tasks' skip of the slots its flow process holds would not apply, so the check fails (a
    worker would otherwise wait for the slot its own flow holds)."""
    import prefect.task_engine as engine

    from gpu_tasks.compat.prefect import _check_engine_concurrency

    assert _check_engine_concurrency() is None

    class SyncTaskRunEngine:  # a release whose engine takes slots some other way
        def start(self):
            return "slots taken elsewhere"

    monkeypatch.setattr(engine, "SyncTaskRunEngine", SyncTaskRunEngine)
    problem = _check_engine_concurrency()
    assert (
        problem == "prefect.task_engine.SyncTaskRunEngine no longer takes its tag slots through _concurrency"
    )


def test_a_crash_reported_elsewhere_by_the_engine_fails_the_check(monkeypatch):
    """The checks read the engine's code: a release whose engine keeps ``handle_crash`` but no longer
    calls it fails, and gpu-tasks' own replacement on the class (which calls Prefect's) does not
    count as a call."""
    import prefect.task_engine as engine

    from gpu_tasks.compat import called_in
    from gpu_tasks.compat.prefect import _check_handle_crash

    assert _check_handle_crash() is None

    class SyncTaskRunEngine:  # handle_crash kept, never called
        _raised = None

        def handle_crash(self, exc):
            return exc

        def start(self):
            return "crashes reported some other way"

    monkeypatch.setattr(engine, "SyncTaskRunEngine", SyncTaskRunEngine)
    assert _check_handle_crash() == f"{SyncTaskRunEngine.__qualname__} no longer calls handle_crash"

    def handle_crash(self, exc):  # as gpu-tasks' patch would: its module is gpu-tasks'
        return self.handle_crash(exc)

    handle_crash.__module__ = "gpu_tasks.compat.prefect"
    monkeypatch.setattr(SyncTaskRunEngine, "start", handle_crash)
    assert called_in(SyncTaskRunEngine, "handle_crash") is not None


RUN_TIME_CHECKS = """
import logging, sys
from prefect import flow, task
from gpu_tasks import ProfileTaskRunner, ResourceProfile, compat

warned = []


class Keep(logging.Handler):
    def emit(self, record):
        warned.append(record.getMessage())


logging.getLogger("gpu_tasks.compat").addHandler(Keep())

@task
def one() -> int:
    return 1

@flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="cpu", cpus=1)]))
def tiny() -> int:
    return one.submit().result()

assert tiny() == 1
print("server module after the flow:", "prefect.server.api.server" in sys.modules)
print("dask_gateway after the flow:", "dask_gateway" in sys.modules)
import dask_gateway
dask_gateway.Gateway.__del__ = lambda self: None  # a release whose client closes some other way
compat.warn_if_changed()  # as the next flow run's runner calls it
print("warned:", warned)
"""


@pytest.mark.processes
@pytest.mark.usefixtures("prefect_server")
def test_the_run_time_check_leaves_a_use_unchecked_until_the_process_imports_its_module():
    """A flow run on a given server checks the private names it uses but imports neither Prefect's
    server (about 2 s a flow run) nor the modules of uses it has no need of: a use whose module is
    not imported yet (dask-gateway's) is checked once something imports it."""
    pytest.importorskip("dask_gateway")
    import os
    import subprocess
    import sys

    import prefect.settings

    env = {**os.environ, "PREFECT_API_URL": str(prefect.settings.PREFECT_API_URL.value())}
    out = subprocess.run(
        [sys.executable, "-c", RUN_TIME_CHECKS], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "server module after the flow: False" in out.stdout, out.stdout
    assert "dask_gateway after the flow: False" in out.stdout, out.stdout
    [line] = [x for x in out.stdout.splitlines() if x.startswith("warned:")]
    assert "dask_gateway.Gateway._loop_runner" in line and "__del__" in line, line


# Modules (or module: name) of the libraries whose names only gpu_tasks/compat may import.
UNDOCUMENTED = {
    "prefect.utilities.engine": None,
    "prefect.events.worker": None,
    "prefect.logging.configuration": {"setup_logging"},  # ensure_logging_setup: documented for workers
    "prefect.server.api.server": None,
    "prefect.server.database": None,
    "prefect.concurrency.services": None,
    "prefect.concurrency": {"services"},
    "prefect.logging.handlers": {"APILogWorker"},
    "distributed.nanny": None,
    "distributed.compatibility": None,
    "distributed.config": None,
    "distributed.worker_memory": None,
    "dask_cuda.worker_common": None,
    "dask_cuda.utils": None,
}
FOREIGN = (
    "prefect",
    "distributed",
    "dask",
    "dask_cuda",
    "dask_gateway",
    "dask_jobqueue",
    "atexit",
    "os",
    "signal",
    "sys",
    "ctypes",
    "multiprocessing",
    "asyncio",
    "threading",
    "subprocess",
)
# names of an undocumented module above that the library's reference documents (Prefect's Python
# SDK reference, docs.prefect.io/v3/api-ref/python/<module>): resolve_inputs_sync ("Resolve any
# Quote, PrefectFuture, or State types nested in parameters into data") and
# emit_task_run_state_change_event on prefect-utilities-engine; AioSqliteORMConfiguration and its
# versions_dir on prefect-server-database-orm_models; create_app ("Create a FastAPI app that
# includes the Prefect REST API and UI": settings, ephemeral, webserver_only, final) on
# prefect-server-api-server
DOCUMENTED_IN = {
    "prefect.server.api.server": {"create_app"},
    "prefect.utilities.engine": {"resolve_inputs_sync", "emit_task_run_state_change_event"},
    "prefect.server.database.orm_models": {"AioSqliteORMConfiguration"},
}
# documented names that happen to start with an underscore
DOCUMENTED_PRIVATE = {"os._exit", "sys._getframe"}
# attribute reads of undocumented names on objects the scan cannot trace to an import (a Dask
# worker handed to a function, a module reached through another)
UNDOCUMENTED_CHAINS = {
    "spawn.set_executable",
    "spawn.get_executable",
}
# keys of a private layout gpu-tasks builds itself (Prefect's serialize_context): a dict literal
# with several of them outside the compat layer is a copy of that layout
PRIVATE_LAYOUTS = {"prefect.context.serialize_context": CONTEXT_KEYS}
ACCESSORS = ("getattr", "setattr", "hasattr", "delattr")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _chain(node: ast.Attribute) -> str:
    """The last two names of an attribute read: ``w.state.tasks`` -> ``state.tasks``."""
    base = node.value
    inner = base.attr if isinstance(base, ast.Attribute) else base.id if isinstance(base, ast.Name) else ""
    return f"{inner}.{node.attr}"


def _dotted(node: ast.AST) -> tuple[str, list[str]] | None:
    """``a.b.c`` as (``a``, [``b``, ``c``]); ``None`` when the chain does not start at a name."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return (node.id, parts[::-1]) if isinstance(node, ast.Name) else None


def _foreign(aliases: dict[str, str], node: ast.AST) -> str | None:
    """The library name ``node`` stands for (``prefect.context.SettingsContext``), if it is one."""
    found = _dotted(node)
    if found is None or found[0] not in aliases:
        return None
    return ".".join([aliases[found[0]], *found[1]])


def _has(dotted: str, name: str) -> bool:
    """Whether the library class ``dotted`` has ``name`` (``True`` when it cannot be imported: the
    override is reported rather than missed)."""
    import importlib

    module, _, attr = dotted.rpartition(".")
    try:
        owner = getattr(importlib.import_module(module), attr)
    except Exception:
        return True
    return hasattr(owner, name)


def _undocumented_module(dotted: str) -> bool:
    return any(
        rule is None and (dotted == mod or dotted.startswith(mod + ".")) for mod, rule in UNDOCUMENTED.items()
    )


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    aliases: dict[str, str] = {}  # local name -> the library name it is bound to
    out: list[str] = []
    where = path.name

    for node in ast.walk(tree):  # every import first, those inside functions too
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in FOREIGN:
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                    if _undocumented_module(a.name) or any(_private(p) for p in a.name.split(".")):
                        out.append(f"{where}:{node.lineno}: import {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] not in FOREIGN:
                continue
            rule = UNDOCUMENTED.get(node.module, ())
            for a in node.names:
                if a.name in DOCUMENTED_IN.get(node.module, ()):
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                    continue
                if (
                    _private(a.name)
                    or any(_private(p) for p in node.module.split("."))
                    or rule is None
                    or (rule and a.name in rule)
                    or _undocumented_module(node.module)
                ):
                    out.append(f"{where}:{node.lineno}: from {node.module} import {a.name}")
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"

    own_classes: dict[str, list[str]] = {}  # class name -> the library classes it derives from
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = [b for b in (_foreign(aliases, base) for base in node.bases) if b]
            if bases:
                own_classes[node.name] = bases
                for item in node.body:
                    if (
                        isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                        and _private(item.name)
                        and any(_has(base, item.name) for base in bases)
                    ):
                        out.append(
                            f"{where}:{item.lineno}: {node.name}.{item.name} overrides a private hook of "
                            f"{', '.join(bases)}"
                        )
        if isinstance(node, ast.Attribute):
            dotted = _foreign(aliases, node)
            if dotted is not None and isinstance(node.ctx, ast.Load):
                parts = dotted.split(".")
                if dotted not in DOCUMENTED_PRIVATE and any(_private(p) for p in parts[1:]):
                    out.append(f"{where}:{node.lineno}: {dotted}")
                elif _undocumented_module(dotted):
                    out.append(f"{where}:{node.lineno}: {dotted} (an undocumented module)")
            if isinstance(node.ctx, ast.Store | ast.Del) and _foreign(aliases, node.value):
                out.append(f"{where}:{node.lineno}: {_foreign(aliases, node.value)}.{node.attr} replaced")
            if isinstance(node.ctx, ast.Load) and _private(node.attr):
                base = node.value
                if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
                    out.append(f"{where}:{node.lineno}: super().{node.attr} (a private hook of a base class)")
            if (chain := _chain(node)) in UNDOCUMENTED_CHAINS:
                out.append(f"{where}:{node.lineno}: .{chain}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ACCESSORS:
            args = node.args
            if len(args) >= 2 and isinstance(args[1], ast.Constant) and isinstance(args[1].value, str):
                target, name = args[0], args[1].value
                mine = isinstance(target, ast.Name) and target.id in ("self", "cls")
                lib = _foreign(aliases, target)
                if (_private(name) and not mine) or (lib and node.func.id in ("setattr", "delattr")):
                    out.append(f"{where}:{node.lineno}: {node.func.id}(..., {name!r})")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars":
            if node.args and _foreign(aliases, node.args[0]):
                out.append(f"{where}:{node.lineno}: vars({_foreign(aliases, node.args[0])})")
        if isinstance(node, ast.Call) and (called := _dotted(node.func)) is not None:
            name = ".".join([called[0], *called[1]])
            first = node.args[0] if node.args else None
            if (name.endswith("import_module") or name == "__import__") and isinstance(first, ast.Constant):
                mod = str(first.value)
                if mod.split(".")[0] in FOREIGN and (
                    _undocumented_module(mod) or any(_private(p) for p in mod.split("."))
                ):
                    out.append(f"{where}:{node.lineno}: import_module({mod!r})")
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            segments = [p for p in text.replace("\\", "/").split("/") if p]
            if "/" in text and any(_private(p) and p.isidentifier() for p in segments):
                out.append(f"{where}:{node.lineno}: a private path {text!r}")
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            for side in (node.left, node.right):
                if isinstance(side, ast.Constant) and isinstance(side.value, str) and _private(side.value):
                    out.append(f"{where}:{node.lineno}: a private path segment {side.value!r}")
        layout_keys_of: set[str] | None = None
        if isinstance(node, ast.Dict):
            layout_keys_of = {str(k.value) for k in node.keys if isinstance(k, ast.Constant)}
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
            layout_keys_of = {k.arg for k in node.keywords if k.arg}
        if layout_keys_of is not None:
            keys = layout_keys_of
            for layout, layout_keys in PRIVATE_LAYOUTS.items():
                if len(keys & layout_keys) >= 3:
                    out.append(f"{where}:{node.lineno}: a copy of {layout}'s layout")
    return out


def test_no_module_outside_the_compat_layer_touches_a_private_name():
    """Every import (inside functions too), attribute and assignment of the plugin is read."""
    found = []
    for path in sorted(PLUGIN.rglob("*.py")):
        rel = path.relative_to(PLUGIN)
        if rel.parts[0] in ("compat", "pipeline"):
            continue
        found += _violations(path)
    assert not found, "private or undocumented names outside gpu_tasks/compat:\n" + "\n".join(found)


def test_the_scan_finds_what_it_is_for(tmp_path):
    """The scan above is not blind: each kind of use it forbids is found in a sample."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import atexit, os\n"
        "from distributed.nanny import _get_env_variables\n"
        "from prefect.events.worker import EventsWorker\n"
        "from prefect.utilities.collections import visit_collection\n"
        "from prefect.context import SyncClientContext\n"
        "def f():\n"
        "    from prefect.utilities.engine import link_state_to_task_run_result\n"
        "    from prefect.utilities.engine import emit_task_run_state_change_event\n"
        "    from prefect.server.database.orm_models import AioSqliteORMConfiguration\n"
        "    atexit._run_exitfuncs()\n"
        "    os._exit = print\n"
        "class N:\n"
        "    def g(self):\n"
        "        super()._on_worker_exit_sync(0)\n"
        "def h(dask_worker, ctypes, spawn):\n"
        "    spawn.set_executable(dask_worker.nthreads)\n"
        "    ctypes.pythonapi.PyThreadState_SetAsyncExc(1, None)\n"
        "    spawn.get_executable()\n"
        "import prefect.context\n"
        "import prefect.serializers as ser\n"
        "import importlib\n"
        "from pathlib import Path\n"
        "from distributed import SpecCluster\n"
        "from prefect.client.orchestration import SyncPrefectClient\n"
        "def k(client, store, gateway, cluster):\n"
        "    prefect.context._deployment_id.get()\n"
        "    getattr(gateway, '_loop_runner', None)\n"
        "    setattr(ser, 'from_qualified_name', print)\n"
        "    ser.from_qualified_name = print\n"
        "    importlib.import_module('distributed.compatibility')\n"
        "    Path(store) / '_migrations'\n"
        "    open('prefect/server/database/_migrations/versions')\n"
        "    SyncPrefectClient._client\n"
        "    return {'flow_run_context': 1, 'task_run_context': 2, 'settings_context': 3}\n"
        "class Mine(SpecCluster):\n"
        "    async def _correct_state(self):\n"
        "        pass\n"
        "    def _mine_alone(self):\n"
        "        pass\n"
        "def m():\n"
        "    return dict(tags_context=1, settings_context=2, deployment_id=3, asset_context=4)\n"
    )
    found = "\n".join(_violations(sample))
    for expected in (
        "_get_env_variables",
        "EventsWorker",
        "link_state_to_task_run_result",
        "atexit._run_exitfuncs",
        "os._exit replaced",
        "super()._on_worker_exit_sync",
        ".spawn.set_executable",
        ".spawn.get_executable",
        "prefect.context._deployment_id",  # attribute access on an imported module
        "getattr(..., '_loop_runner')",  # a private name in a getattr string
        "setattr(..., 'from_qualified_name')",  # a library's name replaced
        "prefect.serializers.from_qualified_name replaced",
        "import_module('distributed.compatibility')",
        "a private path segment '_migrations'",
        "a private path 'prefect/server/database/_migrations/versions'",
        "prefect.client.orchestration.SyncPrefectClient._client",  # on an imported class
        "Mine._correct_state overrides a private hook of distributed.SpecCluster",
        "a copy of prefect.context.serialize_context's layout",
    ):
        assert expected in found, (expected, found)
    assert "_mine_alone" not in found, found  # a private method of its own is not a hook
    # names the libraries' references document are not flagged (DOCUMENTED_IN, the CPython C API)
    for documented in (
        "visit_collection",
        "SyncClientContext",
        "emit_task_run_state_change_event",
        "AioSqliteORMConfiguration",
        "PyThreadState_SetAsyncExc",
    ):
        assert documented not in found, (documented, found)
    assert found.count("serialize_context's layout") == 2, found  # the dict literal and dict(...)


def test_the_context_gpu_tasks_builds_has_prefects_layout():
    """gpu_tasks.runner.payload builds what Prefect's serialize_context returns (its check compares
    Prefect's keys with CONTEXT_KEYS): the same keys, so a change in Prefect fails one of the two."""
    from prefect.context import serialize_context

    from gpu_tasks.compat.prefect import CONTEXT_KEYS
    from gpu_tasks.runner.payload import ContextSerializer

    built, _ = ContextSerializer().serialize()
    assert set(built) == CONTEXT_KEYS == set(serialize_context())


def test_docs_list_every_use():
    text = (ROOT / "docs" / "operations.md").read_text()
    missing = [u.name for u in USES if f"`{u.name}`" not in text]
    assert not missing, f"docs/operations.md does not list: {missing}"
    # each row says, measured, what happens without the use (the column after "why")
    rows = {line.split(" | ")[1]: line.split(" | ") for line in text.splitlines() if line.startswith("| ")}
    cells = {u.name: rows.get(f"`{u.name}`", []) for u in USES}  # a name outside the table: no row
    unmeasured = [name for name, row in cells.items() if len(row) != 5 or len(row[4]) < 20]
    assert not unmeasured, f"docs/operations.md gives no measured figure for: {unmeasured}"


@pytest.mark.processes
@pytest.mark.usefixtures("prefect_server")
def test_prefect_as_shipped_for_task_runs_gpu_tasks_does_not_run():
    """After a ProfileTaskRunner flow in this process (gpu-tasks' wrappers installed, its own
    60 s "no limits" answer for the tag known), a ThreadPoolTaskRunner flow's task run with the
    same tag checks it with the server as Prefect ships: a limit of 0 created meanwhile stops it,
    while Prefect's own 5 s cache is left at 5 s."""
    import prefect.task_engine as engine
    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.concurrency import services
    from prefect.task_runners import ThreadPoolTaskRunner

    from gpu_tasks import ProfileTaskRunner, ResourceProfile
    from gpu_tasks.compat.prefect import _OWN_NO_LIMITS, is_ours

    shipped_ttl = services._no_limits_cache.ttl
    tag = f"compat-{time.monotonic_ns()}"

    @task(tags=[tag])
    def tagged() -> bool:
        return is_ours()

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="cpu", cpus=1)], default="cpu"))
    def on_gpu_tasks() -> bool:
        return tagged.submit().result()

    assert on_gpu_tasks() is True  # gpu-tasks ran it, with its wrappers
    assert getattr(engine, "_gpu_tasks_tag_slot_skip", False)  # installed in this process
    own = _OWN_NO_LIMITS["cache"]  # gpu-tasks' own answers, kept 60 s: one names this tag
    assert any(f"tag:{tag}" in key for key in own) and own.ttl >= 60, dict(own)
    assert services._no_limits_cache.ttl == shipped_ttl  # Prefect's cache as shipped

    with get_client(sync_client=True) as client:
        client.create_concurrency_limit(tag=tag, concurrency_limit=0)
    try:
        # Prefect's own 5 s answer for this tag set expires (the condition, not a fixed sleep)
        deadline = time.monotonic() + shipped_ttl + 10
        while services._no_limits_cache.get(frozenset([f"tag:{tag}"])):
            assert time.monotonic() < deadline
            time.sleep(0.1)

        @flow(task_runner=ThreadPoolTaskRunner(max_workers=2))
        def on_threads() -> object:
            return tagged.submit().wait(timeout=30) or "stopped"

        state = on_threads(return_state=True)
        # Prefect as shipped asked the server: the limit of 0 kept the task run from running
        from prefect_api import flow_run_task_runs

        # recorded by the server from the task run's events, a moment after the flow returned
        task_runs = flow_run_task_runs(state.state_details.flow_run_id, bool)
        assert task_runs, "the ThreadPoolTaskRunner flow made no task run"
        assert all(tr["state_type"] != "COMPLETED" for tr in task_runs), [
            (tr["state_type"], (tr.get("state") or {}).get("message")) for tr in task_runs
        ]
    finally:
        with get_client(sync_client=True) as client:
            client.delete_concurrency_limit_by_tag(tag)


def test_an_orphaned_async_attempt_reports_no_crash_as_a_sync_one(monkeypatch):
    """Both engines skip the Crashed report of an attempt interrupted because its worker closed
    (its scheduler runs it again elsewhere): an async task's used to report Crashed over its retry."""
    import asyncio
    import threading

    from prefect import task
    from prefect.task_engine import AsyncTaskRunEngine, SyncTaskRunEngine

    from gpu_tasks.worker import interrupts

    interrupts._quiet_orphan_crash()  # as a shared worker installs it (once per process)

    @task
    async def atask() -> None: ...

    @task
    def stask() -> None: ...

    said: list[str] = []
    monkeypatch.setattr(interrupts.logger, "warning", lambda msg, *args: said.append(msg % args))
    interrupts.ORPHANED.add(threading.get_ident())
    exc = KeyboardInterrupt()
    try:
        aengine = AsyncTaskRunEngine(task=atask)
        asyncio.run(aengine.handle_crash(exc))  # no state set: the engine has no client here
        sengine = SyncTaskRunEngine(task=stask)
        sengine.handle_crash(exc)
    finally:
        interrupts.ORPHANED.discard(threading.get_ident())
    assert aengine._raised is exc and sengine._raised is exc
    assert len([m for m in said if "this attempt was interrupted and reports nothing" in m]) == 2, said
