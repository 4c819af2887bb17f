"""The ``gpu-tasks`` command line: devices, profiles, waiters, leases and quotas; the example pipeline
apart, under ``gpu-tasks example``.

Every command follows the same rules:

* errors that are the user's to fix (a bad ``GPU_TASKS_*`` value, a bad profiles
  file) print one message on stderr and exit with code 2 through
  :func:`gpu_tasks.cli.common.fail`, never a traceback;
* ``--json`` prints machine-readable output on stdout and nothing else;
* emulated devices are always called out as such.

To add a command, write a function decorated with ``@app.command(help=...)`` in the module of
its kind (``inspect``, ``leases``, ``pipeline`` for ``example``, ``quotas``), read settings with
``common.settings`` and devices with ``common.inventory``, and report user errors with ``common.fail``.
"""

from gpu_tasks.cli import inspect, leases, pipeline, quotas  # noqa: F401  (each registers its commands on app)
from gpu_tasks.cli.common import app

app.add_typer(pipeline.example_app, name="example")

__all__ = ["app", "main"]


def main() -> None:
    """Entry point: ``python -m gpu_tasks.cli``."""
    app()


if __name__ == "__main__":
    main()
