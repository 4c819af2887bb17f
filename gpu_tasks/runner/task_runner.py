"""ProfileTaskRunner: a Prefect task runner with one Dask cluster per resource profile. Final states
come back to the flow process, so closing an idle cluster loses nothing."""

from __future__ import annotations

import atexit
import concurrent.futures
import contextvars
import logging
import uuid
import weakref
from collections.abc import Iterable
from functools import partial
from pathlib import Path
from typing import Any

from prefect.exceptions import TerminationSignal
from prefect.futures import PrefectConcurrentFuture, PrefectFuture
from prefect.task_runners import TaskRunner

from gpu_tasks.cluster.kinds import placed_on_this_host
from gpu_tasks.cluster.local import ProfileCluster
from gpu_tasks.errors import ProfileError, UnknownProfileError, UnsatisfiableProfileError
from gpu_tasks.policy import unsatisfiable_reason
from gpu_tasks.prefect_api import environment as _environment
from gpu_tasks.prefect_api.api import ephemeral_api_url
from gpu_tasks.prefect_api.futures import pending_futures, when_all_done
from gpu_tasks.prefect_api.server import wait_until_flow_run_recorded
from gpu_tasks.profiles import (
    DEFAULT_PROFILE,
    ResourceProfile,
    load_profiles_file,
    profile,
    profile_sources,
    requested_profile,
    resolve_profiles,
)
from gpu_tasks.profiles.tags import unknown_profile_fix
from gpu_tasks.reporting.alerts import AlertThresholds
from gpu_tasks.reporting.artifacts import publish_run_artifacts
from gpu_tasks.reporting.events import emit_run_summary
from gpu_tasks.reporting.ledger import LedgerRow, remember_ended
from gpu_tasks.reporting.logs import flow_logger
from gpu_tasks.runner.admission import Admission, TaskQuota
from gpu_tasks.runner.controller import Controller
from gpu_tasks.runner.ctrl_c import held_while_closing, interrupted, on_interrupt
from gpu_tasks.runner.job import Arrived, Job, ProfileState
from gpu_tasks.runner.results import Landings, Results
from gpu_tasks.runner.session import Live
from gpu_tasks.settings import get_settings, resolve, variable_warnings
from gpu_tasks.worker import engine as _worker
from gpu_tasks.worker.slots import waiting

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_PROFILE", "FALLBACK_TAG", "ProfileFuture", "ProfileTaskRunner"]

FALLBACK_TAG = "gpu-tasks:fallback"


class ProfileFuture(PrefectConcurrentFuture[Any]):
    """A Prefect future for a task run on a profile's cluster: its ``concurrent.futures.Future``
    resolves to the task's final Prefect state once that is back in the flow process."""

    def __init__(self, task_run_id: uuid.UUID, wrapped_future: concurrent.futures.Future[Any], profile: str):
        super().__init__(task_run_id=task_run_id, wrapped_future=wrapped_future)
        self.profile = profile

    def _block(self, timeout: float | None) -> float | None:
        """Wait here, leaving this thread's task slot to others meanwhile; returns the timeout left."""
        if self.wrapped_future.done():
            return timeout
        with waiting():  # a parent task waiting for its child must not hold the child's slot
            concurrent.futures.wait([self.wrapped_future], timeout=timeout)
        return timeout if self.wrapped_future.done() or timeout is None else 0

    def wait(self, timeout: float | None = None) -> None:
        super().wait(self._block(timeout))

    def result(self, timeout: float | None = None, raise_on_failure: bool = True) -> Any:
        return super().result(timeout=self._block(timeout), raise_on_failure=raise_on_failure)


_LIVE_RUNNERS: weakref.WeakSet[ProfileTaskRunner] = weakref.WeakSet()
_WARNED: set[str] = set()  # the GPU_TASKS_* variables (unknown, old names) this process warned about


def _check_settings() -> None:
    """Raise for a bad ``GPU_TASKS_*`` value; warn once per process of each unknown or old name."""
    settings = get_settings()
    if settings.emulated_gpus is not None:
        from gpu_tasks.devices.discovery import parse_emulated

        parse_emulated(settings.emulated_gpus)
    if _worker.in_worker_process():  # the flow process warned; its workers get its environment
        return
    for line in variable_warnings():
        if line not in _WARNED:
            _WARNED.add(line)
            logger.warning("gpu-tasks: %s", line)


@atexit.register
def _close_leftovers() -> None:  # pragma: no cover - interpreter exit
    for runner in list(_LIVE_RUNNERS):
        try:
            runner._shutdown("interpreter exit")
        except Exception:
            logger.warning("gpu-tasks: error closing clusters at exit", exc_info=True)


