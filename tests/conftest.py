"""Markers (see pyproject.toml): everything under tests/integration imports SGLang (`sglang`); modules and tests mark
themselves `server`, `model` and `slow`. `bash scripts/test.sh --quick` runs `-m "not slow"`."""

from __future__ import annotations

import signal

import pytest


def pytest_configure(config):
    """A terminated run (SIGTERM: a CI timeout, an operator's kill) stops as Ctrl-C does: pytest tears the fixtures
    down, so the servers and Mooncake masters the tests started are stopped too (the default action skips that)."""
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "integration" in item.nodeid.split("/"):
            item.add_marker(pytest.mark.sglang)
