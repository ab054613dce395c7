"""Where KVPR's activations live: beside each KV page, in the same tier, format and capacity accounting.

The activation page of KV page `key` is the page `key + SUFFIX` in the same namespace directory: one segment per
layer, each [page_size, hidden] elements of the KV dtype -- the layer's attention input (post-RMSNorm), from which
K = X W_K (+ RoPE) and V = X W_V are recomputed. Same header, per-segment checksums, atomic rename and eviction as
KV pages: an activation page evicted, lost or corrupt is only a miss (the loader reads that page's KV instead).
"""

from __future__ import annotations

from sglang_tiered.storage.geometry import KVGeometry

SUFFIX = ".x"


def activation_key(key: str) -> str:
    return key + SUFFIX


def is_activation(key: str) -> bool:
    return key.endswith(SUFFIX)


def page_of(key: str) -> str:
    """The KV page key of activation page `key`."""
    return key[: -len(SUFFIX)]


def segment_bytes(layers: int, page_size: int, hidden: int, itemsize: int) -> list[int]:
    """Segment sizes of an activation page."""
    return [page_size * hidden * itemsize] * layers


def kv_segment_bytes(geometry: KVGeometry, page_size: int) -> list[int]:
    """Segment sizes of a KV page in the layer_first layout: K of layer 0, V of layer 0, K of layer 1, ..."""
    return [page_size * geometry.token_layer_bytes // 2] * (2 * geometry.layers)