class ProfileTaskRunner(TaskRunner[ProfileFuture]):
    """Runs each task on the Dask cluster of its resource profile.

    Args:
        profiles: The profiles tasks may name with ``profile:<name>`` tags; those from
            ``GPU_TASKS_PROFILES_FILE`` are added and override same-named ones.
        default: Profile of untagged tasks (default: the file's ``default``, else ``"cpu"``,
            added as a plain CPU profile when no profile has that name).
        idle_timeout: Seconds a cluster may sit idle before it is closed, for profiles
            that do not set their own; ``None`` takes ``GPU_TASKS_IDLE_TIMEOUT``.

    Profiles, file and ``GPU_TASKS_*`` settings are checked when the runner is built.
    """

    def __init__(
        self,
        profiles: Iterable[ResourceProfile] | None = None,
        default: str | None = None,
        idle_timeout: float | None = None,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # Prefect leaves TaskRunner.__init__ unannotated
        self._profiles_arg: tuple[ResourceProfile, ...] = tuple(profiles or ())
        for p in self._profiles_arg:
            if not isinstance(p, ResourceProfile):
                raise ProfileError(f"profiles must be ResourceProfile objects; got {p!r}")
        names = [p.name for p in self._profiles_arg]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ProfileError(f"profiles must have distinct names; {', '.join(dupes)} given more than once")
        self._default_arg = default
        if idle_timeout is not None and idle_timeout < 0:
            raise ProfileError(f"idle_timeout must be >= 0 seconds; got {idle_timeout}")
        self._idle_timeout_arg = idle_timeout
        if not self.__dict__.pop("_unpickled", False) and not _worker.in_worker_process():
            # a bad setting, profiles file, default or on_oom fails as the flow module builds its runner
            _check_settings()
            self.resolve_profiles()
        self._live: Live | None = None
        self._admission: Admission | None = None
        self._last_ledger: list[LedgerRow] = []
        self._fallbacks_said: set[tuple[str, str]] = set()  # (task name, profile asked for), this run
        _environment.check_ephemeral()  # Prefect starts its ephemeral server before entering a runner

    @property
    def idle_timeout(self) -> float:
        """The runner-wide idle timeout (argument, else GPU_TASKS_IDLE_TIMEOUT)."""
        return float(resolve(self._idle_timeout_arg, "idle_timeout"))

    def resolve_profiles(
        self, path: Path | None = None, origin: str = ""
    ) -> tuple[dict[str, ResourceProfile], str]:
        """The profiles in force (code, then ``path`` or GPU_TASKS_PROFILES_FILE) and the default
        name; ``origin`` names where ``path`` came from."""
        if path is None:
            path, origin = get_settings().profiles_file, "GPU_TASKS_PROFILES_FILE"
        return resolve_profiles(self._profiles_arg, self._default_arg, path, origin)

    def _args(self) -> dict[str, Any]:
        args = self._profiles_arg, self._default_arg, self._idle_timeout_arg
        return dict(zip(("profiles", "default", "idle_timeout"), args, strict=True))

    def duplicate(self) -> ProfileTaskRunner:
        # Prefect duplicates the runner as a flow run starts, outside its own error handling: a bad
        # setting or profiles file raised here left the run Running for good (a new-user pass, Prefect
        # 3.9.1). The copy checks them at the run's first task (_ensure_live), which fails the run.
        runner = type(self).__new__(type(self))
        runner.__setstate__(self._args())
        # the object the flow was built with reports its latest flow run: it said "absent" and had no
        # ledger, as Prefect runs a copy (a new-user pass)
        self._latest = runner
        return runner

    def _view(self) -> ProfileTaskRunner:
        """This runner, or, for one no flow run runs itself, the copy its latest flow run ran with."""
        latest: ProfileTaskRunner | None = self.__dict__.get("_latest")
        return latest._view() if self._live is None and latest is not None else self

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProfileTaskRunner) and self._args() == other._args()

    __hash__ = object.__hash__

    def __getstate__(self) -> dict[str, Any]:
        return self._args()  # Prefect pickles the flow (and so this runner) into every remote task's context

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._unpickled = True  # in a worker: its flow process checked the settings and profiles (a
        # flow run's copy, duplicate(): at its first task)
        self.__init__(**state)  # type: ignore[misc]  # rebuilt from its pickled arguments

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        try:
            if exc_type is not None and interrupted(exc_type):
                states = list(self._live.states.values()) if self._live is not None else []  # sizes only
                on_interrupt(sum(len(st.inflight) for st in states), [st.profile.name for st in states])
            reason = "flow run ended" if exc_type is None else f"flow run ended with {exc_type.__name__}"
            # a task run that had not run (waiting for devices) ends as its flow run: Failed it read as an
            # error of its own (a new-user pass cancelled a run and counted it among the failures)
            # ... and Cancelled when the flow returned without waiting for it (Prefect's own runners
            # cancel such a task: it had no task run; a wait for devices now gives it one)
            tasks_end = (
                "Cancelled"
                if exc_type is None
                else "Failed"
                if issubclass(exc_type, Exception)
                else "Crashed"
            )
            if exc_type is not None and issubclass(exc_type, TerminationSignal) and self._was_cancelled():
                reason, tasks_end = "flow run cancelled", "Cancelled"
            with held_while_closing():  # a Ctrl-C half-way through the close left warm processes running
                self._shutdown(reason, hurry=exc_type is not None, tasks_end=tasks_end)
        finally:
            super().__exit__(exc_type, exc_value, traceback)

    def _was_cancelled(self) -> bool:
        """Whether the SIGTERM that stops the flow run is a Prefect worker's cancel (asked of the server)."""
        live = self._live
        return live is not None and live.api_answers() and live.cancelled()

    def _shutdown(self, reason: str, hurry: bool = False, tasks_end: str = "Failed") -> None:
        live, self._live, self._admission = self._live, None, None
        _LIVE_RUNNERS.discard(self)
        if live is not None:
            live.close(reason, hurry=hurry, tasks_end=tasks_end)
            self._last_ledger = list(live.ledger)
            remember_ended(live.flow_run_id, self._last_ledger)
            if not hurry or live.api_answers():  # not to a server gone with the Ctrl-C (a minute of retries)
                publish_run_artifacts(self._last_ledger, live.flow_run_id)
                live.in_run_context(
                    emit_run_summary,
                    self._last_ledger,
                    live.run,
                    AlertThresholds.from_settings(live.settings),
                    live.priorities(),
                )
            if not hurry and self._last_ledger and ephemeral_api_url() is not None and live.api_answers():
                # Prefect stops its ephemeral server as this process exits: its task-run recorder
                # gets to the workers' last state events first (docs/runner.md, "Leaving the flow")
                live.in_run_context(wait_until_flow_run_recorded, live.flow_run_id)

    def _log_profile_sources(self, profiles: dict[str, ResourceProfile]) -> None:
        """Say in the run log which profiles the file gave and which settings changed a profile."""
        settings = get_settings()
        path = settings.profiles_file
        from_file = load_profiles_file(path, "GPU_TASKS_PROFILES_FILE")[0] if path is not None else {}
        info, warnings = profile_sources(
            self._profiles_arg, profiles, path, from_file, self._idle_timeout_arg, settings
        )
        for line in info:
            logger.info("gpu-tasks: %s", line)
        for line in warnings:
            logger.warning("gpu-tasks: %s", line)

    def _ensure_live(self) -> tuple[Live, Admission]:
        if not self._started:
            raise RuntimeError("The task runner must be started before submitting work.")
        if self._live is None or self._admission is None:
            _check_settings()
            profiles, default = self.resolve_profiles()
            self._fallbacks_said.clear()
            landings = Landings(lambda land, value, error: land(value, error), name="gpu-tasks-results")
            live = Live(profiles, default, self.idle_timeout, close_results=landings.close)
            self._log_profile_sources(profiles)  # once Live sends the runner's lines to the run's logs
            quota = TaskQuota(live)
            results = Results(live, landings, quota.release)
            self._admission = Admission(live, results)
            live.start(partial(Controller, live=live, results=results, quota=quota))
            self._live = live
            _LIVE_RUNNERS.add(self)
        return self._live, self._admission

    def _route(self, live: Live, task: Any) -> tuple[ResourceProfile, str, str | None]:
        """The profile to run on, the profile asked for, and why they differ (fallback) if so."""
        name = requested_profile(task) or live.default
        prof = live.profiles.get(name)
        if prof is None:
            raise UnknownProfileError(
                f"task {task.name!r} asks for profile {name!r}, which this runner does not know; known "
                f"profiles: {', '.join(sorted(live.profiles))}. {unknown_profile_fix(name, live.profiles)}"
            )
        # an address or cluster_class profile's workers are checked when its cluster starts
        reason = (
            unsatisfiable_reason(prof, live.inventory) if prof.is_gpu and placed_on_this_host(prof) else None
        )
        if reason is None:
            return prof, name, None
        if prof.fallback == "cpu":
            return live.profiles[live.default], name, reason
        if not live.inventory.devices:  # a host with no GPU (and no emulation asked for)
            from gpu_tasks.devices.emulation import no_gpu_hint

            raise UnsatisfiableProfileError(f"task {task.name!r} cannot run: {reason}. {no_gpu_hint()}")
        # the reason ends with its fix
        raise UnsatisfiableProfileError(
            f"task {task.name!r} cannot run: {reason}, or set fallback='cpu' on the profile"
        )

    def submit(
        self,
        task: Any,
        parameters: dict[str, Any],
        wait_for: Iterable[PrefectFuture[Any]] | None = None,
        dependencies: dict[str, set[Any]] | None = None,
    ) -> ProfileFuture:
        """Submit a task to its profile's cluster; returns at once with a future."""
        if _worker.in_worker_process():  # called by a task running in one of our worker processes
            _, default = self.resolve_profiles()
            task_run_id, cf, here = _worker.submit_nested(task, parameters, wait_for, dependencies, default)
            return ProfileFuture(task_run_id, cf, profile=here)
        live, admission = self._ensure_live()
        prof, requested, fallback_reason = self._route(live, task)
        extra_tags = [profile(prof.name)]
        if fallback_reason is not None:
            extra_tags.append(FALLBACK_TAG)
            if (task.name, requested) not in self._fallbacks_said:  # once, not once per task run of a map
                self._fallbacks_said.add((task.name, requested))
                flow_logger().warning(
                    "Task %r asks for profile %r, which cannot be satisfied (%s); running it on CPU profile "
                    "%r because the profile sets fallback='cpu' (said once for this task in this flow run; "
                    "each such task run has the tag %s)",
                    task.name,
                    requested,
                    fallback_reason,
                    prof.name,
                    FALLBACK_TAG,
                )
        st = live.state(prof)
        st.post(Arrived())  # counted by its controller; nothing here waits for another thread
        job = Job(
            st=st,
            task=task,
            task_run_id=uuid.uuid4(),
            parameters=parameters,
            wait_for=wait_for,
            dependencies=dependencies,
            extra_tags=extra_tags,
            cf=concurrent.futures.Future(),
            ctx=contextvars.copy_context(),
        )
        future = ProfileFuture(job.task_run_id, job.cf, profile=prof.name)
        upstream = pending_futures((parameters, list(wait_for or ())))
        if upstream:
            when_all_done(upstream, partial(admission.admit, job))
        else:
            admission.admit(job)  # GPU: cache and tag slots before devices; then its controller
        return future

    def status(self) -> dict[str, dict[str, Any]]:
        """Each profile's state (``absent``, ``running``, ``closed``), workers and devices."""
        if (view := self._view()) is not self:
            return view.status()
        live = self._live
        if live is None:
            profiles, _ = self.resolve_profiles()
            return {name: _status_row("absent", p, None, None) for name, p in profiles.items()}
        out = {}
        for name, prof in live.profiles.items():
            st = live.states.get(name)
            if st is None or not st.ever_provisioned:
                out[name] = _status_row("absent", prof, None, st)
            elif st.cluster.running:
                out[name] = _status_row("running", prof, st.cluster, st)
            else:
                out[name] = dict(_status_row("closed", prof, None, st), emulated=st.cluster.emulated)
        return out

    def warm_workers(self) -> list[dict[str, Any]]:
        """The warm pool's idle worker processes, each ``{"pid": ..., "ready": ...}`` (none holds a
        device); empty when there is no pool."""
        if (view := self._view()) is not self:
            return view.warm_workers()
        live = self._live
        if live is None or live.pool is None:
            return []
        return list(live.pool.describe())

    @property
    def ledger(self) -> list[LedgerRow]:
        """Closed cluster lifetimes so far (the ledger of the last run after exit)."""
        if (view := self._view()) is not self:
            return view.ledger
        return list(self._live.ledger if self._live is not None else self._last_ledger)


def _status_row(
    state: str, prof: ResourceProfile, cluster: ProfileCluster | None, st: ProfileState | None
) -> dict[str, Any]:
    return {
        "state": state,
        "gpus": prof.gpus,
        "workers": cluster.worker_count if cluster else 0,
        "devices": list(cluster.devices) if cluster else [],
        "emulated": bool(cluster and cluster.emulated),
        "outstanding": st.outstanding if st else 0,
        "dashboard": cluster.dashboard_link if cluster else None,
        # seconds the last start spent waiting for devices and starting workers
        "startup": dict(cluster.startup) if cluster else {},
        # tasks waiting for Prefect tag slots now (no device held), and answered from cache
        "waiting_for_slots": st.waiting_for_slots if st else 0,
        "cache_hits": st.cache_hits if st else 0,
    }
