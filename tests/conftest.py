"""Markers (see pyproject.toml): everything under tests/integration imports SGLang (`sglang`); modules and tests mark
themselves `server`, `model` and `slow`. `bash scripts/test.sh --quick` runs `-m "not slow"`.

`scripts/test.sh` runs two pytest-xdist workers; a work unit runs on one worker: the modules on the session's servers
(`SESSION_MODULES`) together, so that each of those servers starts once, with test_remote.py first (it starts two
servers of its own at once, before any session server holds memory: SGLang refuses a host KV pool unless 10 GiB of
host memory stay free, about five servers on a 24 GiB machine, and this way no more than four run at once, but a
chained-prefill helper rank or a worker's peak can still take the rest: a start SGLang refuses for it waits and is
tried again, `ServerProcess.start`); every other module whole, so that its module-scoped servers start once."""

from __future__ import annotations

import importlib.util
import signal

import pytest

SESSION_SERVERS = frozenset({"shared_server", "fp32_server"})
SESSION_MODULES = (
    "tests/integration/test_remote.py",  # first
    "tests/integration/test_blend.py",
    "tests/integration/test_meet_load.py",
    "tests/integration/test_requests.py",
    "tests/integration/test_runahead.py",
    "tests/integration/test_torch_native.py",
)


def pytest_configure(config):
    """A terminated run (SIGTERM: a CI timeout, an operator's kill) stops as Ctrl-C does: pytest tears the fixtures
    down, so the servers and Mooncake masters the tests started are stopped too (the default action skips that)."""
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def module_of(nodeid: str) -> str:
    return nodeid.split("::")[0]


def pytest_collection_modifyitems(config, items):
    """Marks, the order (test_remote.py first: stable sort), and a check that every test on a session server is in a
    module of `SESSION_MODULES` (elsewhere it would start the server a second time, on the other worker)."""
    items.sort(key=lambda item: module_of(item.nodeid) != SESSION_MODULES[0])
    for item in items:
        if "integration" in item.nodeid.split("/"):
            item.add_marker(pytest.mark.sglang)
        if SESSION_SERVERS & set(item.fixturenames) and module_of(item.nodeid) not in SESSION_MODULES:
            raise pytest.UsageError(f"{item.nodeid} uses a session server: list its module in SESSION_MODULES "
                                    "(tests/conftest.py)")


if importlib.util.find_spec("xdist") is not None:

    def pytest_xdist_make_scheduler(config, log):
        """Work units: the session modules as one, every other module as one (in collection order)."""
        from xdist.scheduler import LoadScopeScheduling

        class Units(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                module = module_of(nodeid)
                return "session servers" if module in SESSION_MODULES else module

        return Units(config, log)
