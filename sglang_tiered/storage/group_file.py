"""On-disk format of a repacked group: the pages of a run of consecutive prefix pages, rewritten as one file in
prompt order, in chunks that a sparse load reads one by one, with a small quantized probe for scoring. Pure format:
numpy and files, no torch, no SGLang.

A group replaces its member pages (`<key>.kvp`) by one file, `<gid>.kvg`::

    magic b"SGTKG\\x00\\x02\\x00" | meta_len u32 | meta_crc32 u32 | meta (msgpack) | probe section | data section

meta: {"ns", "gid", "keys": [page keys, logical order], "page_size", "tokens" T, "layers" L, "heads" H, "dim" D,
       "dtype" (numpy name of the KV element, e.g. "bfloat16" stored as 2-byte "V2"), "itemsize",
       "probe_heads": [KV heads in the probe],
       "chunk": C (tokens per data chunk), "probe_bits": 4 or 8,
       "probe_crc": [per layer], "data_crc": [per layer, per chunk]}

* Tokens are in the prompt's order (what SGLang's page keys name): token i of the group is token i % page_size of
  member page i // page_size. A sparse load reads the chunks that hold the tokens it picked: whole 16-token runs,
  so picks of neighbouring tokens (a fact is a run of tokens) share their reads. Ordering the chunks by importance
  instead bought nothing: SSD hits 0.95-1.05x as fast as in prompt order at the same bytes in benchmarks/importance.py
  runs on two machines, 0.86x on a disk limited to 3,000 IOPS (a chunk is already a dense read).
* Probe section, per layer: the keys of `probe_heads` for every token, quantized symmetrically per token and head --
  [T, h, D * bits / 8] bytes followed by fp16 scales [T, h]. 4 bits (written now): each key is first rotated by
  `rotation(D)`, an orthonormal (block) Hadamard matrix that spreads RoPE's outlier channels over all channels, then
  two values per byte (low nibble first, offset by 8); dequantizing rotates back. Scoring needs only a ranking: on
  SmolLM2 the rotated 4-bit probe passes the gate on nearly as many layers as the 8-bit one (0.70 vs 0.72 of them,
  benchmarks/importance.py part quality) at half its bytes; unrotated 4 bits passed on 0.61 (a one-off engine
  experiment on the same 24 documents, not part of the benchmark). 8 bits: plain int8.
* Data section, per layer, per chunk of C tokens: K [C, H, D] then V [C, H, D] (the last chunk may be shorter).
* Every probe layer and every data chunk has its own crc32: a sparse load reads and verifies only what it uses.
"""

from __future__ import annotations

import functools
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
import numpy as np

from sglang_tiered.storage.checksum import crc32
from sglang_tiered.storage.page_file import read_meta_block, write_file

MAGIC = b"SGTKG\x00\x02\x00"  # groups of another format are unreadable: removed at startup, their pages missed
PROBE_BITS = 4  # what new groups are written with (config.TieredConfig.importance_probe_bits)
PROBE_BITS_CHOICES = (4, 8)  # the widths this format reads and writes (config.PROBE_BITS_CHOICES)
_FIXED = struct.Struct("<8sII")
GROUP_SUFFIX = ".kvg"


class GroupError(Exception):
    """The group cannot be served (torn, corrupt, foreign)."""


