"""ServerProcess, the helper every test, benchmark and the demo use to run servers: port collisions at startup."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.server, pytest.mark.slow]


def test_a_taken_http_port_is_retried_on_a_new_one(torch_native_server):
    """The torch_native session server was started with its first port held by another socket (conftest.py)."""
    s = torch_native_server
    assert s.port != s.taken_port
    assert f"('127.0.0.1', {s.taken_port}): address already in use" in s.log_path.read_text()
    assert s.generate("Hello", max_new_tokens=1)["text"] is not None
