"""Waiting without a device: device-seconds held by tasks that wait for a concurrency slot or are
answered from Prefect's cache, through ProfileTaskRunner, a static Dask cluster and Ray.

    python -m bench.waits [--repeats 3] [--seconds 2.0] [--json out.json]

Two scenarios on two emulated devices, each through three runners in the same run:

- **slot wait**: a Prefect tag concurrency limit of 1 (created on the bench's server
  before the flow, deleted after) on a tag of this run; two whole-GPU tasks with that tag
  submitted together, each body sleeping ``--seconds``. Two devices are free (the gpu-tasks
  profile has ``max_workers=2``), but only one task may run at a time, so the other waits
  for its slot;
- **cache hit**: a whole-GPU task with ``cache_policy=INPUTS`` and persisted results, run in
  a first flow run (the cache filled), then called with the same inputs in a second flow
  run, where Prefect answers it from the cache (its state must be ``Cached``).

The runners: ``ProfileTaskRunner`` (a ``gpus=1`` profile), the static ``DaskTaskRunner`` of
bench/held_busy.py (a worker per device with a ``GPU`` resource, tasks routed with
``dask.annotate``) and prefect-ray's ``RayTaskRunner`` on a local Ray cluster with 3 CPUs
and the 2 devices as its GPUs (tasks under ``remote_options(num_gpus=1)``; skipped, with the
reason, without the ``bench`` extra).

Devices held by tasks are read as each runner accounts for them, from the flow process:

- ProfileTaskRunner: the device lease book (``gpu_tasks.devices.leases.holders()``, leases of this
  process) and ``runner.status()`` (tasks waiting for slots, workers), sampled every 20 ms;
- static Dask cluster: Dask's task stream, the worker-side interval each task ran on its GPU
  worker (Prefect's whole task engine run there, its slot wait included): while that runs
  the task holds the worker's ``GPU`` resource;
- Ray: the GPUs Ray has given to tasks, ``num_gpus - ray.available_resources()["GPU"]``,
  sampled every 20 ms (Ray's view of free resources lags by up to its resource report
  interval, so short holds are seen late or not at all).

Device-seconds held while waiting for a slot: with a limit of 1 one task may run at a time, so
the work can use one device at any moment; the devices tasks held beyond that one, integrated
from the submit to the waiting task's body start, were held for the task waiting for its slot
(on Dask and Ray, the second task sits on the second GPU for the first task's whole run). The
one device is not counted whoever holds it: the first task's worker start-up and the hand-off
(the first task's end, the slot given back and granted, the second task reaching its body) cost
device time on every runner, but as held_busy measures, not as a wait; on Dask and Ray the
waiting task holds that one device during the hand-off itself, which is therefore left out of
their figure (it is in ``handoff_s``: first body's end to second body's start).

The slot wait itself, so the reader sees the wait happened: ProfileTaskRunner waits in the
flow process, the time ``runner.status()`` showed a task waiting for slots (from the submit:
the first task's worker start included); on Dask and Ray,
Prefect's task engine waits on the worker, between the task run's ``Pending`` state (created
there) and ``Running`` (set once the slots are taken), both read back from the Prefect server.

Cache hit: the device-seconds held from the cached task's submit to its result (same sources
as above), and the GPU workers started for it: ProfileTaskRunner, the profile's workers in the
second flow run (its ledger and ``status()``); the static cluster, its GPU workers, started
for the flow whether or not a task needs them (it holds its devices all along anyway, as Ray's
local cluster does from ``ray.init``); Ray, its worker processes started while the cached task
ran. Emulated devices: task bodies are ``time.sleep``, so this measures scheduling, not GPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import RAY, machine, ray_skipped, setup, spread, write_json
from bench.held_busy import PROFILE, STATIC, _work, static_cluster

EVERY_S = 0.02  # the flow-process sampler's period
N_GPUS = 2

Steps = list[tuple[float, int]]  # a step function: (from this time, this many)


# ---------------------------------------------------------------- step functions
def steps_from_intervals(intervals: list[tuple[float, float]]) -> Steps:
    """How many of ``intervals`` cover each moment, as a step function."""
    edges = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    out: Steps = []
    n = 0
    for t, d in edges:
        n += d
        out.append((t, n))
    return out


def value_at(steps: Steps, t: float) -> int:
    """The step function's value at ``t`` (0 before its first step)."""
    v = 0
    for at, n in steps:
        if at > t:
            break
        v = n
    return v


