"""Helpers shared by the integration tests (not fixtures: those are in conftest.py)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from sglang_tiered.server_process import ServerProcess


def copy_tree(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, dirs_exist_ok=True)


def tiered_args(ssd: Path, *extra: str, max_tokens: int = 4096) -> list[str]:
    return ["--kv-backend", "tiered", "--max-total-tokens", str(max_tokens), "--tiered-ssd-dir", str(ssd),
            "--tiered-stats-interval", "0", *extra]


def chosen_dtype(server: ServerProcess) -> str:
    """The dtype a `--dtype auto` server chose (its startup log line)."""
    line = server.log_lines("--dtype auto on this CPU:")[0]
    return re.search(r"on this CPU: (\w+)", line).group(1)
