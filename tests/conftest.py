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


@pytest.hookimpl(optionalhook=True)  # (a pytest-xdist hook: run without xdist, e.g. tests/gpu on a GPU machine)
def pytest_xdist_make_scheduler(config, log):
    """With `-n 2` (scripts/test.sh): every test under tests/integration runs in one worker, in collection order --
    SGLang keeps 10 GiB of host memory free and a CPU server holds 2-3.5 GB, so two workers' servers at once would
    not fit -- and the other tests run in the other worker beside them."""
    from xdist.scheduler import LoadScopeScheduling

    class IntegrationApart(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "tests/integration" if nodeid.startswith("tests/integration/") else nodeid

    return IntegrationApart(config, log)
