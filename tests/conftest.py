from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "integration" in item.nodeid.split("/"):
            item.add_marker(pytest.mark.integration)
