"""Fault tests: real processes, real signals, a real Prefect server (or Prefect's ephemeral API)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/faults/" in str(item.fspath):
            item.add_marker(pytest.mark.faults)
