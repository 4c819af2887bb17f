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

FAKE_DASK_CUDA = textwrap.dedent(
    '''
    """Stand-in for dask-cuda: records LocalCUDACluster's arguments, then runs plain Dask workers."""
    import copy, json, os

    from distributed import LocalCluster

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
    import json, os, sys
    from prefect import flow, task
    from gpu_tasks import CudaOptions, ProfileTaskRunner, ResourceProfile, current_allocation, profile

    OUT = sys.argv[1]
    CUDA = json.loads(sys.argv[2])

    @task(tags=[profile("gpu")])
    def where():
        a = current_allocation()
        visible = os.environ["CUDA_VISIBLE_DEVICES"]
        return {"devices": list(a.devices), "emulated": a.emulated, "visible": visible, "pid": os.getpid()}

    GPU = ResourceProfile(name="gpu", gpus=1, memory="3GiB", idle_timeout=30, cuda=CudaOptions(**CUDA))

    @flow(task_runner=ProfileTaskRunner(profiles=[GPU]))
    def on_cuda():
        return where.submit().result()

    if __name__ == "__main__":
        row = on_cuda()
        with open(OUT, "w") as fh:
            json.dump({"row": row, "flow_pid": os.getpid()}, fh)
    """
)


def _run_on_stand_in(tmp_path: Path, cuda: dict) -> tuple[dict, list[dict]]:
    """Run FLOW with the stand-in dask_cuda; the task's row and the recorded constructor calls."""
    from prefect.settings import get_current_settings

    fake = tmp_path / "fake"
    (fake / "dask_cuda").mkdir(parents=True)
    (fake / "dask_cuda" / "__init__.py").write_text(FAKE_DASK_CUDA)
    (tmp_path / "discover.py").write_text(DISCOVER)
    (tmp_path / "on_cuda.py").write_text(FLOW)
    record, out = tmp_path / "record.jsonl", tmp_path / "out.json"
    env = {
        k: v for k, v in os.environ.items() if k not in ("GPU_TASKS_EMULATED_GPUS", "GPU_TASKS_PROFILES_FILE")
    }
    env.update(
        PYTHONPATH=os.pathsep.join([str(fake), *filter(None, [os.environ.get("PYTHONPATH")])]),
        GPU_TASKS_DISCOVERY_COMMAND=f"{sys.executable} {tmp_path / 'discover.py'}",
        FAKE_DASK_CUDA_RECORD=str(record),
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
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    return json.loads(out.read_text())["row"], calls


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
    row, calls = _run_on_stand_in(tmp_path, cuda)
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
def test_real_devices_without_dask_cuda_fail_the_task_with_cluster_error(tmp_path, monkeypatch):
    """No stand-in on the path: dask-cuda is not installed here, so the task fails clearly."""
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
    monkeypatch.setenv("GPU_TASKS_DISCOVERY_COMMAND", f"{sys.executable} {tmp_path / 'discover.py'}")

    @task(tags=[profile("gpu")])
    def never_runs():
        return "ran"

    @flow(task_runner=ProfileTaskRunner(profiles=[ResourceProfile(name="gpu", gpus=1, idle_timeout=0.5)]))
    def f():
        return never_runs.submit().result()

    with pytest.raises(ClusterError, match=r"profile 'gpu' needs dask-cuda on real GPUs: .*pip install"):
        f()
