"""Namespaces: pages are only ever served to the exact configuration that wrote them.

Two servers share page keys (SGLang's hash chain over token ids) whenever they see the same tokens, even if their
models, dtypes or shards differ. Every field that changes the bytes of a page is part of the namespace, the
namespace id names the page directory, and it is stored again inside every page header (`page_file.py`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from sglang_tiered.storage.geometry import KVGeometry


@dataclass(frozen=True)
class Namespace:
    model: str  # model fingerprint: name + hash of its config.json (see models.model_fingerprint)
    dtype: str  # KV dtype, e.g. "torch.bfloat16"
    page_size: int  # tokens per page
    layout: str  # host pool layout: byte order of the page payload
    layer_num: int
    kv_heads: int  # KV heads held by this rank
    head_dim: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    salt: str = ""  # user-chosen (--tiered-namespace); separates tenants or experiments

    @property
    def id(self) -> str:
        """16 hex digits, stable across processes and Python versions."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def describe(self) -> dict:
        return {"id": self.id, **asdict(self)}

    def geometry(self, itemsize: int) -> KVGeometry:
        return KVGeometry(self.layer_num, self.kv_heads, self.head_dim, itemsize)

    def page_bytes(self, itemsize: int) -> int:
        """Payload bytes of one page: K and V for every layer."""
        return self.geometry(itemsize).page_bytes(self.page_size)
