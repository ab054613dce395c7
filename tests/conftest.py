"""Markers (see pyproject.toml): everything under tests/integration imports SGLang (`sglang`); modules and tests mark
themselves `server`, `model` and `slow`. `bash scripts/test.sh --quick` runs `-m "not slow"`."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "integration" in item.nodeid.split("/"):
            item.add_marker(pytest.mark.sglang)
