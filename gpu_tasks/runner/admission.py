"""A GPU task whose result Prefect already has: found in the flow process, before any device.

Prefect's task engine looks for a task's cached result after the task run started, which
on a worker is after a device was leased and the worker started for it. For a task whose
result would be persisted under a cache policy, the runner computes the same cache key in
the flow process first (:func:`cached_key`, as ``SyncTaskRunEngine.compute_transaction_key``
does in prefect 3.8.8: the task's ``cache_policy.compute_key`` with a task run context, the
task's resolved inputs and the flow run's parameters) and asks the task's result store
whether the record exists. If it does, the task runs in the flow process with no device
(Prefect's engine reads the record and reports the run ``Cached``), through
:func:`cache_only`, a copy of the task that never runs its function there.
"""

from __future__ import annotations

import copy
import functools
import uuid
from typing import Any


def may_be_cached(task: Any) -> bool:
    """Whether a cached result of ``task`` may exist (cheap: the task's options only).

    False for tasks without a cache policy (``NO_CACHE``), with ``refresh_cache``, with a
    ``result_storage_key`` (whose key needs the running task's context) and for tasks whose
    results are not persisted (they never write a record to find).
    """
    from prefect.cache_policies import NO_CACHE, CachePolicy
    from prefect.settings import get_current_settings

    policy = getattr(task, "cache_policy", None)
    if not isinstance(policy, CachePolicy) or policy == NO_CACHE:
        return False
    if getattr(task, "result_storage_key", None) is not None:
        return False
    settings = get_current_settings()
    refresh = task.refresh_cache if task.refresh_cache is not None else settings.tasks.refresh_cache
    if refresh:
        return False
    persist = task.persist_result
    if persist is None:
        persist = settings.tasks.default_persist_result
    if persist is None:
        persist = settings.results.persist_by_default
    return bool(persist)


def cached_key(task: Any, task_run_id: uuid.UUID, parameters: dict[str, Any]) -> str | None:
    """The cache key of ``task`` on ``parameters`` when its result store has a record for it, else None.

    Runs in the flow run's context; the inputs' upstream futures are done. Any error
    (inputs that cannot be hashed, a ``cache_key_fn`` that needs what only a running task
    has, storage that cannot be read) means "not found": the task goes to its worker, whose
    engine computes the key and logs such errors as it always does.
    """
    from prefect.client.schemas.objects import TaskRun
    from prefect.context import FlowRunContext, TaskRunContext
    from prefect.results import get_result_store

    from gpu_tasks.compat.prefect import engine_helpers, result_store_for_task

    visit_collection, resolve_to_final_result = engine_helpers()
    flow_ctx = FlowRunContext.get()
    if flow_ctx is None or flow_ctx.flow_run is None:
        return None
    try:
        inputs = {
            name: visit_collection(
                value,
                visit_fn=resolve_to_final_result,
                return_data=True,
                max_depth=-1,
                remove_annotations=True,
                context={"parameter_name": name},
            )
            for name, value in parameters.items()
        }  # as the engine resolves them (SyncTaskRunEngine._resolve_parameters)
        store: Any = result_store_for_task(get_result_store(), task)
        task_run = TaskRun(
            id=task_run_id,
            name=task.name,
            flow_run_id=flow_ctx.flow_run.id,
            task_key=task.task_key,
            dynamic_key="gpu-tasks-cache-check",
            tags=sorted(task.tags),
        )
        with TaskRunContext(
            task=task,
            task_run=task_run,
            parameters=inputs,
            result_store=store,
            client=flow_ctx.client,
            persist_result=True,
        ) as task_ctx:
            key = task.cache_policy.compute_key(
                task_ctx=task_ctx, inputs=inputs, flow_parameters=flow_ctx.parameters or {}
            )
        if key and store.exists(key=key):
            return str(key)
    except Exception:
        return None
    return None


class CacheOnly:
    """``task`` for a run that must only read its cached result: its function raises if called.

    ``called`` tells afterwards whether Prefect's engine found no record after all (it
    expired, or was deleted, between the check and the run): the run ended ``Crashed``
    (a ``BaseException`` is no task failure, so no retry ran it here) and the runner runs it
    again on a worker.
    """

    class Missed(BaseException):
        """The engine would have run the task's function in the flow process."""

    def __init__(self, task: Any) -> None:
        self.called = False
        fn = task.fn

        @functools.wraps(fn)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            self.called = True
            raise CacheOnly.Missed(
                f"task {task.name!r}: its cached result was gone when the run started; it runs again "
                "on its profile's workers"
            )

        if getattr(task, "isasync", False):

            @functools.wraps(fn)
            async def aguarded(*args: Any, **kwargs: Any) -> Any:
                return guarded(*args, **kwargs)

            self.task = copy.copy(task)
            self.task.fn = aguarded
        else:
            self.task = copy.copy(task)
            self.task.fn = guarded
