"""The flow process's side: Prefect's ``TaskRunner`` and what one flow run owns while it runs.

``task_runner`` (ProfileTaskRunner) -> ``session`` (one flow run's profiles and jobs) ->
``admission`` (before a device: cache hit, tag slots) -> ``controller`` (to a profile's cluster) ->
``results`` (finished tasks' results) -> ``recovery`` (crashed workers, OOM, preemption).
"""

from gpu_tasks.runner.task_runner import ProfileFuture, ProfileTaskRunner

__all__ = ["ProfileFuture", "ProfileTaskRunner"]