def excess_seconds(held: Steps, need: Steps, start: float, end: float) -> float:
    """The integral over [start, end] of max(0, held - need): device-seconds held beyond ``need``."""
    cuts = sorted({start, end, *(t for t, _ in held + need if start < t < end)})
    return sum(
        max(0, value_at(held, a) - value_at(need, a)) * (b - a) for a, b in zip(cuts, cuts[1:], strict=False)
    )


def most(steps: Steps, start: float, end: float) -> int:
    """The most the step function reaches in [start, end]."""
    return max([value_at(steps, start)] + [n for t, n in steps if start <= t <= end])


# ---------------------------------------------------------------- what each runner holds
class Probe:
    """Devices held by tasks, as one runner accounts for them, seen from the flow process.

    Made inside the flow (from its entered runner); a thread samples every ``EVERY_S``
    between :meth:`start` and :meth:`stop`. :meth:`held` is the step function afterwards.
    """

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-waits-probe", daemon=True)

    def sample(self) -> dict[str, int]:
        return {}

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), self.sample()))
            self._stop.wait(EVERY_S)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.samples.append((time.time(), self.sample()))
        self._stop.set()
        self._thread.join()
        self.samples.append((time.time(), self.sample()))

    def series(self, key: str) -> Steps:
        return [(t, s.get(key, 0)) for t, s in self.samples]

    def held(self) -> Steps:
        return self.series("held")

    def seconds_where(self, key: str) -> float:
        """How long the sampled ``key`` was positive."""
        s = self.samples
        return sum(b[0] - a[0] for a, b in zip(s, s[1:], strict=False) if a[1].get(key, 0) > 0)

    def workers_started(self) -> int:
        return max((s.get("workers", 0) for _, s in self.samples), default=0)

    def changes(self, t0: float) -> list[tuple[float, dict[str, int]]]:
        """The samples where something changed: (seconds since ``t0``, sample)."""
        out: list[tuple[float, dict[str, int]]] = []
        for t, s in self.samples:
            if not out or out[-1][1] != s:
                out.append((round(t - t0, 3), s))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {}


def counted(runner: Any, name: str = "gpu", timeout: float = 10.0) -> dict[str, Any]:
    """``runner.status()[name]`` once the profile's owner counted every task whose future resolved
    (``outstanding`` 0): a future does not wait for that, so its counts may lag a moment
    (docs/runner.md); as it is after ``timeout``."""
    deadline = time.monotonic() + timeout
    while (row := runner.status()[name])["outstanding"] and time.monotonic() < deadline:
        time.sleep(0.02)
    return dict(row)


class ProfileProbe(Probe):
    """ProfileTaskRunner: this process's device leases (the lease book) and ``status()``."""

    def __init__(self, runner: Any) -> None:
        super().__init__(runner)
        self.devices: set[str] = set()

    def sample(self) -> dict[str, int]:
        from gpu_tasks.devices import leases

        mine = [a for a, info in leases.holders().items() if info and info.get("pid") == os.getpid()]
        self.devices.update(mine)
        row = self.runner.status().get("gpu", {})
        return {
            "held": len(mine),
            "waiting": row.get("waiting_for_slots", 0),
            "outstanding": row.get("outstanding", 0),
            "workers": row.get("workers", 0),
            "cache_hits": row.get("cache_hits", 0),
        }

    def stop(self) -> None:
        """The last sample once the profile's owner counted every finished task (:func:`counted`)."""
        counted(self.runner)
        super().stop()

    def to_dict(self) -> dict[str, Any]:
        last = self.samples[-1][1] if self.samples else {}
        return {"leased_devices": sorted(self.devices), "cache_hits": last.get("cache_hits", 0)}


