"""ServerProcess, the helper every test, benchmark and the demo use to run servers: port collisions at startup."""

from __future__ import annotations

import socket

import pytest

from sglang_tiered import server_process
from sglang_tiered.server_process import ServerProcess


@pytest.mark.server
@pytest.mark.slow
def test_a_taken_http_port_is_retried_on_a_new_one(tmp_path, monkeypatch):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    taken = busy.getsockname()[1]
    ports = iter([taken])
    real = server_process.free_port
    monkeypatch.setattr(server_process, "free_port", lambda: next(ports, None) or real())
    args = ["--kv-backend", "tiered", "--max-total-tokens", "1024", "--tiered-ssd-dir", str(tmp_path / "ssd")]
    try:
        with ServerProcess(args, log_path=tmp_path / "server.log") as s:
            assert s.port != taken
            assert s.generate("Hello", max_new_tokens=1)["text"] is not None
        assert "address already in use" in (tmp_path / "server.log").read_text()
    finally:
        busy.close()
