"""Repacking pages into a group, and reading pages back out of one (numpy, no torch/SGLang).

Pages are in SGLang's `layer_first` host layout: 2 x layers segments per page, K of layer 0, V of layer 0, K of
layer 1, ... each [page_size, kv_heads, head_dim] elements. A group holds the same bytes per token, in prompt
order, per layer in chunks (`group_file.py`); `pages_from_group` turns a group's data back into that page layout,
token-identical.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from sglang_tiered.storage.group_file import PROBE_BITS, GroupMeta, probe_layer_bytes, quantize_probe, write_group
from sglang_tiered.storage.namespace import Namespace

ITEMSIZE = {"torch.bfloat16": 2, "torch.float16": 2, "torch.float32": 4}
_RAW = {2: np.uint16, 4: np.uint32}


def itemsize(ns: Namespace) -> int:
    try:
        return ITEMSIZE[ns.dtype]
    except KeyError:
        raise ValueError(f"cannot repack pages of dtype {ns.dtype}") from None


def as_float(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Raw element array (uint16/uint32 bit patterns) -> float32 values."""
    if dtype == "torch.bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    if dtype == "torch.float16":
        return raw.view(np.float16).astype(np.float32)
    return raw.view(np.float32)


def group_id(keys: Sequence[str]) -> str:
    return hashlib.sha256("".join(keys).encode()).hexdigest()[:32]


def assemble(ns: Namespace, keys: Sequence[str], payloads: Sequence[bytes], probe_heads: Sequence[int],
             chunk: int = 16, probe_bits: int = PROBE_BITS) -> tuple[dict, list, list]:
    """(meta, probes, data) for `group_file.write_group` from the member pages' payloads (in prompt order)."""
    size, layers, ps = itemsize(ns), ns.layer_num, ns.page_size
    h, d = ns.kv_heads, ns.head_dim
    tokens = len(keys) * ps
    pages = [np.frombuffer(p, dtype=_RAW[size]).reshape(layers, 2, ps, h * d) for p in payloads]
    bits = probe_bits_for(ns, probe_bits)
    probes, data = [], []
    for layer in range(layers):
        k = np.concatenate([page[layer, 0] for page in pages])  # [tokens, h * d] in prompt order
        v = np.concatenate([page[layer, 1] for page in pages])
        probes.append(quantize_probe(as_float(k.reshape(tokens, h, d)[:, list(probe_heads)], ns.dtype), bits))
        data.append(_chunks(k, v, chunk))
    meta = {"ns": ns.id, "gid": group_id(keys), "keys": list(keys), "page_size": ps, "tokens": tokens,
            "layers": layers, "heads": h, "dim": d, "itemsize": size,
            "probe_heads": [int(x) for x in probe_heads], "chunk": chunk, "probe_bits": bits}
    return meta, probes, data


def probe_bits_for(ns: Namespace, probe_bits: int) -> int:
    """The bits a group's probe is written with: 4-bit probes pack two values per byte (an even head dim), else 8."""
    return probe_bits if ns.head_dim % 2 == 0 else 8


def group_bytes_bound(ns: Namespace, keys: Sequence[str], payload_bytes: int, probe_heads: Sequence[int],
                      chunk: int, probe_bits: int) -> int:
    """An upper bound of the size of the group file `build_group` writes for these pages (metadata included)."""
    tokens, layers = len(keys) * ns.page_size, ns.layer_num
    probe = layers * probe_layer_bytes(tokens, len(probe_heads), ns.head_dim, probe_bits_for(ns, probe_bits))
    chunks = -(-tokens // chunk)
    return payload_bytes + probe + 1024 + 72 * len(keys) + 5 * tokens + 5 * layers * (chunks + 1)


def build_group(path: str, ns: Namespace, keys: Sequence[str], payloads: Sequence[bytes], probe_heads: Sequence[int],
                chunk: int = 16, probe_bits: int = PROBE_BITS) -> int:
    """Assemble the member pages' payloads (in prompt order) and write the group file at `path` (atomically).
    Returns the bytes written; raises OSError (no file left at `path`) or ValueError."""
    return write_group(path, *assemble(ns, keys, payloads, probe_heads, chunk, probe_bits))


def _chunks(k: np.ndarray, v: np.ndarray, chunk: int) -> list[memoryview]:
    """One layer's data section: for each `chunk` tokens of K and V [T, row] (the last chunk may be shorter), a
    buffer of its K then its V (views of one new array)."""
    tokens, row = k.shape
    full = tokens // chunk
    body = np.stack([k[: full * chunk].reshape(full, chunk * row), v[: full * chunk].reshape(full, chunk * row)], 1)
    out = [memoryview(c).cast("B") for c in body.reshape(full, 2 * chunk * row)]
    if full * chunk < tokens:
        out.append(memoryview(np.concatenate([k[full * chunk :].ravel(), v[full * chunk :].ravel()])).cast("B"))
    return out


def pages_from_group(meta: GroupMeta, layers: Sequence[dict[int, tuple[bytes, bytes]]],
                     wanted: Sequence[int]) -> list[bytes]:
    """Page payloads (layer_first bytes) of the member pages `wanted` (indices into meta.keys), from every chunk of
    every layer (`layers[l]` = `group_file.read_chunks` of all chunks of layer l)."""
    raw_t = _RAW[meta.itemsize]
    ps, shape = meta.page_size, (meta.heads, meta.dim)
    per_layer = []
    for chunks in layers:
        k = np.concatenate([np.frombuffer(chunks[c][0], dtype=raw_t) for c in range(meta.chunks)])
        v = np.concatenate([np.frombuffer(chunks[c][1], dtype=raw_t) for c in range(meta.chunks)])
        per_layer.append((k.reshape(meta.tokens, *shape), v.reshape(meta.tokens, *shape)))
    out = []
    for j in wanted:
        out.append(b"".join(k[j * ps : (j + 1) * ps].tobytes() + v[j * ps : (j + 1) * ps].tobytes()
                            for k, v in per_layer))
    return out