class DaskProbe(Probe):
    """The static Dask cluster: its task stream (worker-side intervals on the GPU workers)."""

    def __init__(self, runner: Any) -> None:
        super().__init__(runner)
        from distributed import get_task_stream

        self.client = runner.client  # prefect-dask's client (its cluster starts at the first use)
        self.client.wait_for_workers(N_GPUS + 1)  # the CPU worker and one per GPU
        self._stream = get_task_stream(client=self.client)
        self._stream.__enter__()  # from here on the scheduler records every task's run
        info = self.client.scheduler_info()["workers"]
        self.gpu_workers = {addr for addr, w in info.items() if w.get("resources", {}).get("GPU")}

    def stop(self) -> None:
        super().stop()
        self._stream.__exit__(None, None, None)
        self.intervals = [
            (ss["start"], ss["stop"])
            for rec in self._stream.data
            if rec["worker"] in self.gpu_workers
            for ss in rec["startstops"]
            if ss["action"] == "compute"
        ]

    def held(self) -> Steps:
        return steps_from_intervals(self.intervals)

    def workers_started(self) -> int:
        return len(self.gpu_workers)


class RayProbe(Probe):
    """Ray: GPUs given to tasks, and its worker processes (started below this process)."""

    def __init__(self, runner: Any) -> None:
        super().__init__(runner)
        self.workers: set[int] = set()
        self._before = self._ray_workers()
        self._n = 0

    @staticmethod
    def _ray_workers() -> set[int]:
        import psutil

        out = set()
        for p in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                cmd = " ".join(p.cmdline())
                if cmd.startswith("ray::") or "default_worker.py" in cmd:  # named ray::<task> once started
                    out.add(p.pid)
        return out

    def sample(self) -> dict[str, int]:
        import ray

        self._n += 1
        if self._n % 5 == 0:  # a process scan costs more than a resource read
            self.workers |= self._ray_workers() - self._before
        return {"held": round(N_GPUS - ray.available_resources().get("GPU", 0))}

    def workers_started(self) -> int:
        return len(self.workers | (self._ray_workers() - self._before))


# ---------------------------------------------------------------- the runners
def _runner(name: str) -> tuple[Any, Callable[[], contextlib.AbstractContextManager[Any]], type[Probe]]:
    """A fresh runner for one flow run, how its GPU tasks are routed, and its probe."""
    if name == PROFILE:
        from gpu_tasks import ProfileTaskRunner, ResourceProfile

        gpu = ResourceProfile(name="gpu", gpus=1, max_workers=N_GPUS, idle_timeout=30)
        return ProfileTaskRunner(profiles=[gpu]), contextlib.nullcontext, ProfileProbe
    if name == STATIC:
        import dask
        from prefect_dask import DaskTaskRunner

        runner = DaskTaskRunner(cluster_class=static_cluster, cluster_kwargs={"n_gpus": N_GPUS})
        return runner, lambda: dask.annotate(resources={"GPU": 1}), DaskProbe
    from bench.ray_peer import local_ray, remote_options

    return local_ray(num_cpus=N_GPUS + 1, num_gpus=N_GPUS), lambda: remote_options(num_gpus=1), RayProbe


def _tags(name: str, *tags: str) -> list[str]:
    from gpu_tasks import profile

    return [profile("gpu"), *tags] if name == PROFILE else list(tags)


