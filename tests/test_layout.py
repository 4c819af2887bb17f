"""The plugin's layers (docs/runner.md, "The layers"), checked on the source.

Every import counts: at module level, inside functions and under ``if TYPE_CHECKING:``. A module
may import its own layer and the layers below it, never one above; no two modules import each
other, directly or around a loop; no module is over 800 lines (one concept a module; a concept may
need more than 600); the example pipeline is imported
by no plugin module (the CLI's ``run`` / ``serve`` load it inside the command).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gpu_tasks

ROOT = Path(gpu_tasks.__file__).parent

# Bottom to top. A module belongs to the layer of the longest prefix that names it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("gpu_tasks.errors", "gpu_tasks.settings", "gpu_tasks._gpu", "gpu_tasks.compat")),
    (
        "model",  # pure: what a task asks for and what exists; decisions on them
        (
            "gpu_tasks.profiles",
            "gpu_tasks.devices.discovery",
            "gpu_tasks.devices.topology",
            "gpu_tasks.allocation",
            "gpu_tasks.policy",
            "gpu_tasks.preemption",
            "gpu_tasks.borrowing",
        ),
    ),
    ("prefect glue and reporting", ("gpu_tasks.prefect_api", "gpu_tasks.reporting")),
    ("devices", ("gpu_tasks.devices",)),
    ("worker", ("gpu_tasks.worker",)),
    ("clusters", ("gpu_tasks.cluster",)),
    ("flow side", ("gpu_tasks.runner",)),
    ("entry points", ("gpu_tasks.cli", "gpu_tasks.deployments", "gpu_tasks")),
]
MAX_LINES = 800  # one concept per module; none past 800 (the line cap was 600, which cut by count)
PUBLIC_API = {
    "Allocation",
    "ClusterError",
    "CudaOptions",
    "TlsOptions",
    "Device",
    "DeviceDiscoveryError",
    "EnvironmentProblem",
    "GpuOutOfMemoryError",
    "GpuTasksError",
    "GpuTasksSettings",
    "Inventory",
    "ProfileError",
    "ProfileFuture",
    "ProfileTaskRunner",
    "ResourceProfile",
    "SettingsError",
    "UnknownProfileError",
    "UnsatisfiableProfileError",
    "current_allocation",
    "discover",
    "get_settings",
    "load_profiles_file",
    "per_device_client",
    "profile",
    "profile_tag",
    "use_profile",
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def plugin_modules() -> dict[str, Path]:
    return {
        _module_name(p): p for p in sorted(ROOT.rglob("*.py")) if "pipeline" not in p.relative_to(ROOT).parts
    }


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The plugin modules ``path`` imports, anywhere in it (functions and TYPE_CHECKING included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            submodules = {f"{node.module}.{a.name}" for a in node.names} & known
            found.update(submodules)  # from a.b import c: a.b.c where c is a module, else a.b
            if len(submodules) < len(node.names):
                found.add(node.module)
    return {m for m in found if m in known}


def layer_of(module: str) -> int:
    best, level = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, level = len(prefix), i
    assert level >= 0, f"{module} is in no layer: add it to LAYERS in tests/test_layout.py and docs/runner.md"
    return level


def import_graph() -> dict[str, set[str]]:
    modules = plugin_modules()
    return {name: imports_of(path, set(modules)) - {name} for name, path in modules.items()}


def test_the_parser_sees_every_kind_of_import(tmp_path: Path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from typing import TYPE_CHECKING\n"
        "import gpu_tasks.errors\n"
        "from gpu_tasks.runner import session\n"
        "if TYPE_CHECKING:\n    from gpu_tasks.cluster.local import ProfileCluster\n"
        "def f():\n    from gpu_tasks.worker.engine import run_engine\n"
    )
    known = set(plugin_modules())
    assert imports_of(sample, known) == {
        "gpu_tasks.errors",
        "gpu_tasks.runner.session",
        "gpu_tasks.cluster.local",
        "gpu_tasks.worker.engine",
    }


def test_every_module_imports_only_its_layer_and_those_below():
    graph = import_graph()
    assert len(graph) > 40 and "gpu_tasks.runner.controller" in graph["gpu_tasks.runner.task_runner"]
    upward = [
        f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
        for a, targets in sorted(graph.items())
        for b in sorted(targets)
        if layer_of(b) > layer_of(a) and not (a == "gpu_tasks.devices" and b.startswith("gpu_tasks.devices."))
    ]
    assert upward == []


def test_no_import_loops_between_plugin_modules():
    graph = import_graph()
    # a package's __init__ importing its own submodules is how a package re-exports: not a loop
    edges = {a: {b for b in bs if not b.startswith(a + ".")} for a, bs in graph.items()}
    loops: list[list[str]] = []

    def visit(node: str, stack: list[str], done: set[str]) -> None:
        if node in stack:
            loops.append(stack[stack.index(node) :] + [node])
            return
        if node in done:
            return
        for nxt in sorted(edges[node]):
            visit(nxt, [*stack, node], done)
        done.add(node)

    done: set[str] = set()
    for name in sorted(edges):
        visit(name, [], done)
    assert loops == []


@pytest.mark.parametrize("package", ["runner", "cluster", "worker", "devices", "prefect_api", "reporting"])
def test_each_layer_is_a_package_with_a_docstring(package: str):
    init = ROOT / package / "__init__.py"
    assert init.exists(), f"gpu_tasks/{package}/__init__.py"
    assert ast.get_docstring(ast.parse(init.read_text())), f"gpu_tasks/{package}/__init__.py: a docstring"


def test_no_module_is_over_the_line_limit():
    lines = {name: len(path.read_text().splitlines()) for name, path in plugin_modules().items()}
    over = {name: n for name, n in lines.items() if n > MAX_LINES}
    assert over == {}, f"split these by concept (none over {MAX_LINES} lines): {over}"


def test_the_public_api_is_unchanged_and_the_pipeline_stays_apart():
    assert set(gpu_tasks.__all__) == PUBLIC_API
    for name in PUBLIC_API:
        assert getattr(gpu_tasks, name) is not None
    from gpu_tasks.runner import ProfileTaskRunner

    assert ProfileTaskRunner is gpu_tasks.ProfileTaskRunner  # the documented import path
    assert gpu_tasks.profile is gpu_tasks.profile_tag and gpu_tasks.profile_tag("gpu") == "profile:gpu"
    from gpu_tasks.errors import EnvironmentProblem, GpuOutOfMemoryError

    assert (
        gpu_tasks.GpuOutOfMemoryError is GpuOutOfMemoryError
        and gpu_tasks.EnvironmentProblem is EnvironmentProblem
    )
    with pytest.raises(AttributeError, match="from gpu_tasks.pipeline.errors import PipelineInputError"):
        gpu_tasks.PipelineInputError  # noqa: B018
    for name, path in plugin_modules().items():
        pipeline = {m for m in imports_of(path, _pipeline_modules()) if m.startswith("gpu_tasks.pipeline")}
        if (
            name == "gpu_tasks.cli.pipeline"
        ):  # `gpu-tasks example run` / `serve` load it inside the command only
            top = ast.parse(path.read_text()).body
            at_import = [n for n in top if isinstance(n, ast.ImportFrom) and "pipeline" in (n.module or "")]
            assert not at_import
        else:
            assert not pipeline, f"{name} imports the example pipeline: {pipeline}"


def _pipeline_modules() -> set[str]:
    return {_module_name(p) for p in (ROOT / "pipeline").rglob("*.py")}


# what tells the kinds of cluster apart; only gpu_tasks/cluster/ (and the profile model) reads it
KIND_ATTRIBUTES = {"kind", "is_local", "address", "cluster_class"}


def test_only_the_cluster_package_asks_which_kind_of_cluster_a_profile_has():
    """``runner/`` holds every kind as a ``ProfileCluster`` and asks the cluster (``shared``,
    ``stopped_note``) or ``cluster.kinds`` instead (docs/runner.md, "The layers")."""
    asked: list[str] = []
    for name, path in plugin_modules().items():
        if not name.startswith("gpu_tasks.runner"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in KIND_ATTRIBUTES:
                asked.append(f"{name}:{node.lineno} .{node.attr}")
    assert asked == []


def test_the_kind_check_sees_an_attribute_read(tmp_path: Path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f(prof):\n    return prof.is_local and prof.address\n")
    found = {n.attr for n in ast.walk(ast.parse(sample.read_text())) if isinstance(n, ast.Attribute)}
    assert KIND_ATTRIBUTES & found == {"is_local", "address"}


def test_every_fast_tier_module_exists_and_is_not_also_heavy():
    """A module renamed or moved would drop out of ./scripts/test --fast without a word."""
    from tiers import FAST_MODULES, HEAVY_MODULES

    repo = ROOT.parent
    assert [m for m in FAST_MODULES if not (repo / m).is_file()] == []
    assert set(FAST_MODULES) & set(HEAVY_MODULES) == set()


@pytest.mark.processes
def test_the_serial_lanes_split_the_serial_tests_between_them():
    """scripts/test runs the serial phase as two pytest processes, one a lane (--serial-lane): every
    serial test is in exactly one lane, the schedule tests in theirs, the timing tests in the other."""
    import subprocess
    import sys

    def collected(*args: str) -> set[str]:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-p",
                "no:cacheprovider",
                "-p",
                "no:xdist",
                "--collect-only",
                "-q",
                *args,
            ],
            cwd=ROOT.parent,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        return {line for line in out.stdout.splitlines() if "::" in line}

    # the modules that mark tests serial (collecting the whole suite three times took 40 s)
    marked = sorted(
        str(p.relative_to(ROOT.parent))
        for p in (ROOT.parent / "tests").rglob("test_*.py")
        if "mark.serial" in p.read_text()
    )
    assert "tests/test_schedules.py" in marked
    every = collected("--serial-tests=only", *marked)
    timing = collected("--serial-tests=only", "--serial-lane=timing", *marked)
    scheduler = collected("--serial-tests=only", "--serial-lane=scheduler", *marked)
    assert timing and scheduler and not timing & scheduler
    assert timing | scheduler == every
    assert {t.split("::")[0] for t in scheduler} == {"tests/test_schedules.py"}
    assert any("test_aging_keeps" in t for t in timing) and any(
        "higher_priority_flow_run" in t for t in timing
    )
    # pytest-xdist's groups do nothing under pytest 9.2 (pytest-xdist issue 1386): none may be relied on
    mark = "xdist_" + "group("
    assert [str(p) for p in (ROOT.parent / "tests").rglob("*.py") if mark in p.read_text()] == []
