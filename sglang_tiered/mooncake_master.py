"""Start and stop `mooncake_master` (master + HTTP metadata server in one process) in its own process group on
127.0.0.1, for tests, benchmarks and the demo. Production runs it the way the README shows.

`MooncakeMaster` is a context manager: stopped (SIGKILL to its group) on exit, also when the body raises; `start()`
again brings up a fresh master (empty: Mooncake keeps object metadata in the master's memory) on the same ports.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from sglang_tiered.server_process import free_port, signal_group


def master_binary() -> str:
    """`mooncake_master` of this Python environment (installed by mooncake-transfer-engine-non-cuda)."""
    here = Path(sys.executable).parent / "mooncake_master"
    found = str(here) if here.exists() else shutil.which("mooncake_master")
    if not found:
        raise FileNotFoundError("mooncake_master not found: pip install mooncake-transfer-engine-non-cuda")
    return found


class MooncakeMaster:
    def __init__(self, log_path: str | os.PathLike, *, startup_timeout: float = 30.0) -> None:
        self.log_path = Path(log_path)
        self.rpc_port, self.metadata_port, self.metrics_port = free_port(), free_port(), free_port()
        self.startup_timeout = startup_timeout
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        """What `--tiered-remote` takes."""
        return f"mooncake://127.0.0.1:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        """What `--tiered-remote-metadata` takes."""
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    def server_args(self) -> list[str]:
        return ["--tiered-remote", self.url, "--tiered-remote-metadata", self.metadata_url]

    def command(self) -> list[str]:
        return [master_binary(), f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.metadata_port}", f"--metrics_port={self.metrics_port}"]

    def __enter__(self) -> MooncakeMaster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Start and wait until the RPC and metadata ports accept connections."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}; log: {self.log_path}")
            if all(_accepts(p) for p in (self.rpc_port, self.metadata_port)):
                return
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"mooncake_master not listening after {self.startup_timeout} s; log: {self.log_path}")

    def stop(self) -> None:
        """Kill the master (SIGKILL: what a crash looks like to its clients)."""
        if self.proc is None:
            return
        signal_group(self.proc, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.proc = None


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False
