"""The size of KV: one object for bytes per token, per token-layer and per page (no SGLang, no torch).

A token's KV is, for every layer, a key and a value of `kv_heads x head_dim` elements of `itemsize` bytes (MHA/GQA
layout, what SGLang's `MHATokenToKVPool` and our engine hold; `kv_heads` is the heads held by one TP rank).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KVGeometry:
    layers: int
    kv_heads: int
    head_dim: int
    itemsize: int  # bytes per element (2 for bf16/fp16, 4 for fp32)

    @property
    def token_layer_bytes(self) -> int:
        """K and V of one token in one layer."""
        return 2 * self.kv_heads * self.head_dim * self.itemsize

    @property
    def token_bytes(self) -> int:
        """K and V of one token in every layer."""
        return self.layers * self.token_layer_bytes

    def page_bytes(self, page_size: int) -> int:
        """Payload of one KV page of `page_size` tokens."""
        return page_size * self.token_bytes

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any], itemsize: int, tp_size: int = 1) -> KVGeometry:
        """From a Hugging Face config dict (config.json); KV heads are split over `tp_size` ranks (at least one each,
        as SGLang replicates KV heads when there are fewer than ranks)."""
        heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        return cls(cfg["num_hidden_layers"], max(1, heads // max(1, tp_size)), head_dim, itemsize)
