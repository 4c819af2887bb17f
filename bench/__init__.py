"""gpu-tasks benchmark suite (not tests: nothing here asserts a time).

``python -m bench`` (or ``./scripts/bench``) runs every benchmark in one go, each
in a fresh process against one Prefect server on 127.0.0.1, and writes
``docs/benchmarks.md`` with tables and PNG plots plus the raw results as JSON in
``docs/results/``. Every figure is a ratio or a side-by-side taken in the same run.
"""
