"""The one channel from the launcher to every SGLang process: the resolved `TieredConfig` and what was derived from
SGLang's own arguments, as JSON in one environment variable.

The launcher (`server_flags.translate`, before SGLang spawns anything) calls `publish`; every process reads them
through its `Runtime.settings` (parsed once per value of the variable).
Each subsystem reads its view: `settings.config.blend_*`, `settings.config.runahead_*`, ... No other environment
variable or JSON carries our settings (SGLang's storage extra-config holds only the fields SGLang itself reads).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Optional

from sglang_tiered.config import TieredConfig, parse_size

ENV = "SGLANG_TIERED_SETTINGS"


@dataclass(frozen=True)
class Settings:
    config: TieredConfig
    model: str  # model fingerprint (name + hash of config.json): part of every page namespace
    model_path: str  # resolved local path (or hub id) SGLang serves
    cpu_only: bool  # no CUDA: CPU shims, prefix-aware attention, write-through yields to the forward
    cuda_preview: bool = False  # CUDA with config.CUDA_PREVIEW_ENV=1: gated loading and compute-or-load run there
    runahead_threads: int = 1  # torch threads per helper rank (resolved from --tiered-runahead-threads)
    runahead_partitions: str = ""  # partition table to use ("" = none: FLOP-balanced splits)
    vocab_size: int = 0  # from config.json (0 = unknown): input_ids outside [0, vocab_size) are refused
    attention_heads: int = 0  # query heads of the model, from config.json (0 = unknown)

    @property
    def blend_on(self) -> bool:
        return self.config.blend != "off"

    @property
    def blend_memory_bytes(self) -> int:
        return parse_size(self.config.blend_memory)

    @property
    def runahead_on(self) -> bool:
        return self.config.runahead_ranks >= 2

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str) -> Settings:
        data = json.loads(raw)
        data["config"] = TieredConfig.from_dict(data["config"])
        return cls(**data)


def publish(settings: Settings) -> None:
    """Make `settings` this process's and every child process's (call before SGLang spawns its processes)."""
    os.environ[ENV] = settings.to_json()


def clear() -> None:
    """No tiered backend in this process and its children (`--kv-backend default`)."""
    os.environ.pop(ENV, None)


def current() -> Optional[Settings]:
    """This process's settings, or None when the server was not started with `--kv-backend tiered` (parsed at every
    call: processes keep theirs in their `Runtime`)."""
    return parse(os.environ.get(ENV))


def parse(raw: Optional[str]) -> Optional[Settings]:
    return Settings.from_json(raw) if raw else None
