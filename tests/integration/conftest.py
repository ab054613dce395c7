"""Integration tests start real SGLang servers (CPU, the embedded SmolLM2) through `ServerProcess`, which runs each
in its own process group on 127.0.0.1 and stops it when the test ends, also on failure."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from sglang_tiered.models import default_model_path
from sglang_tiered.server_process import essay_texts

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


def copy_tree(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, dirs_exist_ok=True)
