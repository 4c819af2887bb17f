"""The plugin's layout promises (docs/runner.md, "Where the code lives"), checked on the source."""

from __future__ import annotations

import ast
from pathlib import Path

import gpu_tasks

ROOT = Path(gpu_tasks.__file__).parent


def _plugin_modules() -> dict[str, Path]:
    return {f"gpu_tasks.{p.stem}": p for p in sorted(ROOT.glob("*.py")) if p.stem != "__init__"}


def _module_level_imports(path: Path) -> set[str]:
    """``gpu_tasks.*`` modules that ``path`` imports when it is imported (not inside functions
    or ``if TYPE_CHECKING:`` blocks)."""
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node) if not isinstance(node, ast.FunctionDef | ast.ClassDef) else ():
            if isinstance(sub, ast.Import):
                found.update(a.name for a in sub.names)
            elif isinstance(sub, ast.ImportFrom) and sub.module:
                found.add(sub.module)
                found.update(f"{sub.module}.{a.name}" for a in sub.names)
    return {m for m in found if m.startswith("gpu_tasks.")}


def test_no_import_cycles_between_plugin_modules_at_module_level():
    modules = _plugin_modules()
    graph = {name: _module_level_imports(path) & set(modules) for name, path in modules.items()}
    assert {"gpu_tasks._dispatch", "gpu_tasks._live"} <= graph["gpu_tasks.runner"], "the parser sees imports"
    cycles = []

    def visit(node: str, stack: list[str], done: set[str]) -> None:
        if node in stack:
            cycles.append(stack[stack.index(node) :] + [node])
            return
        if node in done:
            return
        for nxt in sorted(graph[node]):
            visit(nxt, [*stack, node], done)
        done.add(node)

    done: set[str] = set()
    for name in sorted(graph):
        visit(name, [], done)
    assert cycles == []


def test_the_runner_module_stays_small_and_the_pipeline_stays_apart():
    runner_lines = len((ROOT / "runner.py").read_text().splitlines())
    assert runner_lines <= 350, f"runner.py has {runner_lines} lines; move a concept into a module of its own"
    for name, path in _plugin_modules().items():
        at_import = {m for m in _module_level_imports(path) if m.startswith("gpu_tasks.pipeline")}
        assert not at_import, f"{name} imports the example pipeline when it is imported: {at_import}"
        if name != "gpu_tasks.cli":  # `gpu-tasks run` / `serve` load it inside the command
            anywhere = {m for m in _all_imports(path) if m.startswith("gpu_tasks.pipeline")}
            assert not anywhere, f"{name} imports the example pipeline: {anywhere}"


def _all_imports(path: Path) -> set[str]:
    out: set[str] = set()
    for sub in ast.walk(ast.parse(path.read_text())):
        if isinstance(sub, ast.ImportFrom) and sub.module:
            out.add(sub.module)
        elif isinstance(sub, ast.Import):
            out.update(a.name for a in sub.names)
    return out
