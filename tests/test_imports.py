"""Importing gpu_tasks needs no GPU, no RAPIDS library and none of the pipeline's libraries."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("cudf", "cupy", "rmm", "dask_cuda", "dask_cudf", "pynvml", "xgboost", "torch", "sklearn", "distributed")


def test_import_gpu_tasks_loads_no_gpu_or_model_library():
    code = (
        "import json, sys; import gpu_tasks; "
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
