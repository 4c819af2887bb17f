"""Every private or undocumented library name gpu-tasks uses, each a :class:`Use` with why and a
feature check (docs/operations.md, "Private names: the compat layer").
"""

from __future__ import annotations

import inspect
import logging
import sys
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("gpu_tasks.compat")


class NotInstalled(Exception):
    """A check's library is not installed here (dask-cuda without the ``gpu`` extra)."""


@dataclass(frozen=True)
class Use:
    """One private or undocumented name: ``kind`` is ``private``, ``undocumented`` or ``patched``;
    ``check`` returns ``None`` or what changed; ``needs``: a module the run-time check waits for."""

    library: str
    name: str
    kind: str
    why: str
    check: Callable[[], str | None]
    needs: str | None = None


def params(fn: Any, *names: str) -> str | None:
    """``None`` when ``fn`` is callable and takes every parameter in ``names``, else what differs."""
    if not callable(fn):
        return f"{fn!r} is not callable"
    try:
        have = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None  # a builtin without a signature: callable is all that can be checked
    missing = [n for n in names if n not in have]
    return f"no parameter(s) {', '.join(missing)} (has {', '.join(have)})" if missing else None


def callables(owner: Any, where: str, *names: str) -> str | None:
    """``None`` when each of ``names`` is a callable of ``owner``, else ``"<where> has no <name>"``."""
    return next((f"{where} has no {n}" for n in names if not callable(getattr(owner, n, None))), None)


def _codes(owner: Any) -> list[Any]:
    """The code objects of ``owner`` (a function, or a class's methods), nested ones included;
    gpu-tasks' own replacements are left out, as the source file would not show them."""
    if isinstance(owner, type):
        found: list[Any] = []
        for value in vars(owner).values():
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            parts = (value.fget, value.fset, value.fdel) if isinstance(value, property) else (value,)
            found.extend(p for p in parts if callable(p))
    else:
        found = [owner]
    out: list[Any] = []
    stack: list[Any] = []
    for fn in found:
        fn = inspect.unwrap(fn) if callable(fn) else fn
        code = getattr(fn, "__code__", None)
        ours = str(getattr(fn, "__module__", "")).startswith("gpu_tasks")
        if isinstance(code, types.CodeType) and not ours:
            stack.append(code)
    while stack:
        code = stack.pop()
        out.append(code)
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return out


def code_names(owner: Any) -> set[str]:
    """The global and attribute names ``owner``'s code reads, calls or hands on."""
    return {n for code in _codes(owner) for n in (*code.co_names, *code.co_freevars)}


def code_strings(owner: Any) -> set[str]:
    """The string constants in ``owner``'s code, f-strings' literal parts included."""
    return {c for code in _codes(owner) for c in code.co_consts if isinstance(c, str)}


def called_in(caller: Any, name: str, source: str | None = None) -> str | None:
    """``None`` when ``caller`` (a function or class; or ``source``, a module's text) still calls
    ``name`` or hands it on, else what changed: a patch no longer called would be a silent no-op."""
    where = getattr(caller, "__qualname__", None) or getattr(caller, "__name__", None) or str(caller)
    if source is None:
        if not _codes(caller):
            return f"{where} has no code to read"
        return None if name in code_names(caller) else f"{where} no longer calls {name}"
    import ast
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError as exc:  # pragma: no cover - an installed library parses
        return f"the source of {where} does not parse ({exc})"
    for node in ast.walk(tree):
        if isinstance(node, ast.Name | ast.Attribute) and isinstance(node.ctx, ast.Load):
            if name in (getattr(node, "id", None), getattr(node, "attr", None)):
                return None
    return f"{where} no longer calls {name}"


def uses() -> list[Use]:
    """Every use, from each compat module."""
    from gpu_tasks.compat import (
        cpython,
        dask_cuda,
        dask_gateway,
        distributed,
        prefect,
        prefect_client,
        prefect_server,
    )

    modules = (prefect, prefect_server, prefect_client, distributed, dask_cuda, dask_gateway, cpython)
    return [use for module in modules for use in module.USES]


def verify(among: list[Use] | None = None) -> list[tuple[Use, str]]:
    """The uses (``among``, default all) whose check fails here, with what changed."""
    out = []
    for use in uses() if among is None else among:
        try:
            problem = use.check()
        except NotInstalled:
            continue
        except Exception as exc:  # a check that breaks is a change too
            problem = f"{type(exc).__name__}: {exc}"
        if problem:
            out.append((use, problem))
    return out


_CHECKED: set[str] = set()
_WARN_LOCK = threading.Lock()


def warn_if_changed() -> None:
    """Log one warning naming each changed private name, checking each use once per process; a use
    whose module (:attr:`Use.needs`) is not imported yet waits for a later call."""
    try:
        with _WARN_LOCK:
            loaded = [u for u in uses() if u.needs is None or u.needs in sys.modules]
            due = [u for u in loaded if u.name not in _CHECKED]
            _CHECKED.update(u.name for u in due)
        if not due:
            return
        changed = verify(due)
    except Exception:  # never let a check stop a flow run
        logger.debug("gpu-tasks: compat checks failed to run", exc_info=True)
        return
    if changed:
        logger.warning(
            "gpu-tasks: the installed release changed names gpu-tasks relies on (it falls back to the "
            "library's own behaviour there): %s. Install a release in gpu-tasks' tested range "
            "(docs/operations.md#install)",
            "; ".join(f"{u.library} {u.name}: {why}" for u, why in changed),
        )
