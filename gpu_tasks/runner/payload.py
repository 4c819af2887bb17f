"""The flow run's Prefect context, serialized for task runs in worker processes: like Prefect's
``serialize_context``, but the costly settings and result store are dumped once per flow run."""

from __future__ import annotations

import uuid
from typing import Any

from gpu_tasks.compat.prefect import context_for_workers
from gpu_tasks.errors import GpuTasksError
from gpu_tasks.prefect_api.api import for_workers
from gpu_tasks.worker.blobs import Blob, Blobs


class ContextSerializer:
    """Prefect's ``serialize_context``, with the settings serialized once per settings context
    (``temporary_settings`` enters a new one); the rest for every task, as Prefect does."""

    def __init__(self) -> None:
        self.api_url: str | None = None  # the flow run's API: workers report there, never to their own
        self._settings: tuple[Any, dict[str, Any], str] | None = None
        self._result_store: tuple[Any, dict[str, Any]] | None = None
        self.blobs = Blobs()  # pickled once per runner: the flow run's context, its tasks
        self._flow_runs: dict[int, tuple[Any, Any, Blob]] = {}  # id(ctx) -> (ctx, its flow run, blob)
        self._deployments: dict[int, tuple[Any, tuple[Any, Any]]] = {}  # id(ctx) -> (ctx, (id, parameters))

    def serialize(self, asset_ctx_kwargs: dict[str, Any] | None = None) -> tuple[dict[str, Any], str]:
        """The serialized context, and a key that names its settings (equal keys, equal settings)."""
        from prefect import context as pctx

        settings_ctx = pctx.SettingsContext.get()
        flow_run_ctx = pctx.EngineContext.get()
        task_run_ctx = pctx.TaskRunContext.get()
        tags_ctx = pctx.TagsContext.get()
        deployment_id, deployment_parameters, dumped = self._deployment(flow_run_ctx)
        cached = self._settings
        if cached is None or cached[0] is not settings_ctx:
            # the settings _deployment()'s serialize_context() just dumped, else dumped here
            serialized = dumped if dumped is not None else (settings_ctx.serialize() if settings_ctx else {})
            if self.api_url is not None:
                serialized = for_workers(serialized, self.api_url)
            cached = self._settings = (settings_ctx, serialized, uuid.uuid4().hex)
        context = context_for_workers(
            flow_run_context=self._flow_run_blob(flow_run_ctx) if flow_run_ctx else {},
            task_run_context=task_run_ctx.serialize() if task_run_ctx else {},
            tags_context=tags_ctx.serialize() if tags_ctx else {},
            settings_context=self.blobs.blob(cached[1]),
            asset_context=(
                pctx.AssetContext.from_task_and_inputs(**asset_ctx_kwargs).serialize()
                if asset_ctx_kwargs
                else {}
            ),
            deployment_id=deployment_id,
            deployment_parameters=deployment_parameters,
        )
        return context, cached[2]

    def _flow_run_blob(self, ctx: Any) -> Blob:
        """The flow run context, serialized and pickled once per flow run: its tasks see it as it was
        when the first of them was handed off."""
        made = self._flow_runs.get(id(ctx))
        if made is None or made[0] is not ctx or made[1] is not ctx.flow_run:
            try:
                blob = self.blobs.blob(self._flow_run(ctx), "flow_run_context")
            except Exception as exc:  # cloudpickle: TypeError, PicklingError, AttributeError
                name = getattr(ctx.flow, "name", "?")
                raise GpuTasksError(
                    f"the context of flow {name!r} cannot be pickled for its workers "
                    f"({type(exc).__name__}: {exc}); a flow defined in a script is pickled with the "
                    "module-level names its body uses: keep futures, locks, clients and open files "
                    "out of those names, or define the flow in an importable module"
                ) from exc
            made = _keep(self._flow_runs, ctx, (ctx, ctx.flow_run, blob))
        return made[2]

    def _deployment(self, ctx: Any) -> tuple[Any, Any, dict[str, Any] | None]:
        """The deployment id and parameters, from one ``serialize_context`` call per flow run context;
        third, the settings that call dumped, or ``None`` where nothing was called now."""
        from prefect.context import serialize_context

        made = self._deployments.get(id(ctx)) if ctx is not None else None
        if made is not None and made[0] is ctx:
            return (*made[1], None)
        full = serialize_context()
        made = (ctx, (full["deployment_id"], full["deployment_parameters"]))
        if ctx is not None:
            _keep(self._deployments, ctx, made)
        return (*made[1], full["settings_context"])

    def _flow_run(self, ctx: Any) -> dict[str, Any]:
        """``ctx.serialize()``, with its result store (a block: costly to dump) dumped once per store."""
        store = ctx.result_store
        if store is None:
            return dict(ctx.serialize())
        serialized: dict[str, Any] = ctx.model_copy(update={"result_store": None}).serialize()
        cached = self._result_store
        if cached is None or cached[0] is not store:
            dumped = store.model_dump(
                serialize_as_any=True, exclude_unset=True, context={"include_secrets": True}
            )
            cached = self._result_store = (store, dumped)
        serialized["result_store"] = cached[1]
        return serialized


def _keep(cache: dict[int, Any], ctx: Any, made: Any) -> Any:
    """``made``, kept as ``cache[id(ctx)]`` (the cache is emptied at 8 entries)."""
    if len(cache) >= 8:
        cache.clear()
    cache[id(ctx)] = made
    return made
