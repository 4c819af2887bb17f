"""Prefect futures as task inputs, waited for without blocking and sent as final states: Dask futures
of one profile's cluster cannot go to another's."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

from prefect.futures import PrefectFuture
from prefect.utilities.annotations import BaseAnnotation
from prefect.utilities.collections import visit_collection

_ATOMS = frozenset({str, bytes, int, float, bool, complex, type(None)})
_SEQUENCES = frozenset({list, tuple, set, frozenset})
_PLAIN_DEPTH = 32


def _plain_futures(expr: Any, found: list[PrefectFuture[Any]], depth: int = 0) -> bool:
    """Add the futures in ``expr`` to ``found`` while it is plain built-in containers and atoms;
    ``False`` at anything else, which Prefect's slower ``visit_collection`` then walks."""
    kind = type(expr)
    if kind in _ATOMS:
        return True
    if isinstance(expr, PrefectFuture):
        found.append(expr)
        return True
    if depth >= _PLAIN_DEPTH:
        return False
    if kind is dict:
        return all(
            _plain_futures(k, found, depth + 1) and _plain_futures(v, found, depth + 1)
            for k, v in expr.items()
        )
    if kind in _SEQUENCES:
        return all(_plain_futures(x, found, depth + 1) for x in expr)
    return False


def pending_futures(expr: Any) -> list[PrefectFuture[Any]]:
    """The Prefect futures in ``expr`` (any nesting) that are not done yet."""
    found: list[PrefectFuture[Any]] = []
    if not _plain_futures(expr, found):
        found.clear()

        def visit(x: Any) -> Any:
            if isinstance(x, PrefectFuture):
                found.append(x)
            return x

        visit_collection(expr, visit_fn=visit, return_data=False)
    return [f for f in found if not _is_done(f)]


def upstream_failed(*exprs: Any) -> bool:
    """Whether a done Prefect future in ``exprs`` ended other than Completed where Prefect's engine
    would refuse to run the task for it (``allow_failure`` lets a Failed one through): the engine then
    marks the task run NotReady without calling its function."""
    from prefect import allow_failure

    plain: list[PrefectFuture[Any]] = []
    if all(_plain_futures(expr, plain) for expr in exprs):  # no annotation (allow_failure) in them
        return any(_is_done(f) and not _final_state(f).is_completed() for f in plain)
    failed: list[PrefectFuture[Any]] = []

    def visit(x: Any, context: dict[str, Any]) -> Any:
        if isinstance(x, PrefectFuture) and _is_done(x):
            state = _final_state(x)
            if not state.is_completed() and not (
                isinstance(context.get("annotation"), allow_failure) and state.is_failed()
            ):
                failed.append(x)
        return x

    for expr in exprs:
        visit_collection(expr, visit_fn=visit, return_data=False, context={})
    return bool(failed)


def _final_state(f: PrefectFuture[Any]) -> Any:
    """A done future's final state, as its future holds it: ``state`` alone reads the task run from
    the server, which may not know the final state yet (a Completed upstream read Running there, and
    its downstream tasks ran NotReady in the flow process: a new-user pass, 2 of 10 task runs)."""
    f.wait()
    return f.state


def _is_done(f: PrefectFuture[Any]) -> bool:
    wrapped = getattr(f, "wrapped_future", None)
    if isinstance(wrapped, concurrent.futures.Future):
        return wrapped.done()
    return f.state.is_final()


def when_all_done(futures: list[PrefectFuture[Any]], then: Callable[[], Any]) -> None:
    """Call ``then()`` (on the thread that finishes the last one) once all ``futures`` are done."""
    remaining = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Any) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            then()

    for f in futures:
        f.add_done_callback(one_done)


def futures_to_states(expr: Any) -> Any:
    """Replace Prefect futures by their final states, which travel to any cluster."""
    found: list[PrefectFuture[Any]] = []
    if _plain_futures(expr, found) and not found:
        return expr  # plain data without futures: nothing to replace (else Prefect's walk does it)

    def visit(x: Any) -> Any:
        if isinstance(x, PrefectFuture):
            x.wait()
            return x.state
        return x

    return visit_collection(expr, visit_fn=visit, return_data=True)


def annotations_for_workers(expr: Any) -> Any:
    """``expr`` with Prefect's annotations (``allow_failure``, ``quote``, ...) made to reach a task on a
    worker process as they are (open it there with :func:`unsealed`). Prefect's own come back from
    each pickle with their value in one more tuple (a tuple subclass whose ``__new__`` wraps what it
    is given: ``quote(([1, 2],))``), and Dask pickles a task's arguments twice on their way (flow to
    scheduler, scheduler to worker): a GPU task got ``((5,),)`` for ``allow_failure(5)``."""
    out, found = _annotations_pickled(expr)
    return _Sealed(out) if found else expr


def unsealed(expr: Any) -> Any:
    """What :func:`annotations_for_workers` made of a value, as it was (the annotations are back)."""
    return expr.value if isinstance(expr, _Sealed) else expr


def _annotations_pickled(expr: Any) -> tuple[Any, bool]:
    if _plain_futures(expr, []):
        return expr, False  # plain data holds no annotation
    found: list[Any] = []

    def visit(x: Any) -> Any:
        if isinstance(x, BaseAnnotation):
            found.append(x)
            return _Annotation(type(x), _annotations_pickled(x.unwrap())[0])
        return x

    out = visit_collection(expr, visit_fn=visit, return_data=True)
    return out, bool(found)


class _Annotation:
    """An annotation on its way to a worker; unpickled, it is the annotation again."""

    __slots__ = ("kind", "value")

    def __init__(self, kind: type[Any], value: Any) -> None:
        self.kind, self.value = kind, value

    def __reduce__(self) -> tuple[Any, ...]:
        return self.kind, (self.value,)


class _Sealed:
    """A value pickled once, in the flow process, opened by the task on its worker: Dask unpickles a
    task's arguments in its scheduler and pickles them again for the worker, which would undo what
    :class:`_Annotation` does (and its tuples are rebuilt there too)."""

    __slots__ = ("pickled",)

    def __init__(self, value: Any) -> None:
        import cloudpickle  # type: ignore[import-untyped]

        self.pickled = cloudpickle.dumps(value)

    @property
    def value(self) -> Any:
        import pickle

        return pickle.loads(self.pickled)
