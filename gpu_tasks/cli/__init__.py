"""The ``gpu-tasks`` command line; the example pipeline apart, under ``gpu-tasks example``. Every command
reports a user's error as one line on stderr and exit code 2 (:func:`common.fail`), prints only JSON on
stdout with ``--json``, and names emulated devices as such."""

from gpu_tasks.cli import inspect, leases, pipeline, quotas  # noqa: F401  (each registers its commands on app)
from gpu_tasks.cli.common import app

app.add_typer(pipeline.example_app, name="example")

__all__ = ["app"]
