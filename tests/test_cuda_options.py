"""A profile's ``cuda=`` options reach dask-cuda's ``LocalCUDACluster`` (docs/profiles.md, the
``cuda`` table), without a GPU.

The runner builds a ``LocalCUDACluster`` for devices that are real (not emulated) with one
device per worker. Two public switches get there on this machine:

- ``GPU_TASKS_DISCOVERY_COMMAND`` (a Spark-style discovery command) gives an inventory that
  is not emulated, so no NVML is needed;
- a stand-in ``dask_cuda`` package first on ``PYTHONPATH``: its ``LocalCUDACluster`` writes
  the keyword arguments it was built with to a file, then starts real worker processes the
  way dask-cuda does (a ``LocalCluster`` with no workers, then ``scale``, each worker spec
  from ``new_worker_spec``), so the runner's own per-device spec is exercised too.

The flow runs in a fresh interpreter: gpu-tasks caches whether a GPU library imports for
the life of a process, and the stand-in must never be seen by the other tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpu_tasks import ClusterError, ProfileTaskRunner, ResourceProfile, profile

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

# the parts of dask-cuda a warm worker uses (gpu_tasks.compat.dask_cuda.worker_options); each
# records what it was given, in which process, and which devices that process saw then
FAKE_MODULES = {
    "_record.py": textwrap.dedent(
        """
        import json, os

        def record(kind, **fields):
            fields.update(kind=kind, pid=os.getpid(), visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
                          rapids_no_initialize=os.environ.get("RAPIDS_NO_INITIALIZE"))
            with open(os.environ["FAKE_DASK_CUDA_WORKER_RECORD"], "a") as fh:
                fh.write(json.dumps(fields, default=repr) + "\\n")
        """
    ),
    "worker_common.py": textwrap.dedent(
        """
        from distributed.diagnostics.plugin import WorkerPlugin
        from ._record import record

        class Recorder(WorkerPlugin):
            name = "fake-dask-cuda"

            def __init__(self, kwargs):
                self.kwargs = kwargs

            def setup(self, worker):
                record("plugin", kwargs=self.kwargs)

        def worker_data_function(device_memory_limit=None, memory_limit=None, enable_cudf_spill=False):
            def data(device_index):
                record("data", device_index=device_index, device_memory_limit=device_memory_limit,
                       memory_limit=memory_limit, enable_cudf_spill=enable_cudf_spill)
                return {}
            return data

        def worker_plugins(**kwargs):
            return {Recorder(kwargs)}
        """
    ),
    "initialize.py": textwrap.dedent(
        """
        import click
        from ._record import record

        @click.command()
        @click.option("--create-cuda-context/--no-create-cuda-context", default=False)
        def dask_setup(worker, create_cuda_context):
            record("initialize", create_cuda_context=create_cuda_context)
        """
    ),
}

# cudf.set_option, which a profile with enable_cudf_spill calls in the flow process
FAKE_CUDF = textwrap.dedent(
    """
    from dask_cuda._record import record  # the stand-in beside it, on the same PYTHONPATH

    def set_option(name, value):
        record("cudf.set_option", name=name, value=value)
    """
)

FAKE_DASK_CUDA = textwrap.dedent(
    '''
    """Stand-in for dask-cuda: records LocalCUDACluster's arguments, then runs plain Dask workers."""
    import copy, json, os

    from distributed import LocalCluster

    from ._record import record

    record("import")

    class LocalCUDACluster(LocalCluster):
        def __init__(self, CUDA_VISIBLE_DEVICES=None, n_workers=None, threads_per_worker=1,
                     memory_limit="auto", protocol=None, rmm_pool_size=None, rmm_async=False,
                     enable_cudf_spill=False, **kwargs):
            record = dict(kwargs, CUDA_VISIBLE_DEVICES=CUDA_VISIBLE_DEVICES, n_workers=n_workers,
                          threads_per_worker=threads_per_worker, memory_limit=memory_limit,
                          protocol=protocol, rmm_pool_size=rmm_pool_size, rmm_async=rmm_async,
                          enable_cudf_spill=enable_cudf_spill)
            with open(os.environ["FAKE_DASK_CUDA_RECORD"], "a") as fh:
                fh.write(json.dumps(record, default=repr) + "\\n")
            self.cuda_visible_devices = [str(d) for d in CUDA_VISIBLE_DEVICES]
            # as dask-cuda does: no workers at first, then one per device through new_worker_spec
            super().__init__(n_workers=0, threads_per_worker=threads_per_worker, memory_limit=memory_limit,
                             processes=True, protocol="tcp", **kwargs)
            self.scale(n_workers)
            self.sync(self._correct_state)

        def new_worker_spec(self):
            name = min(set(self.cuda_visible_devices) - set(self.worker_spec))
            spec = copy.deepcopy(self.new_spec)
            i = self.cuda_visible_devices.index(name)
            rotated = self.cuda_visible_devices[i:] + self.cuda_visible_devices[:i]
            # every device, its own first
            spec["options"]["env"] = {"CUDA_VISIBLE_DEVICES": ",".join(rotated)}
            return {name: spec}
    '''
)

DISCOVER = 'import json; print(json.dumps({"name": "gpu", "addresses": ["0", "1"]}))\n'

FLOW = textwrap.dedent(
    """
    import json, multiprocessing, os, sys, time
    from prefect import flow, task
    from prefect.context import FlowRunContext
    from gpu_tasks import CudaOptions, ProfileTaskRunner, ResourceProfile, current_allocation, profile

    OUT = sys.argv[1]
    CUDA = json.loads(sys.argv[2])

    @task
    def first():  # the runner's first task starts its warm pool, if it keeps one
        return 0

    @task(tags=[profile("gpu")])
    def where():
        a = current_allocation()
        visible = os.environ["CUDA_VISIBLE_DEVICES"]
        return {"devices": list(a.devices), "emulated": a.emulated, "visible": visible, "pid": os.getpid(),
                "process": multiprocessing.current_process().name}

    GPU = ResourceProfile(name="gpu", gpus=1, memory="3GiB", idle_timeout=30, cuda=CudaOptions(**CUDA))

    @flow(task_runner=ProfileTaskRunner(profiles=[GPU]))
    def on_cuda():
        first.submit().result()
        runner, deadline = FlowRunContext.get().task_runner, time.monotonic() + 60
        while time.monotonic() < deadline:  # no pool (none listed), or each of its processes ready
            listed = runner.warm_workers()
            if not listed or all(w["ready"] for w in listed):
                break
            time.sleep(0.05)
        warm = [w["pid"] for w in runner.warm_workers()]  # started, imported, no device
        return dict(where.submit().result(), warm=warm)

    if __name__ == "__main__":
        row = on_cuda()
        with open(OUT, "w") as fh:
            json.dump({"row": row, "flow_pid": os.getpid()}, fh)
    """
)


def _run_on_stand_in(tmp_path: Path, cuda: dict, warm_workers: int) -> tuple[dict, list[dict], list[dict]]:
    """Run FLOW with the stand-in dask_cuda; the task's row, the recorded ``LocalCUDACluster``
    calls and what the stand-in's other parts recorded (FAKE_MODULES)."""
    from prefect.settings import get_current_settings

    fake = tmp_path / "fake"
    (fake / "dask_cuda").mkdir(parents=True)
    (fake / "cudf").mkdir()
    (fake / "dask_cuda" / "__init__.py").write_text(FAKE_DASK_CUDA)
    for name, text in FAKE_MODULES.items():
        (fake / "dask_cuda" / name).write_text(text)
    (fake / "cudf" / "__init__.py").write_text(FAKE_CUDF)
    (tmp_path / "discover.py").write_text(DISCOVER)
    (tmp_path / "on_cuda.py").write_text(FLOW)
    record, out, workers = tmp_path / "record.jsonl", tmp_path / "out.json", tmp_path / "workers.jsonl"
    env = {
        k: v for k, v in os.environ.items() if k not in ("GPU_TASKS_EMULATED_GPUS", "GPU_TASKS_PROFILES_FILE")
    }
    env.update(
        PYTHONPATH=os.pathsep.join([str(fake), *filter(None, [os.environ.get("PYTHONPATH")])]),
        GPU_TASKS_DISCOVERY_COMMAND=f"{sys.executable} {tmp_path / 'discover.py'}",
        FAKE_DASK_CUDA_RECORD=str(record),
        FAKE_DASK_CUDA_WORKER_RECORD=str(workers),
        GPU_TASKS_TUNE_WARM_WORKERS=str(warm_workers),
        PREFECT_API_URL=str(get_current_settings().api.url),
    )
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "on_cuda.py"), str(out), json.dumps(cuda)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    calls, records = (
        [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        for path in (record, workers)
    )
    return json.loads(out.read_text())["row"], calls, records


@pytest.mark.parametrize(
    "cuda, expected",
    [
        (
            {"rmm_pool_size": "1GiB", "rmm_async": True, "enable_cudf_spill": True, "protocol": "ucx"},
            {"rmm_pool_size": 2**30, "rmm_async": True, "enable_cudf_spill": True, "protocol": "ucx"},
        ),
        ({}, {"rmm_pool_size": None, "rmm_async": False, "enable_cudf_spill": False, "protocol": "tcp"}),
    ],
    ids=["every-option-set", "defaults"],
)
def test_cuda_options_reach_local_cuda_cluster(tmp_path, cuda, expected):
    """Without a warm pool (or over UCX at any pool size) dask-cuda starts the workers."""
    row, calls, _ = _run_on_stand_in(
        tmp_path, cuda, warm_workers=0 if cuda.get("protocol", "tcp") == "tcp" else 2
    )
    assert len(calls) == 1, "one LocalCUDACluster for the profile's one worker"
    (call,) = calls
    for name, value in expected.items():
        assert call[name] == value, (name, call)
    # the layout the runner asks for: every device it may use, one worker now, one thread, localhost
    assert call["CUDA_VISIBLE_DEVICES"] == ["0", "1"] and call["n_workers"] == 1
    assert call["threads_per_worker"] == 1 and call["host"] == "127.0.0.1"
    assert call["memory_limit"] == 3 * 2**30
    # the worker sees only the device leased to it, not dask-cuda's "all of them, its own first"
    assert row["devices"] == [row["visible"]] and row["visible"] in {"0", "1"}
    assert row["emulated"] is False


def test_a_real_gpu_worker_comes_from_the_warm_pool_set_up_as_dask_cudas(tmp_path):
    """Over tcp with a warm pool (the default), a real GPU's worker is a warm process bound to
    its device, then given dask-cuda's worker setup: no ``LocalCUDACluster``, and nothing of
    dask-cuda imported in that process before its ``CUDA_VISIBLE_DEVICES`` was set."""
    cuda = {"rmm_pool_size": "1GiB", "rmm_async": True, "enable_cudf_spill": True}
    row, calls, records = _run_on_stand_in(tmp_path, cuda, warm_workers=2)
    assert calls == [], "dask-cuda's LocalCUDACluster is not started"
    device = row["visible"]
    assert row["devices"] == [device] and device in {"0", "1"} and row["emulated"] is False
    # the task ran in a process of the warm pool, started before its lease
    assert row["pid"] in row["warm"] and row["process"] == "gpu-tasks warm worker"
    mine = [r for r in records if r["pid"] == row["pid"]]
    kinds = [r["kind"] for r in mine]
    assert kinds.count("import") == 1 and kinds.index("import") < kinds.index("data")
    # dask-cuda first loaded in that process once bound: its device set, RAPIDS told not to initialise
    for r in mine:
        assert r["visible"] == device and r["rapids_no_initialize"] == "True", r
    (data,) = [r for r in mine if r["kind"] == "data"]
    # dask-cuda's "default", which its data function reads for the bound device itself
    assert data["device_index"] == int(device) and data["device_memory_limit"] == "default"
    assert data["memory_limit"] == 3 * 2**30 and data["enable_cudf_spill"] is True
    (plugin,) = [r["kwargs"] for r in mine if r["kind"] == "plugin"]
    assert plugin["device_index"] == int(device) and plugin["rmm_initial_pool_size"] == 2**30
    assert plugin["rmm_async_alloc"] is True and plugin["enable_cudf_spill"] is True
    (init,) = [r for r in mine if r["kind"] == "initialize"]
    assert init["create_cuda_context"] is True  # dask-cuda's preload makes the worker's context
    # cuDF spilling is switched on in the flow process too, as LocalCUDACluster does
    flow_side = [r for r in records if r["kind"] == "cudf.set_option"]
    assert {(r["name"], r["value"]) for r in flow_side} >= {("spill", True)}
    assert all(r["pid"] != row["pid"] for r in flow_side)


def test_every_cuda_option_is_checked_by_this_module():
    """A CudaOptions field added later must be added to the parametrization above."""
    from gpu_tasks import CudaOptions

    assert set(CudaOptions.model_fields) == {
        "rmm_pool_size",
        "rmm_async",
        "enable_cudf_spill",
        "protocol",
    }


@pytest.mark.usefixtures("prefect_server")
@pytest.mark.parametrize("warm_workers", ["0", "2"])
def test_real_devices_without_dask_cuda_fail_the_task_with_cluster_error(tmp_path, monkeypatch, warm_workers):
    """No stand-in on the path: dask-cuda is not installed here, so the task fails clearly,
    whether dask-cuda would start the worker or a warm process would."""
    from prefect import flow, task

    try:
        import dask_cuda  # noqa: F401
    except ImportError:
        pass
    else:  # pragma: no cover - a machine with dask-cuda
        pytest.skip("dask-cuda is installed here")
    (tmp_path / "discover.py").write_text(DISCOVER)
    monkeypatch.delenv("GPU_TASKS_EMULATED_GPUS", raising=False)
    monkeypatch.delenv("GPU_TASKS_PROFILES_FILE", raising=False)
    monkeypatch.setenv("GPU_TASKS_TUNE_WARM_WORKERS", warm_workers)
    monkeypatch.setenv("GPU_TASKS_DISCOVERY_COMMAND", f"{sys.executable} {tmp_path / 'discover.py'}")

    @task(tags=[profile("gpu")])
    def never_runs():
        return "ran"

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="gpu", gpus=1, idle_timeout=0.5)]))
    def f():
        return never_runs.submit().result()

    with pytest.raises(ClusterError, match=r"profile 'gpu' needs dask-cuda on real GPUs: .*pip install"):
        f()


@pytest.mark.parametrize("nthreads", [1, 2, 64])
def test_the_host_memory_limit_is_read_as_a_dask_worker_reads_it(nthreads):
    """What dask-cuda's spilling store and a pooled worker's terminate threshold are given for a
    profile's ``memory`` (``"auto"`` without one), against the worker's own reading on this host."""
    import logging

    from distributed.worker_memory import parse_memory_limit  # what a Worker calls with its memory_limit

    from gpu_tasks.compat.distributed import memory_limit

    for given in ["auto", None, 0, "0", 3 * 2**30, "3GiB", "5e9", "1 TB", 0.5, "0.25", 1, 2.5e9, 10**15]:
        expected = parse_memory_limit(given, nthreads, logger=logging.getLogger("test"))
        assert memory_limit(given, nthreads) == expected, given
