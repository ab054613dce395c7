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


SESSION_SERVERS = {"shared_server", "fp32_server", "torch_native_server"}  # tests/integration/conftest.py


def pytest_collection_modifyitems(config, items):
    """Every test that starts a server or uses a session-scoped one runs in one pytest-xdist worker, in collection
    order (`--dist loadgroup`, scripts/test.sh): SGLang keeps 10 GiB of host memory free and a CPU server holds
    2-3.5 GB, so two workers' servers at once would not fit; the other tests run beside them in the other worker."""
    for item in items:
        if "integration" in item.nodeid.split("/"):
            item.add_marker(pytest.mark.sglang)
        if item.get_closest_marker("server") is not None or SESSION_SERVERS & set(item.fixturenames):
            item.add_marker(pytest.mark.xdist_group("servers"))
