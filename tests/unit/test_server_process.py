"""ServerProcess, the helper every test, benchmark and the demo use to run servers: a taken HTTP port at startup is
retried on a new one, and so is a port SGLang picked for itself (its launcher exits over it); a start SGLang refused
for host memory is tried again later. Against a stand-in
launcher (a real process that binds the port it is given, as SGLang's HTTP server does, and fails with uvicorn's
message when the port is taken), so that no SGLang server start is spent on it."""

from __future__ import annotations

import socket
import sys
import textwrap
import time

import pytest

from sglang_tiered import server_process
from sglang_tiered.server_process import ServerProcess

STANDIN = textwrap.dedent("""
    import http.server, os, socket, sys, time
    port = int(sys.argv[sys.argv.index("--port") + 1])
    short = os.environ.get("STANDIN_SHORT_OF_MEMORY")  # a file: the host-memory refusals still to happen
    refusals = int(open(short).read()) if short else 0
    if refusals > 0:
        open(short, "w").write(str(refusals - 1))
        print("ValueError: No host memory is left for HiCache after the 10 GiB reserve; set --hicache-ratio or "
              "--hicache-size explicitly.", flush=True)
        sys.exit(1)
    collisions = os.environ.get("STANDIN_COLLISIONS")  # a file: the internal port collisions still to happen
    left = int(open(collisions).read()) if collisions else 0
    if left > 0:
        open(collisions, "w").write(str(left - 1))
        print("torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
              "address. port: 25611, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use",
              flush=True)
        sys.exit(1)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
    try:
        server = http.server.HTTPServer(("127.0.0.1", port), Health)
    except OSError as exc:  # uvicorn's line; SGLang's launcher lingers after it
        print(f"ERROR:    [Errno {exc.errno}] error while attempting to bind on address ('127.0.0.1', {port}): "
              f"address already in use", flush=True)
        time.sleep(600)
    print(f"INFO:     Uvicorn running on http://127.0.0.1:{port} (Press CTRL+C to quit)", flush=True)
    server.serve_forever()
""")


@pytest.fixture
def standin(tmp_path) -> list[str]:
    """The `wrapper` that runs the stand-in instead of SGLang's launcher (which it is given as arguments)."""
    script = tmp_path / "standin.py"
    script.write_text(STANDIN)
    return [sys.executable, str(script)]


def test_a_taken_http_port_is_retried_on_a_new_one(tmp_path, monkeypatch, standin):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    taken = busy.getsockname()[1]
    ports = iter([taken])
    real = server_process.free_port
    monkeypatch.setattr(server_process, "free_port", lambda: next(ports, None) or real())
    s = ServerProcess(["--max-total-tokens", "64"], log_path=tmp_path / "standin.log", wrapper=standin)
    try:
        t0 = time.monotonic()
        s.start()
        assert time.monotonic() - t0 < 15, "waited on the other listener's /health (30 s) before reading the log"
        assert s.port != taken
        assert f"('127.0.0.1', {taken}): address already in use" in s.log_path.read_text()
        assert s.get("/health") == ""
    finally:
        s.stop()
        busy.close()
    assert s.proc is None


def test_a_fixed_port_that_is_taken_is_an_error(tmp_path, standin):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        s = ServerProcess(["--max-total-tokens", "64"], log_path=tmp_path / "standin.log", port=taken,
                          wrapper=standin)
        try:
            t0 = time.monotonic()
            with pytest.raises(RuntimeError, match=f"port {taken} is in use"):
                s.start()
            assert time.monotonic() - t0 < 15, "waited on the other listener's /health before reading the log"
        finally:
            s.stop()
    assert s.proc is None