def _in_flow(name: str, flow_name: str, submit: Callable[..., list[Any]]) -> dict[str, Any]:
    """Run ``submit(route)`` (it submits tasks, returns their futures) in a flow on a fresh
    runner ``name``, its probe sampling from just before the submit to the last result."""
    from prefect import flow
    from prefect.context import FlowRunContext

    runner, route, probe_cls = _runner(name)

    @flow(task_runner=runner, name=flow_name)
    def f() -> dict[str, Any]:
        probe = probe_cls(FlowRunContext.get().task_runner)
        probe.start()
        t0 = time.time()
        futures = submit(route)
        results = [fu.result() for fu in futures]
        t1 = time.time()
        probe.stop()
        return {
            "t0": t0,
            "t1": t1,
            "results": results,
            "task_run_ids": [str(fu.task_run_id) for fu in futures],
            "states": [fu.state.name for fu in futures],
            "probe": probe,  # returned, not kept in a global: prefect-dask pickles the flow
        }

    return f()


def _state_times(task_run_id: str, timeout: float = 30.0) -> dict[str, float]:
    """When the task run first entered each state (epoch seconds), read back from the server
    once a final state is there (the engine's states reach it as events, a moment later)."""
    from prefect import get_client

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            states = sorted(client.read_task_run_states(uuid.UUID(task_run_id)), key=lambda s: s.timestamp)
            times: dict[str, float] = {}
            for s in states:
                times.setdefault(s.name, s.timestamp.timestamp())
            if any(k in times for k in ("Completed", "Cached", "Failed", "Crashed")):
                return times
            if time.monotonic() > deadline:
                raise RuntimeError(f"task run {task_run_id}: no final state on the server, only {times}")
            time.sleep(0.25)


@contextlib.contextmanager
def tag_limit(tag: str, limit: int = 1) -> Any:
    """A Prefect tag concurrency limit (``tag:<tag>``) on the server, deleted afterwards."""
    from prefect import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    name = f"tag:{tag}"
    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=limit))
    try:
        yield name
    finally:
        with get_client(sync_client=True) as client:
            client.delete_global_concurrency_limit_by_name(name)


# ---------------------------------------------------------------- slot wait
def slot_wait(name: str, seconds: float) -> dict[str, Any]:
    """Two whole-GPU tasks under a tag limit of 1, submitted together; see the module doc."""
    from prefect import task

    tag = f"bench-waits-{uuid.uuid4().hex[:8]}"
    work = task(_work, name="slot-wait", tags=_tags(name, tag))

    def submit(route: Callable[[], contextlib.AbstractContextManager[Any]]) -> list[Any]:
        with route():
            return [work.submit("slot", i, seconds) for i in range(2)]

    with tag_limit(tag):
        out = _in_flow(name, f"waits-slot-{name.split()[-1].lower()}", submit)
    probe: Probe = out["probe"]
    first, second = sorted(zip(out["results"], out["task_run_ids"], strict=True), key=lambda r: r[0]["start"])
    if second[0]["start"] < first[0]["end"] - 0.05:
        raise RuntimeError(f"{name}: both tasks ran at once; the tag limit did not hold: {out['results']}")
    missing = [r for r in out["results"] if not r["devices"]]
    if missing:
        raise RuntimeError(f"{name}: a task ran without a device: {missing}")
    held = probe.held()
    # one task at a time may run: one device is all the work can use while the other task waits
    waiting_s = excess_seconds(held, [(out["t0"], 1)], out["t0"], second[0]["start"])
    if name == PROFILE:
        slot_wait_s = probe.seconds_where("waiting")
    else:  # Prefect's engine waits on the worker: Pending (created there) to Running
        times = _state_times(second[1])
        slot_wait_s = times["Running"] - times["Pending"]
    return {
        "runner": name,
        "flow_s": out["t1"] - out["t0"],
        "slot_wait_s": slot_wait_s,
        "handoff_s": second[0]["start"] - first[0]["end"],
        "held_while_waiting_s": waiting_s,
        "devices_leased": most(held, out["t0"], out["t1"]),
        "first": first[0],
        "second": second[0],
        "t0": out["t0"],
        "ids": [first[1], second[1]],
        "samples": probe.changes(out["t0"]),
        **probe.to_dict(),
    }


# ---------------------------------------------------------------- cache hit
def _cached(x: int, salt: str) -> dict[str, Any]:
    """The cached task's body (runs in the first flow run only)."""
    return {"value": x * x, "pid": os.getpid(), "start": time.time()}


