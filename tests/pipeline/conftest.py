"""The example pipeline's tests: skipped where its libraries (the ``pipeline`` extra) are not installed."""

from gpu_tasks.pipeline import missing_libraries

collect_ignore_glob = ["test_*.py"] if missing_libraries() else []