def test_an_interrupted_start_leaves_no_server_behind(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM, which tests/conftest.py turns into it) while waiting for /health: the launcher's whole
    process group is stopped before the interrupt goes on."""
    silent = tmp_path / "silent.py"
    silent.write_text("import time\ntime.sleep(600)\n")  # never answers /health
    s = ServerProcess(["--max-total-tokens", "64"], log_path=tmp_path / "silent.log",
                      wrapper=[sys.executable, str(silent)])
    real_sleep, started = time.sleep, []

    def interrupt(seconds: float) -> None:
        if not started:  # the first wait for /health
            started.append(s.proc.pid)
            raise KeyboardInterrupt
        real_sleep(seconds)

    monkeypatch.setattr(server_process.time, "sleep", interrupt)
    with pytest.raises(KeyboardInterrupt):
        s.start()
    assert s.proc is None and started and not server_process.process_alive(started[0])


def test_a_second_start_is_refused_and_orphans_nothing(tmp_path, standin):
    """`s.start()` then `with s:` would start a second launcher over the first; the first must stay the one stopped."""
    s = ServerProcess(["--max-total-tokens", "64"], log_path=tmp_path / "standin.log", wrapper=standin)
    s.start()
    first = s.proc.pid
    try:
        with pytest.raises(RuntimeError, match="already started"):
            s.start()
        assert s.proc.pid == first
    finally:
        s.stop()
    assert not server_process.process_alive(first)


@pytest.mark.parametrize("fixed", [False, True])
def test_a_port_sglang_picked_for_itself_that_was_taken_is_started_again(tmp_path, standin, fixed):
    """The scheduler's torch.distributed store binds a random port seconds after SGLang found it free: when another
    process took it meanwhile, the launcher exits, and the start is repeated (on a new port unless it was fixed)."""
    collisions = tmp_path / "collisions"
    collisions.write_text("1")
    port = server_process.free_port() if fixed else None
    s = ServerProcess(["--max-total-tokens", "64"], log_path=tmp_path / "standin.log", wrapper=standin, port=port,
                      env={"STANDIN_COLLISIONS": str(collisions)})
    first = s.port
    try:
        s.start()
        assert collisions.read_text() == "0" and "EADDRINUSE" in s.log_path.read_text()
        assert (s.port == first) == fixed
        assert s.get("/health") == ""
    finally:
        s.stop()
    assert s.proc is None


def test_an_internal_port_taken_at_every_start_is_an_error(tmp_path, standin):
    collisions = tmp_path / "collisions"
    collisions.write_text("3")
    s = ServerProcess(["--max-total-tokens", "64"], log_path=tmp_path / "standin.log", wrapper=standin,
                      env={"STANDIN_COLLISIONS": str(collisions)})
    with pytest.raises(RuntimeError, match="a port SGLang picked for itself was in use at each of 3 starts"):
        s.start()
    assert s.proc is None and collisions.read_text() == "0"


@pytest.mark.parametrize("refusals, started", [(2, True), (4, False)])
def test_a_start_refused_for_host_memory_is_tried_again_later(tmp_path, monkeypatch, standin, refusals, started):
    """SGLang keeps 10 GiB of host memory free and refuses a host KV pool otherwise: while other servers hold that
    memory (another test worker's), the start waits and is tried again, `MEMORY_WAITS` times at most."""
    monkeypatch.setattr(server_process, "MEMORY_WAITS", 3)
    monkeypatch.setattr(server_process, "MEMORY_WAIT_S", 0.1)
    short = tmp_path / "short"
    short.write_text(str(refusals))
    s = ServerProcess(["--max-total-tokens", "64"], log_path=tmp_path / "standin.log", wrapper=standin,
                      env={"STANDIN_SHORT_OF_MEMORY": str(short)})
    try:
        if started:
            s.start()
            assert s.get("/health") == "" and short.read_text() == "0"
        else:
            with pytest.raises(RuntimeError, match="refused the host KV pool at 4 starts"):
                s.start()
            assert short.read_text() == "0"
    finally:
        s.stop()
    assert s.proc is None


def test_a_launcher_that_exits_for_another_reason_is_not_started_again(tmp_path):
    """Only a taken port is retried: any other exit during startup is an error at once, with the log's tail."""
    broken = tmp_path / "broken.py"
    broken.write_text("import sys\nprint('ValueError: --tiered-blend: no such mode', flush=True)\nsys.exit(1)\n")
    s = ServerProcess(["--max-total-tokens", "64"], log_path=tmp_path / "broken.log",
                      wrapper=[sys.executable, str(broken)])
    with pytest.raises(RuntimeError, match="exited with 1 during startup(.|\n)*no such mode"):
        s.start()
    assert s.proc is None and s.log_path.read_text().count("no such mode") == 1
