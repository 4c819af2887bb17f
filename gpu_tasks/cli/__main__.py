"""``python -m gpu_tasks.cli``."""

from gpu_tasks.cli import app

app()
