"""Repacked groups in the SSD tier (real files, no SGLang): pages come back token-identical from their group,
the probe ranks like the keys it quantizes, corrupt chunks are misses, and a repack killed at any moment leaves
every page readable after a restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from sglang_tiered.storage import group_file
from sglang_tiered.storage.groups import as_float
from sglang_tiered.storage.namespace import Namespace
from sglang_tiered.storage.page_file import PAGE_SUFFIX
from sglang_tiered.storage.ssd_tier import SSDTier, check_integrity
from tests.page_cache import drop_from_page_cache

LAYERS, HEADS, DIM, PS = 3, 2, 8, 16
SEG = PS * HEADS * DIM * 2  # bytes of one segment (bf16)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def ns() -> Namespace:
    return Namespace(model="m:1", dtype="torch.bfloat16", page_size=PS, layout="layer_first", layer_num=LAYERS,
                     kv_heads=HEADS, head_dim=DIM)


def key(i: int) -> str:
    return f"{i:064x}"


def bf16_page(seed: int) -> list[memoryview]:
    """A layer_first page of plausible bf16 values (random floats truncated to bf16 bit patterns)."""
    rng = np.random.default_rng(seed)
    vals = rng.standard_normal(2 * LAYERS * PS * HEADS * DIM).astype(np.float32)
    raw = (vals.view(np.uint32) >> 16).astype(np.uint16)
    return [memoryview(bytearray(raw[i * SEG // 2 : (i + 1) * SEG // 2].tobytes())) for i in range(2 * LAYERS)]


def empty() -> list[memoryview]:
    return [memoryview(bytearray(SEG)) for _ in range(2 * LAYERS)]


def joined(segs) -> bytes:
    return b"".join(bytes(s) for s in segs)


def filled(tmp_path, pages: int = 4) -> SSDTier:
    tier = SSDTier(tmp_path, ns(), 1 << 24)
    assert all(tier.write_pages([(key(i), bf16_page(i)) for i in range(pages)]))
    return tier


def test_pages_come_back_token_identical_through_the_map(tmp_path):
    tier = filled(tmp_path)
    keys = [key(i) for i in range(4)]
    assert tier.groups.repack(keys[:3], probe_heads=[0, 1])
    assert not list((tmp_path / ns().id).glob(f"*/{keys[0]}{PAGE_SUFFIX}"))  # the member files are gone
    assert tier.group_of(keys[1]) is not None and tier.group_of(keys[3]) is None and len(tier) == 4
    outs = [empty() for _ in range(4)]
    assert tier.read_pages([(keys[i], outs[i]) for i in (2, 0, 3, 1)]) == [True] * 4
    for i in range(4):
        assert joined(outs[i]) == joined(bf16_page(i)), i
    assert tier.leading_hits(keys) == 4
    assert tier.write_pages([(keys[0], bf16_page(0))]) == [True]  # a member is stored: nothing written
    check_integrity(tier)
    s = tier.stats.snapshot()
    assert s["repacked_groups"] == 1 and s["repacked_pages"] == 3 and s["group_reads"] >= LAYERS

    again = SSDTier(tmp_path, ns(), 1 << 24)  # a restart finds the group
    outs = [empty() for _ in range(3)]
    assert again.read_pages([(keys[i], outs[i]) for i in range(3)]) == [True] * 3
    assert all(joined(outs[i]) == joined(bf16_page(i)) for i in range(3))
    check_integrity(again)


def test_a_group_keeps_the_prompt_order_in_chunks_and_the_probe_ranks_like_the_keys(tmp_path):
    tier = filled(tmp_path, 2)
    assert tier.groups.repack([key(0), key(1)], probe_heads=[1])
    meta = tier.group_of(key(0))
    assert meta.chunks == 2 * PS // meta.chunk
    q, scale = tier.groups.read_probe(meta.gid, 2)
    assert meta.probe_bits == group_file.PROBE_BITS == 4 and q.shape == (2 * PS, 1, DIM // 2)
    approx = group_file.dequantize_probe(q, scale, meta.probe_bits)  # [tokens, 1, DIM] in prompt order
    raw = np.frombuffer(joined(bf16_page(0)) + joined(bf16_page(1)), dtype=np.uint16)
    pages = raw.reshape(2, LAYERS, 2, PS, HEADS, DIM)
    k2 = as_float(pages[:, 2, 0].reshape(2 * PS, HEADS, DIM), "torch.bfloat16")[:, 1:2]  # layer 2, head 1
    exact = k2
    # rounding moves each rotated value by at most half a step (max |rotated key| / 7), and the rotation back keeps
    # the error's length
    step = np.abs(exact[:, 0] @ group_file.rotation(DIM)).max(-1) / 7
    assert (np.linalg.norm(approx - exact, axis=-1)[:, 0] <= np.sqrt(DIM) * step / 2 * 1.01).all()
    query = np.random.default_rng(0).standard_normal(DIM).astype(np.float32)
    top_exact = set(np.argsort(-(exact[:, 0] @ query))[:8].tolist())
    top_probe = set(np.argsort(-(approx[:, 0] @ query))[:8].tolist())
    assert len(top_exact & top_probe) >= 7
    chunks = tier.groups.read_chunks(meta.gid, 0, [1])  # chunk 1 of layer 0: the group's tokens C..2C-1
    c = meta.chunk
    assert list(chunks) == [1] and len(chunks[1][0]) == c * HEADS * DIM * 2
    tokens = pages.transpose(1, 2, 0, 3, 4, 5).reshape(LAYERS, 2, 2 * PS, HEADS, DIM)  # [layer, k/v, token, h, d]
    assert bytes(chunks[1][0]) == tokens[0, 0, c : 2 * c].tobytes()
    assert bytes(chunks[1][1]) == tokens[0, 1, c : 2 * c].tobytes()


def test_chunks_that_cross_pages_and_a_shorter_last_chunk_hold_the_prompts_tokens(tmp_path):
    tier = filled(tmp_path, 2)
    keys = [key(0), key(1)]
    assert tier.groups.repack(keys, probe_heads=[0], chunk=12)  # 32 tokens: [0, 12), [12, 24) across pages, [24, 32)
    meta = tier.group_of(key(0))
    assert meta.chunks == 3
    raw = np.frombuffer(joined(bf16_page(0)) + joined(bf16_page(1)), dtype=np.uint16)
    tokens = raw.reshape(2, LAYERS, 2, PS, HEADS, DIM).transpose(1, 2, 0, 3, 4, 5).reshape(LAYERS, 2, 2 * PS, -1)
    for layer in range(LAYERS):
        chunks = tier.groups.read_chunks(meta.gid, layer, [0, 1, 2])
        for c, (start, end) in enumerate([(0, 12), (12, 24), (24, 32)]):
            assert bytes(chunks[c][0]) == tokens[layer, 0, start:end].tobytes()
            assert bytes(chunks[c][1]) == tokens[layer, 1, start:end].tobytes()
    outs = [empty() for _ in range(2)]
    assert tier.read_pages([(keys[i], outs[i]) for i in range(2)]) == [True] * 2
    assert all(joined(outs[i]) == joined(bf16_page(i)) for i in range(2))


@pytest.mark.parametrize("bits", [4, 8])
def test_probe_quantization_round_trip(bits):
    rng = np.random.default_rng(bits)
    keys = rng.standard_normal((50, 3, 64)).astype(np.float32)
    keys[:, :, 5] *= 20  # an outlier channel, as RoPE keys have
    q, scale = group_file.quantize_probe(keys, bits)
    assert q.dtype == np.uint8 and q.shape == (50, 3, 64 * bits // 8) and scale.shape == (50, 3)
    back = group_file.dequantize_probe(q, scale, bits)
    err = np.linalg.norm(back - keys, axis=-1) / np.linalg.norm(keys, axis=-1)
    assert err.max() < (0.03 if bits == 8 else 0.15)
    r = group_file.rotation(64)
    assert np.allclose(r @ r, np.eye(64), atol=1e-6) and np.allclose(r, r.T)
    assert np.allclose(group_file.rotation(48) @ group_file.rotation(48), np.eye(48), atol=1e-6)  # blocks of 16
    with pytest.raises(ValueError):
        group_file.quantize_probe(keys[..., :63], 4)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_repack_writes_the_probe_with_the_bits_asked_for(tmp_path, bits):
    tier = filled(tmp_path, 2)
    assert tier.groups.repack([key(0), key(1)], probe_heads=[0, 1], probe_bits=bits)
    meta = tier.group_of(key(0))
    q, scale = tier.groups.read_probe(meta.gid, 0)
    assert meta.probe_bits == bits and q.nbytes + scale.nbytes == meta.probe_layer_bytes == 2 * PS * 2 * (
        DIM * bits // 8 + 2)


def test_an_odd_head_dim_gets_the_8_bit_probe():
    from sglang_tiered.storage.groups import assemble

    odd = Namespace(model="m:1", dtype="torch.bfloat16", page_size=PS, layout="layer_first", layer_num=LAYERS,
                    kv_heads=HEADS, head_dim=7)
    payloads = [np.random.default_rng(i).integers(0, 1 << 14, LAYERS * 2 * PS * HEADS * 7, dtype=np.uint16).tobytes()
                for i in range(2)]
    meta, probes, _ = assemble(odd, [key(0), key(1)], payloads, [0], probe_bits=4)
    assert meta["probe_bits"] == 8 and probes[0][0].shape == (2 * PS, 1, 7)


def test_a_group_of_another_format_is_removed_at_startup_and_its_pages_are_misses(tmp_path):
    tier = filled(tmp_path, 3)
    assert tier.groups.repack([key(0), key(1)], probe_heads=[0])
    (path,) = tmp_path.rglob(f"*{group_file.GROUP_SUFFIX}")
    other = bytearray(path.read_bytes())
    other[: len(group_file.MAGIC)] = b"SGTKG\x00\x01\x00"  # the same bytes under another format's magic
    path.write_bytes(bytes(other))
    again = SSDTier(tmp_path, ns(), 1 << 24)  # a restart: the group is unreadable
    assert not path.exists() and again.group_of(key(0)) is None
    assert not again.contains(key(0)) and not again.contains(key(1)) and again.contains(key(2))
    assert again.read_pages([(key(0), empty())]) == [False]
    out = empty()
    assert again.read_pages([(key(2), out)]) == [True] and joined(out) == joined(bf16_page(2))
    check_integrity(again)


def test_a_corrupt_chunk_is_a_counted_miss_never_data(tmp_path):
    tier = filled(tmp_path, 2)
    assert tier.groups.repack([key(0), key(1)], probe_heads=[0])
    path = next((tmp_path / ns().id / "groups").glob("*.kvg"))
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x01  # last chunk of the last layer
    path.write_bytes(bytes(data))
    meta = tier.group_of(key(0))
    assert tier.groups.read_chunks(meta.gid, 0, [0]) is not None  # other chunks still verify
    assert tier.groups.read_chunks(meta.gid, LAYERS - 1, [meta.chunks - 1]) is None
    assert not tier.contains(key(0)) and not path.exists()  # the group is gone, both pages with it
    assert tier.read_pages([(key(0), empty())]) == [False]
    assert tier.stats.snapshot()["corrupt_pages"] == 2
    check_integrity(tier)


def test_repack_refuses_missing_or_grouped_pages(tmp_path):
    tier = filled(tmp_path, 2)
    assert not tier.groups.repack([key(0), key(7)], probe_heads=[0])
    assert tier.groups.repack([key(0), key(1)], probe_heads=[0])
    assert not tier.groups.repack([key(0), key(1)], probe_heads=[0])  # already a group


def test_groups_are_evicted_as_one_unit_within_capacity(tmp_path):
    one = 2 * LAYERS * SEG
    tier = SSDTier(tmp_path, ns(), 8 * one)  # during a repack, old pages and the new group coexist
    assert all(tier.write_pages([(key(i), bf16_page(i)) for i in range(4)]))
    assert tier.groups.repack([key(0), key(1)], probe_heads=[0])
    assert tier.read_pages([(key(2), empty()), (key(3), empty())]) == [True, True]  # the group is now the LRU
    assert all(tier.write_pages([(key(i), bf16_page(i)) for i in range(4, 8)]))  # needs room: the group goes
    assert not tier.contains(key(0)) and not tier.contains(key(1)) and tier.contains(key(7))
    assert not list((tmp_path / ns().id / "groups").glob("*.kvg"))
    check_integrity(tier)


REPACKER = textwrap.dedent(
    """
    import sys, random
    sys.path.insert(0, {root!r})
    from tests.unit.test_groups import filled, key
    from pathlib import Path
    tier = filled(Path(sys.argv[1]), 24)
    print("filled", flush=True)
    for g in range(0, 24, 3):
        tier.groups.repack([key(g + j) for j in range(3)], probe_heads=[0, 1])
        print("group", g, flush=True)
    """
)


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.15, 0.3])
def test_a_repack_killed_at_any_moment_loses_nothing(tmp_path, delay):
    proc = subprocess.Popen([sys.executable, "-c", REPACKER.format(root=ROOT), str(tmp_path)],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "filled"
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    tier = SSDTier(tmp_path, ns(), 1 << 24)  # restart: sweep temporaries, members of committed groups removed
    assert not list((tmp_path / ns().id).rglob("*.tmp"))
    outs = [empty() for _ in range(24)]
    assert tier.read_pages([(key(i), outs[i]) for i in range(24)]) == [True] * 24
    assert all(joined(outs[i]) == joined(bf16_page(i)) for i in range(24))
    check_integrity(tier)


def test_the_repacker_writes_an_offers_pages_as_one_group_in_chunks(tmp_path):
    from sglang_tiered.storage.repacker import Repacker

    tier = filled(tmp_path, pages=4)
    keys = [key(i) for i in range(4)]
    repacker = Repacker(tier, probe_heads=[0], chunk=8)
    try:
        repacker.offer(keys)
        repacker.flush()
    finally:
        repacker.close()
    meta = tier.group_of(keys[0])
    assert meta is not None and meta.keys == tuple(keys) and meta.chunk == 8 and meta.chunks == 4 * PS // 8
    outs = [empty() for _ in range(4)]
    assert tier.read_pages([(keys[i], outs[i]) for i in range(4)]) == [True] * 4
    assert all(joined(outs[i]) == joined(bf16_page(i)) for i in range(4))


def test_a_repack_takes_the_pages_kept_at_their_write_and_reads_none_back(tmp_path):
    from sglang_tiered.storage.stash import PayloadStash

    keys = [key(i) for i in range(4)]
    plain = filled(tmp_path / "plain")  # the same pages, repacked from their files
    assert plain.groups.repack(keys, probe_heads=[0, 1])
    tier = SSDTier(tmp_path / "kept", ns(), 1 << 24)
    stash = PayloadStash(1 << 20)
    tier.attach_stash(stash)
    stash.expect(keys[:3])  # the fourth page was written before its offer: read back
    assert all(tier.write_pages([(key(i), bf16_page(i)) for i in range(4)]))
    for k in keys[:3]:  # damage the kept pages' files: a repack that read them would find them corrupt
        (path,) = (tmp_path / "kept").glob(f"*/*/{k}{PAGE_SUFFIX}")
        path.write_bytes(path.read_bytes()[:-1] + b"?")
    assert tier.groups.repack(keys, probe_heads=[0, 1])
    s = tier.stats.snapshot()
    assert (s["repack_pages_kept"], s["repack_pages_read"], s["corrupt_pages"]) == (3, 1, 0)
    assert s["repack_bytes_read"] == 2 * LAYERS * SEG and s["bytes_read"] == 0  # a repack read is no request's hit
    for i in range(4):
        out, ref = empty(), empty()
        assert tier.read_pages([(keys[i], out)]) == [True] and plain.read_pages([(keys[i], ref)]) == [True]
        assert joined(out) == joined(ref) == joined(bf16_page(i)), i
    stash.forget(keys[:3])
    assert stash.used_bytes == 0


def test_the_repacker_keeps_an_offers_pages_and_leaves_nothing_behind(tmp_path):
    from sglang_tiered.storage.repacker import Repacker
    from sglang_tiered.storage.stash import PayloadStash

    tier = SSDTier(tmp_path, ns(), 1 << 24)
    stash = PayloadStash(2 * 2 * LAYERS * SEG)  # room for two of the four pages
    tier.attach_stash(stash)
    keys = [key(i) for i in range(4)]
    repacker = Repacker(tier, probe_heads=[0], chunk=8, stash=stash)
    try:
        repacker.offer(keys)  # before the write-through, as capture offers a prompt's pages
        assert all(tier.write_pages([(key(i), bf16_page(i)) for i in range(4)]))
        repacker.flush()
    finally:
        repacker.close()
    s = tier.stats.snapshot()
    assert (s["repacked_pages"], s["repack_pages_kept"], s["repack_pages_read"]) == (4, 2, 2)
    assert stash.used_bytes == 0 and not stash.keep(keys[0], bf16_page(0))  # forgotten once repacked
    for i in range(4):
        out = empty()
        assert tier.read_pages([(keys[i], out)]) == [True] and joined(out) == joined(bf16_page(i))


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes")).split()[1])


def test_a_chunk_read_reads_the_chunk_from_the_device_not_the_readahead_around_it(tmp_path):
    big = Namespace(model="m:1", dtype="torch.bfloat16", page_size=64, layout="layer_first", layer_num=8,
                    kv_heads=4, head_dim=64)
    tier = SSDTier(tmp_path, big, 1 << 28)
    seg = 64 * 4 * 64 * 2
    keys = [key(i) for i in range(16)]  # 1024 tokens: 1 MiB of K and V per layer, a group of about 9 MiB
    rng = np.random.default_rng(0)
    assert all(tier.write_pages([(k, [memoryview(rng.integers(0, 1 << 14, seg // 2, dtype=np.uint16).tobytes())
                                      for _ in range(16)]) for k in keys]))
    assert tier.groups.repack(keys, probe_heads=[0])
    meta = tier.group_of(keys[0])
    (path,) = list(tmp_path.glob("*/groups/*.kvg"))
    drop_from_page_cache(path)
    before = _read_bytes()
    for c in range(10, 18):  # one chunk (16 tokens: 16 KiB of K and V) at a time, as a sparse load reads its picks
        assert tier.groups.read_chunks(meta.gid, 3, [c]) is not None
    chunks_read = _read_bytes() - before
    drop_from_page_cache(path)
    before = _read_bytes()
    assert tier.groups.read_chunks(meta.gid, 3, range(meta.chunks)) is not None
    if _read_bytes() - before == 0:
        pytest.skip("tmp_path is not on a block device (reads are not counted)")
    assert 8 * 16 * 1024 <= chunks_read <= 8 * 20 * 1024, chunks_read  # the chunks, rounded out to 4 KiB pages


def test_a_refused_readahead_advice_still_reads_the_group(tmp_path, monkeypatch):
    tier = filled(tmp_path)
    assert tier.groups.repack([key(0), key(1)], probe_heads=[0])
    meta = tier.group_of(key(0))

    def refuse(*args):
        raise OSError(22, "fadvise not supported here")

    monkeypatch.setattr(os, "posix_fadvise", refuse)
    assert tier.groups.read_chunks(meta.gid, 0, [0]) is not None
    assert tier.groups.read_probe(meta.gid, 0) is not None
    assert tier.stats.snapshot()["io_errors"] == 0
