"""Everything under tests/integration runs against the real broker of `tests/conftest.py`."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/integration needs the broker: mark it so `-m "not integration"` works."""
    for item in items:
        if "tests/integration/" in item.nodeid.replace(os.sep, "/"):
            item.add_marker(pytest.mark.integration)