@dataclass(frozen=True)
class GroupMeta:
    ns: str
    gid: str
    keys: tuple[str, ...]
    page_size: int
    tokens: int
    layers: int
    heads: int
    dim: int
    itemsize: int
    probe_heads: tuple[int, ...]
    chunk: int
    probe_crc: tuple[int, ...]
    data_crc: tuple[tuple[int, ...], ...]
    offset: int = 0  # where the probe section starts in the file
    probe_bits: int = 8

    @property
    def chunks(self) -> int:
        return -(-self.tokens // self.chunk)

    @property
    def row_bytes(self) -> int:
        """K or V of one token, all heads."""
        return self.heads * self.dim * self.itemsize

    @property
    def probe_layer_bytes(self) -> int:
        return probe_layer_bytes(self.tokens, len(self.probe_heads), self.dim, self.probe_bits)

    @property
    def data_layer_bytes(self) -> int:
        return 2 * self.tokens * self.row_bytes

    def probe_offset(self, layer: int) -> int:
        return self.offset + layer * self.probe_layer_bytes

    def chunk_offset(self, layer: int, chunk: int) -> int:
        base = self.offset + self.layers * self.probe_layer_bytes + layer * self.data_layer_bytes
        return base + 2 * chunk * self.chunk * self.row_bytes

    def chunk_tokens(self, chunk: int) -> int:
        return min(self.chunk, self.tokens - chunk * self.chunk)

    @property
    def file_bytes(self) -> int:
        return self.offset + self.layers * (self.probe_layer_bytes + self.data_layer_bytes)


@functools.lru_cache(maxsize=8)
def rotation(dim: int) -> np.ndarray:
    """Orthonormal, symmetric float32 [dim, dim] (read-only): block-diagonal Sylvester Hadamard matrices of the
    largest power of two that divides `dim` (its own inverse)."""
    block = dim & -dim
    h = np.ones((1, 1))
    while h.shape[0] < block:
        h = np.block([[h, h], [h, -h]])
    r = np.kron(np.eye(dim // block), h / np.sqrt(block)).astype(np.float32)
    r.setflags(write=False)
    return r


def probe_layer_bytes(tokens: int, heads: int, dim: int, bits: int) -> int:
    """Bytes of one layer's probe: `bits`-bit keys of `heads` heads per token, and an fp16 scale per token and head."""
    return tokens * heads * (dim * bits // 8 + 2)


def quantize_probe(keys: np.ndarray, bits: int = PROBE_BITS) -> tuple[np.ndarray, np.ndarray]:
    """float keys [T, h, D] -> (uint8 [T, h, D * bits / 8], fp16 scales [T, h]); see the module docstring."""
    if bits not in PROBE_BITS_CHOICES or (bits == 4 and keys.shape[-1] % 2):
        raise ValueError(f"a probe has 8 bits, or 4 with an even head dim; got {bits} bits, dim {keys.shape[-1]}")
    k = keys @ rotation(keys.shape[-1]) if bits == 4 else keys.astype(np.float32)  # a new array: scaled in place
    top = 2 ** (bits - 1) - 1
    scale = (np.abs(k).max(-1) / top).astype(np.float16)
    scale[scale == 0] = 1.0
    k /= scale.astype(np.float32)[..., None]
    np.clip(np.rint(k, out=k), -top, top, out=k)
    q = k.astype(np.int8)
    if bits == 8:
        return q.view(np.uint8), scale
    q += 8  # 1..15
    pairs = q.view("<u2")  # value 2i in the low byte, 2i + 1 in the high byte
    return (pairs | (pairs >> 4)).astype(np.uint8), scale  # low nibble first


def dequantize_probe(q: np.ndarray, scale: np.ndarray, bits: int) -> np.ndarray:
    """The inverse of `quantize_probe` (up to rounding): float32 keys [T, h, D]. `bits` must be what the probe was
    written with (a group's meta.probe_bits): no default, a wrong width would decode garbage."""
    if bits == 8:
        return q.view(np.int8).astype(np.float32) * scale.astype(np.float32)[..., None]
    vals = np.stack([q & 15, q >> 4], -1).reshape(*q.shape[:-1], -1).astype(np.float32) - 8
    k = vals * scale.astype(np.float32)[..., None]
    return k @ rotation(k.shape[-1])


def write_group(path: str, meta: dict, probes: Sequence[tuple[np.ndarray, np.ndarray]],
                data: Sequence[Sequence[memoryview]]) -> int:
    """Write a group atomically (temp file + rename). `meta` holds the fields of the module docstring except the
    checksums; `probes[l]` = `quantize_probe`'s (keys, scales) with meta["probe_bits"]; `data[l][c]` = the bytes of
    chunk c of layer l (its K [C, H, D] then its V, raw elements in prompt order). Returns bytes written."""
    probe_bytes = [memoryview(q.tobytes() + s.tobytes()) for q, s in probes]
    full = dict(meta, probe_crc=[crc32(b) for b in probe_bytes], data_crc=[[crc32(c) for c in layer] for layer in data])
    blob = msgpack.packb(full)
    head = memoryview(_FIXED.pack(MAGIC, len(blob), crc32(blob)) + blob)
    return write_file(path, [head, *probe_bytes, *(c for layer in data for c in layer)])


def read_meta(fd: int) -> GroupMeta:
    m, offset = read_meta_block(fd, MAGIC, 1 << 24, GroupError)
    try:
        meta = GroupMeta(str(m["ns"]), str(m["gid"]), tuple(m["keys"]), int(m["page_size"]), int(m["tokens"]),
                         int(m["layers"]), int(m["heads"]), int(m["dim"]), int(m["itemsize"]),
                         tuple(m["probe_heads"]), int(m["chunk"]), tuple(m["probe_crc"]),
                         tuple(tuple(x) for x in m["data_crc"]), offset, int(m["probe_bits"]))
    except Exception as exc:
        raise GroupError(f"bad metadata: {exc}") from exc
    if os.fstat(fd).st_size != meta.file_bytes:
        raise GroupError("size does not match the metadata")
    return meta


def _read(fd: int, offset: int, n: int, crc: int, what: str) -> bytes:
    b = os.pread(fd, n, offset)
    if len(b) != n or crc32(b) != crc:
        raise GroupError(f"{what} checksum mismatch")
    return b


def read_probe(fd: int, meta: GroupMeta, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """(quantized keys uint8 [T, h, D * bits / 8], fp16 scales [T, h]) of one layer, verified (`dequantize_probe`
    with meta.probe_bits reads them)."""
    b = _read(fd, meta.probe_offset(layer), meta.probe_layer_bytes, meta.probe_crc[layer], f"probe layer {layer}")
    h, t, row = len(meta.probe_heads), meta.tokens, meta.dim * meta.probe_bits // 8
    q = np.frombuffer(b, dtype=np.uint8, count=t * h * row).reshape(t, h, row)
    s = np.frombuffer(b, dtype=np.float16, offset=t * h * row).reshape(t, h)
    return q, s


def read_chunks(fd: int, meta: GroupMeta, layer: int,
                chunks: Sequence[int]) -> dict[int, tuple[memoryview, memoryview]]:
    """{chunk: (K bytes, V bytes)} of one layer, each chunk verified; consecutive chunks are read in one call (the
    values are views of that read: no copies)."""
    out: dict[int, tuple[memoryview, memoryview]] = {}
    wanted = sorted(set(chunks))
    i = 0
    while i < len(wanted):
        j = i
        while j + 1 < len(wanted) and wanted[j + 1] == wanted[j] + 1:
            j += 1
        start, end = meta.chunk_offset(layer, wanted[i]), meta.chunk_offset(layer, wanted[j]) + \
            2 * meta.chunk_tokens(wanted[j]) * meta.row_bytes
        blob = memoryview(os.pread(fd, end - start, start))
        if len(blob) != end - start:
            raise GroupError(f"short read of layer {layer} chunks {wanted[i]}..{wanted[j]}")
        pos = 0
        for c in wanted[i : j + 1]:
            n = meta.chunk_tokens(c) * meta.row_bytes
            piece = blob[pos : pos + 2 * n]
            if crc32(piece) != meta.data_crc[layer][c]:
                raise GroupError(f"layer {layer} chunk {c} checksum mismatch")
            out[c] = (piece[:n], piece[n:])
            pos += 2 * n
        i = j + 1
    return out
