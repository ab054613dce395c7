"""Integration tests start real SGLang servers (CPU, the embedded SmolLM2) through `ServerProcess`, which runs each
in its own process group on 127.0.0.1 and stops it when the test ends, also on failure.

Servers that several modules need with the same flags are started once per session (the suite's cost is mostly server
startups): `shared_server` (the default `--kv-backend tiered` configuration, `--dtype auto`, metrics on) and
`fp32_server` (`--dtype float32 --tiered-blend full`: SGLang's own prefill of every unmarked prompt, the exact
reference that engine-computed prefills are compared with). Tests on a shared server read only the log written after
their own `log_mark()`, count metric deltas, and `/flush_cache` where they need a cold cache.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from sglang_tiered.models import default_model_path
from sglang_tiered.server_process import ServerProcess, essay_texts
from tests.integration.helpers import tiered_args

PROMPT_CHARS = 2800  # about 700 tokens = 10 full 64-token pages


@pytest.fixture(scope="session")
def essays() -> list[str]:
    return [e[:PROMPT_CHARS] for e in essay_texts()]


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory, model_dir) -> Path:
    """Same tokenizer and weights, different RoPE base: a different model whose page keys collide with ours."""
    out = tmp_path_factory.mktemp("other-model")
    for f in model_dir.iterdir():
        if f.name != "config.json" and f.is_file():
            os.symlink(f, out / f.name)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["rope_theta"] = float(cfg.get("rope_theta", 100000.0)) / 2
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory) -> Iterator[ServerProcess]:
    """The default configuration: `--kv-backend tiered`, `--dtype auto`, blending on, `--enable-metrics`."""
    tmp = tmp_path_factory.mktemp("shared")
    with ServerProcess(tiered_args(tmp / "ssd", "--enable-metrics"), log_path=tmp / "shared.log") as server:
        server.ssd = tmp / "ssd"
        yield server


@pytest.fixture(scope="session")
def fp32_server(tmp_path_factory) -> Iterator[ServerProcess]:
    """SGLang's own prefill in fp32 of unmarked prompts: the exact reference. (Marked ones are computed by our engine
    in `full` mode, every token: exact as well.)"""
    tmp = tmp_path_factory.mktemp("fp32")
    args = tiered_args(tmp / "ssd", "--dtype", "float32", "--tiered-blend", "full", "--enable-metrics",
                       max_tokens=8192)
    with ServerProcess(args, log_path=tmp / "fp32.log") as server:
        server.ssd = tmp / "ssd"
        yield server
