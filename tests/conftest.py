"""Markers (see pyproject.toml): everything under tests/integration imports SGLang (`sglang`); modules and tests mark
themselves `server`, `model` and `slow`. `bash scripts/test.sh --quick` runs `-m "not slow"`.

With pytest-xdist (`scripts/test.sh` runs two workers) every test is in an `xdist_group`, and a group runs on one
worker: the tests on the session's servers together (each server started once), with tests/integration/test_remote.py
first (it starts two servers of its own at once, before any session server holds memory); every other module whole
(its module-scoped servers started once)."""

from __future__ import annotations

import signal

import pytest

SESSION_SERVERS = frozenset({"shared_server", "fp32_server"})
SESSION_GROUP = "session-servers"
BEFORE_SESSION_SERVERS = ("tests/integration/test_remote.py",)


def pytest_configure(config):
    """A terminated run (SIGTERM: a CI timeout, an operator's kill) stops as Ctrl-C does: pytest tears the fixtures
    down, so the servers and Mooncake masters the tests started are stopped too (the default action skips that)."""
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_collection_modifyitems(config, items):
    """SGLang refuses a host KV pool unless 10 GiB of host memory stay free: test_remote.py goes first (stable sort),
    while no session server holds memory."""
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in BEFORE_SESSION_SERVERS)
    grouped = config.pluginmanager.hasplugin("xdist")
    for item in items:
        if "integration" in item.nodeid.split("/"):
            item.add_marker(pytest.mark.sglang)
        if grouped:
            item.add_marker(pytest.mark.xdist_group(group(item)))


def group(item) -> str:
    module = item.nodeid.split("::")[0]
    if module in BEFORE_SESSION_SERVERS or SESSION_SERVERS & set(item.fixturenames):
        return SESSION_GROUP
    return module
