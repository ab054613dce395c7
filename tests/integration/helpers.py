"""Helpers shared by the integration tests (not fixtures: those are in conftest.py)."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

from sglang_tiered.server_process import ServerProcess, metric_total


def copy_tree(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, dirs_exist_ok=True)


def tiered_args(ssd: Path, *extra: str, max_tokens: int = 4096) -> list[str]:
    return ["--kv-backend", "tiered", "--max-total-tokens", str(max_tokens), "--tiered-ssd-dir", str(ssd),
            "--tiered-stats-interval", "0", *extra]


def chosen_dtype(server: ServerProcess) -> str:
    """The dtype a `--dtype auto` server chose (its startup log line)."""
    line = server.log_lines("--dtype auto on this CPU:")[0]
    return re.search(r"on this CPU: (\w+)", line).group(1)


def flip_middle_byte(path: Path) -> None:
    """Corrupt a stored file the way bit rot would: one byte in its middle inverted (its checksum then fails)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def wait_for_metric(server: ServerProcess, name: str, at_least: float, timeout: float = 15.0) -> str:
    """Our counters are published once a second (metrics.StatsReporter): poll /metrics until `name` reaches
    `at_least` or the timeout passes; returns the last /metrics text."""
    deadline = time.monotonic() + timeout
    while metric_total(text := server.get("/metrics"), name) < at_least and time.monotonic() < deadline:
        time.sleep(0.25)
    return text