def cache_hit(name: str, storage: Path) -> dict[str, Any]:
    """A cached whole-GPU task: filled in one flow run, answered from the cache in the next."""
    from prefect import task
    from prefect.cache_policies import INPUTS

    cached = task(
        _cached,
        name="cached",
        tags=_tags(name),
        cache_policy=INPUTS,
        persist_result=True,
        result_storage=storage,  # a path: local files, readable by every worker on this machine
    )
    salt = uuid.uuid4().hex  # inputs of this run only: the first call misses, the second hits

    def submit(route: Callable[[], contextlib.AbstractContextManager[Any]]) -> list[Any]:
        with route():
            return [cached.submit(3, salt)]

    slug = name.split()[-1].lower()
    fill = _in_flow(name, f"waits-cache-fill-{slug}", submit)
    hit = _in_flow(name, f"waits-cache-hit-{slug}", submit)
    if fill["states"] != ["Completed"] or hit["states"] != ["Cached"]:
        raise RuntimeError(f"{name}: expected Completed then Cached, got {fill['states']}, {hit['states']}")
    if hit["results"] != fill["results"]:
        raise RuntimeError(f"{name}: the cached result differs: {fill['results']} vs {hit['results']}")
    probe: Probe = hit["probe"]
    held = probe.held()
    device_s = excess_seconds(held, [], hit["t0"], hit["t1"])
    workers = probe.workers_started()
    if name == PROFILE:
        ledger = [row for row in probe.runner.ledger if row.profile == "gpu"]
        workers += sum(row.workers for row in ledger)
    return {
        "runner": name,
        "device_s": device_s,
        "devices_leased": most(held, hit["t0"], hit["t1"]),
        "workers_started": workers,
        "hit_s": hit["t1"] - hit["t0"],
        **probe.to_dict(),
    }


# ---------------------------------------------------------------- run
SLOT_KEYS = ("slot_wait_s", "held_while_waiting_s", "devices_leased", "handoff_s", "flow_s")
CACHE_KEYS = ("device_s", "devices_leased", "workers_started", "hit_s")


def run(repeats: int, seconds: float) -> dict[str, Any]:
    """Both scenarios through every runner, ``repeats`` times, alternating, against one server."""
    from gpu_tasks.prefect_api.server import embedded_server

    skipped = ray_skipped()
    names = [n for n in (PROFILE, STATIC, RAY) if n not in skipped]
    slot: list[dict[str, Any]] = []
    cache: list[dict[str, Any]] = []
    storage = Path(tempfile.mkdtemp(prefix="gpu-tasks-bench-waits-"))  # the cached results
    with embedded_server():
        for i in range(repeats):
            for name in names:
                s = {**slot_wait(name, seconds), "repeat": i}
                c = {**cache_hit(name, storage), "repeat": i}
                slot.append(s)
                cache.append(c)
                print(
                    f"  {name:24s} slot wait {s['slot_wait_s']:5.2f}s, held while waiting "
                    f"{s['held_while_waiting_s']:5.2f} device-s, {s['devices_leased']} device(s); "
                    f"cache hit {c['device_s']:5.2f} device-s, {c['workers_started']} worker(s) started",
                    flush=True,
                )
    summary = {
        name: {
            "slot": {k: spread([float(r[k]) for r in slot if r["runner"] == name]) for k in SLOT_KEYS},
            "cache": {k: spread([float(r[k]) for r in cache if r["runner"] == name]) for k in CACHE_KEYS},
        }
        for name in names
    }
    return {
        "repeats": repeats,
        "seconds": seconds,
        "gpus": N_GPUS,
        "machine": machine(),
        "runs": {"slot": slot, "cache": cache},
        "summary": summary,
        "skipped": skipped,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0, help="each slot-wait task body's seconds")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    setup()
    write_json(args.json, run(args.repeats, args.seconds))


if __name__ == "__main__":
    main()
