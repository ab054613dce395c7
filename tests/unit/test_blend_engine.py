"""Blending of stored chunk KV (selective recompute, gradual filtering), the chunk store and the loading controller.
No SGLang: the layer-by-layer engine, real files for the SSD tier, the real SmolLM2 where quality matters."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_tiered.engine import blend as blend_engine
from sglang_tiered.engine.blend import (
    MODES,
    Span,
    blend_prefill,
    filter_schedule,
    greedy_continue,
    shares,
    top_deviation,
    top_rows,
)
from sglang_tiered.engine.llama import LlamaConfig, LlamaModel
from sglang_tiered.engine.tuning import load_model
from sglang_tiered.policy.loading import LoadingController
from sglang_tiered.storage.chunk_store import ChunkMiss, ChunkStore, chunk_key
from sglang_tiered.storage.namespace import Namespace
from sglang_tiered.storage.ssd_tier import SSDTier

GQA = LlamaConfig(hidden=96, layers=5, heads=6, kv_heads=2, head_dim=16, intermediate=192, vocab=300)
TOL = 1e-4


def standalone(model: LlamaModel, ids: torch.Tensor, spans: list[Span]) -> dict[int, torch.Tensor]:
    """Position-0 KV of every stored span (what the chunk store would hold)."""
    return {i: model.prefill(ids[s.start : s.end]).kv for i, s in enumerate(spans) if s.stored}


def run(model, ids, spans, **kw):
    kvs = standalone(model, ids, spans)
    return blend_prefill(model, ids, spans, lambda layer, i: kvs[i][layer], **kw)


def prompt(lengths: list[int], stored: list[bool], vocab: int, seed: int = 0):
    ids = torch.randint(0, vocab, (sum(lengths),), generator=torch.Generator().manual_seed(seed))
    spans, pos = [], 0
    for n, s in zip(lengths, stored):
        spans.append(Span(pos, pos + n, s))
        pos += n
    return ids, spans


def rope64(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    half = x.shape[-1] // 2
    inv = 1.0 / theta ** (torch.arange(half, dtype=torch.float64) / half)
    ang = positions.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    xd = x.double()
    return xd * cos + torch.cat([-xd[..., half:], xd[..., :half]], -1) * sin


@pytest.fixture(scope="module")
def gqa():
    return LlamaModel.random(GQA, seed=3)


def test_rerotated_keys_equal_keys_computed_at_the_target_position(gqa):
    """What blending relies on: keys rotated at positions p, rotated again by delta, are the keys at p + delta."""
    x = torch.randn(11, GQA.kv_heads, GQA.head_dim, generator=torch.Generator().manual_seed(0))
    at_zero = gqa.rope(x, torch.arange(11))
    for delta in (1, 37, 4000):
        moved = gqa.rope(at_zero, torch.full((11,), delta))
        direct = gqa.rope(x, torch.arange(delta, delta + 11))
        exact = rope64(x, torch.arange(delta, delta + 11), GQA.rope_theta)
        # fp32 angles at position p are off by ~p * 2**-24 rad in both computations: compare against fp64
        direct_err = (direct.double() - exact).abs().max().item()
        assert (moved.double() - exact).abs().max().item() <= 2 * direct_err + 1e-5


@pytest.mark.parametrize("mode", ["blend", "single"])
def test_ratio_one_equals_full_prefill(gqa, mode):
    ids, spans = prompt([20, 17, 23, 6], [True, True, True, False], GQA.vocab)
    full = gqa.prefill(ids)
    blended = run(gqa, ids, spans, mode=mode, ratio=1.0)
    assert (blended.logits - full.logits).abs().max().item() <= TOL
    assert (blended.kv - full.kv).abs().max().item() <= TOL
    assert blended.computed == [ids.shape[0]] * GQA.layers


def test_prefix_mode_is_exact_and_computes_only_the_rest(gqa):
    ids, spans = prompt([24, 19, 5], [True, False, False], GQA.vocab)
    full = gqa.prefill(ids)
    blended = run(gqa, ids, spans, mode="prefix")
    assert (blended.logits - full.logits).abs().max().item() <= TOL
    assert (blended.kv - full.kv).abs().max().item() <= TOL
    assert blended.computed == [24] * GQA.layers


def test_full_reuse_computes_only_fresh_tokens_and_keeps_stored_kv(gqa):
    ids, spans = prompt([16, 9, 21, 4], [True, False, True, False], GQA.vocab)
    kvs = standalone(gqa, ids, spans)
    blended = blend_prefill(gqa, ids, spans, lambda layer, i: kvs[i][layer], mode="reuse")
    assert blended.computed == [13] * GQA.layers
    # the third span's stored keys, moved from position 0 to position 25, on every layer
    for layer in range(GQA.layers):
        want_k = gqa.rope(kvs[2][layer, :, 0], torch.full((21,), 25))
        assert torch.equal(blended.kv[layer, 25:46, 0], want_k)
        assert torch.equal(blended.kv[layer, 25:46, 1], kvs[2][layer, :, 1])
    # layer 0 depends on the token alone: the fresh tokens' layer-0 KV equals full prefill's
    full = gqa.prefill(ids)
    assert (blended.kv[0, 16:25] - full.kv[0, 16:25]).abs().max().item() <= TOL


def test_gradual_filter_schedule_and_bookkeeping(gqa):
    sched = filter_schedule(0.15, layers=30, check_layer=1, spread=0.3)
    assert len(sched) == 28 and math.isclose(sum(sched) / len(sched), 0.15)
    assert sched[0] > 0.15 > sched[-1] and all(a > b for a, b in zip(sched, sched[1:]))
    assert filter_schedule(1.0, 30, 1) == [1.0] * 28  # clamped: never above 1, mean still the ratio

    lengths, stored = [30, 25, 35, 7], [True, True, True, False]
    ids, spans = prompt(lengths, stored, GQA.vocab, seed=5)
    n_reused, fresh = 90, 7
    blended = run(gqa, ids, spans, mode="blend", ratio=0.3, check_layer=1)
    sched = filter_schedule(0.3, GQA.layers, 1)
    assert blended.computed[:2] == [97, 97]  # layers 0 and 1 compute everything
    want = [fresh + math.ceil(f * n_reused) for f in sched]  # selection at layer l is computed on layer l + 1
    assert blended.computed[2:] == want
    single = run(gqa, ids, spans, mode="single", ratio=0.3, check_layer=1)
    assert single.computed == [97, 97] + [fresh + math.ceil(0.3 * n_reused)] * (GQA.layers - 2)


@pytest.mark.parametrize("mode", ["single", "blend"])
def test_a_token_leaving_the_selection_skips_that_layers_attention_and_mlp(gqa, mode):
    """Its K, V of the layer are written (they ranked it); its attention output would feed a hidden state no later
    layer reads, so none is computed: the attention of layer l covers exactly the tokens computed on layer l + 1."""
    ids, spans = prompt([30, 25, 35, 7], [True, True, True, False], GQA.vocab, seed=5)
    attended: dict[int, list[int]] = {}
    res = run(gqa, ids, spans, mode=mode, ratio=0.3, check_layer=1,
              trace=lambda layer, pos, attn: attended.__setitem__(layer, pos.tolist()))
    assert len(attended[0]) == 97  # layer 0: every token (the check layer needs everyone's hidden state)
    for layer in range(1, GQA.layers - 1):
        assert len(attended[layer]) == res.computed[layer + 1] < 97
        assert 96 in attended[layer]  # the last prompt token always
    kvs = standalone(gqa, ids, spans)
    kept = set(attended[1])
    dropped = [t for t in range(90) if t not in kept]
    stored = torch.cat([kvs[i][1] for i in range(3)])
    assert not torch.equal(res.kv[1, dropped], stored[dropped])  # layer 1's fresh KV of the dropped tokens is kept
    assert torch.equal(res.kv[2, dropped, 1], torch.cat([kvs[i][2] for i in range(3)])[dropped, 1])  # then reused


def test_top_deviation_picks_the_most_deviating_rows():
    k_old = torch.zeros(6, 2, 4)
    k_new = k_old.clone()
    k_new[1] += 3.0
    k_new[4] += 1.0
    v = torch.zeros(6, 2, 4)
    v_new = v.clone()
    v_new[2] += 2.0
    assert top_deviation(k_new, v_new, k_old, v, 2).tolist() == [1, 2]
    assert top_deviation(k_new, v_new, k_old, v, 3).tolist() == [1, 2, 4]
    assert top_deviation(k_new, v_new, k_old, v, 0).tolist() == []


def test_importance_ranking_adds_the_question_attention_as_a_share():
    dev = torch.tensor([10.0, 0.0, 0.0, 1.0])
    heard = torch.tensor([0.0, 0.0, 0.9, 0.1])  # the question reads token 2, whose KV barely moved
    assert top_rows(dev, 2).tolist() == [0, 3]
    assert top_rows(shares(dev, heard), 2).tolist() == [0, 2]  # 10/11 + 0, 0 + 0.9 beat 1/11 + 0.1
    assert torch.equal(shares(dev, torch.zeros(4)), dev / dev.sum())  # no attention: deviation alone


def test_importance_selection_recomputes_as_many_tokens_but_other_ones(gqa):
    ids, spans = prompt([30, 30, 30, 12], [True, True, True, False], GQA.vocab, seed=4)
    picked = {}
    for select in ("deviation", "importance"):
        seen: dict[int, list[int]] = {}
        r = run(gqa, ids, spans, mode="blend", ratio=0.2, select=select, window=8,
                trace=lambda layer, pos, attn, seen=seen: seen.setdefault(layer, pos.tolist()))
        picked[select] = (r.computed, seen)
    assert picked["deviation"][0] == picked["importance"][0]  # the same number of tokens on every layer
    assert picked["deviation"][1][2] != picked["importance"][1][2]  # after the check layer: other tokens
    full = run(gqa, ids, spans, mode="full")
    every = run(gqa, ids, spans, mode="blend", ratio=1.0, select="importance")
    assert torch.allclose(every.logits, full.logits, atol=TOL)
    with pytest.raises(ValueError, match="select"):
        run(gqa, ids, spans, select="magic")
    with pytest.raises(ValueError, match="window"):
        run(gqa, ids, spans, select="importance", window=0)


def test_position_selection_recomputes_the_first_tokens_of_every_chunk_on_every_layer(gqa):
    """EPIC's LegoLink: no check layer, no deviation pass -- the fresh tokens and the first k of every reused span,
    the same set on every layer; k = 0 is full reuse, k past every span's length a full prefill."""
    ids, spans = prompt([30, 30, 30, 12], [True, True, True, False], GQA.vocab, seed=4)
    seen: dict[int, list[int]] = {}
    r = run(gqa, ids, spans, mode="blend", ratio=0.15, select="position", position_tokens=4,
            trace=lambda layer, pos, attn: seen.setdefault(layer, pos.tolist()))
    want = [*range(0, 4), *range(30, 34), *range(60, 64), *range(90, 102)]
    assert r.computed == [len(want)] * GQA.layers and all(seen[layer] == want for layer in range(GQA.layers))
    reuse = run(gqa, ids, spans, mode="reuse")
    none = run(gqa, ids, spans, mode="blend", select="position", position_tokens=0)
    assert torch.equal(none.kv, reuse.kv) and torch.equal(none.logits, reuse.logits)
    full = gqa.prefill(ids)
    every = run(gqa, ids, spans, mode="single", select="position", position_tokens=30)
    assert (every.logits - full.logits).abs().max().item() <= TOL
    assert (every.kv - full.kv).abs().max().item() <= TOL
    with pytest.raises(ValueError, match="position_tokens"):
        run(gqa, ids, spans, select="position", position_tokens=-1)


def test_overlapped_loading_gives_the_same_result(gqa):
    ids, spans = prompt([18, 18, 18, 5], [True, True, True, False], GQA.vocab, seed=2)
    a = run(gqa, ids, spans, mode="blend", ratio=0.2, overlap=True)
    b = run(gqa, ids, spans, mode="blend", ratio=0.2, overlap=False)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.kv, b.kv)


@pytest.mark.parametrize("select", ["deviation", "position"])
def test_attention_masks_kept_over_layers_change_no_bit(gqa, select, monkeypatch):
    """The masks kept while the computed tokens stay the same (emptied when the selection shrinks) give what masks
    built at every call give."""
    ids, spans = prompt([70, 60, 80, 9], [True, True, True, False], GQA.vocab, seed=6)
    kept = run(gqa, ids, spans, mode="blend", ratio=0.3, select=select)
    per_call = blend_engine.positioned_attention
    monkeypatch.setattr(blend_engine, "positioned_attention", lambda *a, masks, **kw: per_call(*a, **kw))
    built = run(gqa, ids, spans, mode="blend", ratio=0.3, select=select)
    assert len(set(kept.computed)) > 1 if select == "deviation" else min(kept.computed) > 64  # shrinks; >1 block
    assert torch.equal(kept.logits, built.logits) and torch.equal(kept.kv, built.kv)


def test_bad_inputs_are_rejected(gqa):
    ids, spans = prompt([10, 5], [True, False], GQA.vocab)
    with pytest.raises(ValueError, match="mode"):
        run(gqa, ids, spans, mode="magic")
    with pytest.raises(ValueError, match="ratio"):
        run(gqa, ids, spans, ratio=1.5)
    with pytest.raises(ValueError, match="tile"):
        run(gqa, ids, [Span(0, 10, True), Span(11, 15, False)])
    with pytest.raises(ValueError, match="tokens"):
        blend_prefill(gqa, ids, spans, lambda layer, i: torch.zeros(3, 2, GQA.kv_heads, GQA.head_dim))
    assert set(MODES) == {"full", "prefix", "reuse", "single", "blend"}


@pytest.mark.model
def test_quality_on_smollm2_blend_is_closer_to_full_prefill_than_full_reuse():
    """Real weights, real text: three essay chunks + a question. 15 % recompute must beat reusing all KV."""
    from transformers import AutoTokenizer

    from sglang_tiered.models import default_model_path
    from sglang_tiered.server_process import essay_texts

    essays = essay_texts()
    path = default_model_path()
    model = load_model(("pretrained", str(path)))
    tok = AutoTokenizer.from_pretrained(str(path))
    chunks = [tok(e[:900], add_special_tokens=False).input_ids[:160] for e in essays[:3]]
    question = tok("\nQuestion: what did the author write about first? Answer:", add_special_tokens=False).input_ids
    ids = torch.tensor([t for c in chunks for t in c] + question)
    spans, pos = [], 0
    for c in chunks:
        spans.append(Span(pos, pos + len(c), True))
        pos += len(c)
    spans.append(Span(pos, pos + len(question), False))
    full = model.prefill(ids)
    reuse = run(model, ids, spans, mode="reuse")
    blend = run(model, ids, spans, mode="blend", ratio=0.15)

    def err(r):
        return (torch.log_softmax(r.logits, -1) - torch.log_softmax(full.logits, -1)).abs().max().item()

    assert err(blend) < err(reuse)
    assert 0.15 < blend.recompute_fraction < 0.35  # 2 full layers of 30 + 15 % on average of the rest


# ---------------------------------------------------------------------------------------------- chunk store
def _store(tmp_path, memory_bytes, with_ssd=True) -> ChunkStore:
    ssd = None
    if with_ssd:
        ns = Namespace(model="m", dtype="torch.float32", page_size=0, layout="chunk", layer_num=3, kv_heads=2,
                       head_dim=4)
        ssd = SSDTier(tmp_path, ns, 1 << 20)
    return ChunkStore(layers=3, kv_heads=2, head_dim=4, dtype=torch.float32, memory_bytes=memory_bytes, ssd=ssd)


def test_chunk_store_round_trip_memory_and_ssd(tmp_path):
    kv = torch.randn(3, 7, 2, 2, 4)
    key = chunk_key([5, 6, 7])
    assert key == chunk_key([5, 6, 7]) and key != chunk_key([5, 6, 8])
    store = _store(tmp_path, memory_bytes=1 << 20)
    store.put(key, kv)
    store.flush()
    assert store.in_memory(key) and store.contains(key)
    assert all(torch.equal(store.layer(key, i, 7), kv[i]) for i in range(3))
    assert store.hits == {"memory": 1, "ssd": 0}
    # a fresh store over the same directory (a restart): nothing in memory, all layers from SSD
    store.close()
    again = _store(tmp_path, memory_bytes=1 << 20)
    assert not again.in_memory(key) and again.contains(key)
    assert all(torch.equal(again.layer(key, i, 7), kv[i]) for i in range(3))
    assert again.hits == {"memory": 0, "ssd": 1}
    again.flush()  # the SSD read was copied into memory: the next reuse reads memory
    assert again.in_memory(key)
    assert all(torch.equal(again.layer(key, i, 7), kv[i]) for i in range(3))
    assert again.hits == {"memory": 1, "ssd": 1}
    with pytest.raises(ChunkMiss):
        again.layer(key, 0, 8)  # wrong length: never served
    with pytest.raises(ChunkMiss):
        again.layer(chunk_key([1]), 0, 1)


def test_a_chunk_read_from_ssd_stays_there_when_memory_cannot_hold_it(tmp_path):
    kv, key = torch.randn(3, 7, 2, 2, 4), chunk_key([9])
    first = _store(tmp_path, memory_bytes=1 << 20)
    first.put(key, kv)
    first.close()
    small = _store(tmp_path, memory_bytes=3 * 7 * 2 * 2 * 4 * 4 - 1)  # one byte short of the chunk
    assert all(torch.equal(small.layer(key, i, 7), kv[i]) for i in range(3))
    small.flush()
    assert not small.in_memory(key) and small.used_memory_bytes == 0
    assert small.hits == {"memory": 0, "ssd": 1}


def test_chunk_store_memory_is_bounded_lru_and_corrupt_layers_are_misses(tmp_path):
    one = 3 * 7 * 2 * 2 * 4 * 4  # bytes of a 7-token chunk
    store = _store(tmp_path, memory_bytes=2 * one)
    kvs = {chunk_key([i]): torch.randn(3, 7, 2, 2, 4) for i in range(3)}
    for key, kv in kvs.items():
        store.put(key, kv)
    store.flush()
    keys = list(kvs)
    assert store.used_memory_bytes == 2 * one
    assert not store.in_memory(keys[0]) and store.in_memory(keys[1]) and store.in_memory(keys[2])
    assert torch.equal(store.layer(keys[0], 1, 7), kvs[keys[0]][1])  # evicted from memory, still on SSD
    page = next(p for p in tmp_path.rglob("*.kvp") if p.name.startswith(keys[0]))  # one file, a segment per layer
    data = bytearray(page.read_bytes())
    data[-3] ^= 0xFF  # in the last layer's segment
    page.write_bytes(bytes(data))
    with pytest.raises(ChunkMiss):
        store.layer(keys[0], 2, 7)
    assert store.ssd.stats.snapshot()["corrupt_pages"] == 1 and not store.contains(keys[0])
    with pytest.raises(ValueError, match="layers"):
        store.put("x", torch.randn(2, 7, 2, 2, 4))


# ---------------------------------------------------------------------------------------------- controller
def test_loading_controller_matches_load_and_compute_with_a_floor():
    c = LoadingController(floor=0.15)
    assert c.ratio(1000, 100) == 0.15  # nothing measured yet
    c.observe_compute(1.0, 1_000_000)  # 1 us per token-layer
    c.observe_load(1.0, 250_000_000)  # 4 ns per byte -> 100 bytes per token-layer = 0.4 us
    assert c.ratio(1000, 100) == 0.4  # recompute 40 % hides exactly behind the load
    assert c.ratio(1000, 10) == 0.15  # a fast tier: the quality floor
    assert c.ratio(1000, 1000) == 1.0  # a slow tier: recompute everything
    with pytest.raises(ValueError):
        LoadingController(floor=0.0)


def test_full_mode_and_greedy_continue_match_plain_prefill(gqa):
    ids, spans = prompt([12, 9, 4], [True, True, False], GQA.vocab, seed=9)
    full = run(gqa, ids, spans, mode="full")
    ref = gqa.prefill(ids)
    assert (full.logits - ref.logits).abs().max().item() <= TOL and full.computed == [25] * GQA.layers
    tokens = greedy_continue(gqa, full.kv, full.logits, 4)
    seq = ids.tolist()
    for t in tokens:  # each greedy token is the argmax of a plain prefill over everything before it
        assert int(gqa.prefill(torch.tensor(seq)).logits.argmax()) == t
        seq.append(t)
    stopped = greedy_continue(gqa, full.kv, full.logits, 4, stop=frozenset({tokens[1]}))
    assert stopped == tokens[: tokens.index(tokens[1]) + 1]  # ends right after the first stop token


def test_an_exact_radix_prefix_is_read_not_recomputed(gqa):
    """What the server does on a radix hit: tokens [0, p) come from the KV pool at their real positions."""
    ids, spans = prompt([10, 14, 12, 5], [False, True, True, False], GQA.vocab, seed=11)
    full = gqa.prefill(ids)
    p = 10
    tail = spans[1:]
    kvs = standalone(gqa, ids, spans)
    for mode, ratio in (("blend", 1.0), ("single", 1.0), ("full", 0.15)):
        r = blend_prefill(gqa, ids, tail, lambda layer, i: kvs[i + 1][layer], mode=mode, ratio=ratio, prefix_len=p,
                 prefix_loader=lambda layer: full.kv[layer, :p])
        assert (r.logits - full.logits).abs().max().item() <= TOL
        assert r.computed == [ids.shape[0] - p] * GQA.layers
        assert (gqa.logits(r.hidden[None])[0] - full.logits).abs().max().item() <= TOL
    r = blend_prefill(gqa, ids, tail, lambda layer, i: kvs[i + 1][layer], mode="reuse", prefix_len=p,
             prefix_loader=lambda layer: full.kv[layer, :p])
    assert r.computed == [5] * GQA.layers
    with pytest.raises(ValueError, match="prefix_loader"):
        blend_prefill(gqa, ids, tail, lambda layer, i: kvs[i + 1][layer], prefix_len=p)


def test_server_span_plan_follows_the_radix_prefix_and_pieces_and_keeps_the_question_fresh():
    from sglang_tiered.engine.blend_plan import ChunkRef, plan_spans

    ids = list(range(100, 130))
    lengths = [4, 10, 0, 8, 8]  # header, chunk, empty part, chunk, question
    whole = [ChunkRef(chunk_key(ids[0:4]), 0, 4), ChunkRef(chunk_key(ids[4:14]), 4, 10),
             ChunkRef(chunk_key(ids[14:22]), 14, 8)]

    def plan(prefix, end):
        spans, refs = plan_spans(lengths, prefix, end, ids)
        return [(s.start, s.end, s.stored, s.offset) for s in spans], refs

    spans, refs = plan(0, 30)
    assert spans == [(0, 4, True, 0), (4, 14, True, 0), (14, 22, True, 0), (22, 30, False, 0)]
    assert refs == [*whole, None]
    spans, refs = plan(6, 30)  # the radix prefix cuts through the first chunk: reused from its 3rd token on
    assert spans == [(6, 14, True, 2), (14, 22, True, 0), (22, 30, False, 0)]
    assert refs == [whole[1], whole[2], None]  # the key is always the whole chunk's
    spans, refs = plan(0, 10)  # a chunked prefill's first piece ends inside a chunk: its last token is computed
    assert spans == [(0, 4, True, 0), (4, 9, True, 0), (9, 10, False, 0)]
    assert refs == [whole[0], whole[1], None]
    spans, refs = plan(10, 22)  # the next piece ends where a chunk ends
    assert spans == [(10, 14, True, 6), (14, 21, True, 0), (21, 22, False, 0)]
    spans, _ = plan(22, 30)
    assert spans == [(22, 30, False, 0)]
    # the prompt's last partial page (here from token 16 on) is fresh in every ask: a repeat's page-aligned match
    # leaves exactly it to compute, as the first ask computed it
    spans, refs = plan_spans(lengths, 0, 30, ids, fresh_from=16)
    assert [(s.start, s.end, s.stored) for s in spans] == [(0, 4, True), (4, 14, True), (14, 16, True),
                                                            (16, 22, False), (22, 30, False)]
    assert refs == [*whole, None, None]
    spans, _ = plan_spans(lengths, 16, 30, ids, fresh_from=16)
    assert [(s.start, s.end, s.stored) for s in spans] == [(16, 22, False), (22, 30, False)]


def test_chunk_spans_with_an_offset_blend_like_whole_chunks(gqa):
    """Fusing a prompt in two pieces cut inside a chunk, with the first piece's KV as the second's prefix, reuses the
    same stored KV as one blend: at ratio 1.0 both equal full prefill; in reuse mode the KV is the same too."""
    ids, spans = prompt([6, 12, 10, 4], [False, True, True, False], GQA.vocab, seed=13)
    kvs = standalone(gqa, ids, spans)
    full = gqa.prefill(ids)
    cut = 12  # inside the 12-token chunk at [6, 18)
    first = [Span(0, 6, False), Span(6, cut - 1, True), Span(cut - 1, cut, False)]
    second = [Span(cut, 18, True, cut - 6), Span(18, 28, True), Span(28, 32, False)]

    def loader(pieces):
        src = {0: kvs[1], 1: kvs[2]}
        return lambda layer, i: src[0 if pieces[i].start < 18 else 1][layer][pieces[i].offset:][: pieces[i].length]

    for mode, ratio in (("blend", 1.0), ("reuse", 0.0)):
        whole = blend_prefill(gqa, ids, spans, lambda layer, i: kvs[i][layer], mode=mode, ratio=ratio)
        a = blend_prefill(gqa, ids[:cut], first, loader(first), mode=mode, ratio=ratio)
        b = blend_prefill(gqa, ids, second, loader(second), mode=mode, ratio=ratio, prefix_len=cut,
                 prefix_loader=lambda layer, a=a: a.kv[layer])
        kv = torch.cat([a.kv, b.kv[:, cut:]], 1)
        if mode == "blend":
            assert (b.logits - full.logits).abs().max().item() <= TOL
            assert (kv - full.kv).abs().max().item() <= TOL
        else:  # the pieces reuse exactly the tokens one blend reuses, except token cut-1 (computed fresh)
            assert (kv[:, : cut - 1] - whole.kv[:, : cut - 1]).abs().max().item() <= TOL
            assert (kv[:, cut:18] - whole.kv[:, cut:18]).abs().max().item() <= TOL
            assert (kv[:, cut - 1] - whole.kv[:, cut - 1]).abs().max().item() > TOL


def test_loading_controller_reads_a_blend_result():
    from sglang_tiered.engine.blend import BlendResult, observe

    c = LoadingController(floor=0.15)
    res = BlendResult(torch.zeros(1), torch.zeros(30, 1000, 2, 1, 1), computed=[200] * 30, load_wait_s=0.5,
                       load_s=0.12)
    observe(c, res, reused_tokens=1000, token_layer_bytes=100, elapsed_s=1.1)
    # load: 0.12 s / (100 B x 1000 tokens x 30 layers) = 40 ns/B; compute: (1.1 - 0.5) s / 6000 = 100 us/token-layer
    assert math.isclose(c.describe()["s_per_byte"], 0.12 / 3_000_000)
    assert math.isclose(c.describe()["s_per_token_layer"], 0.6 / 6000)
    assert c.ratio(1000, 100) == 0.15  # 4 us load vs 100 us compute per token-layer: the floor
    assert math.isclose(c.ratio(1000, 2000), 0.8)  # 80 us load vs 100 us compute


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_kv_in_one_pass_is_each_chunks_own_prefill(dtype):
    """New chunks' KV computed together: each chunk at positions from 0, attending to itself only -- what one
    prefill per chunk gives (to float rounding: the products are wider), for chunks of different lengths."""
    model = LlamaModel.random(GQA, seed=5, dtype=dtype)
    g = torch.Generator().manual_seed(6)
    chunks = [torch.randint(0, GQA.vocab, (n,), generator=g) for n in (1, 7, 64, 3, 40)]
    got = model.chunk_kv(chunks)
    assert [kv.shape[1] for kv in got] == [1, 7, 64, 3, 40]
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for chunk, kv in zip(chunks, got):
        torch.testing.assert_close(kv, model.prefill(chunk).kv, rtol=tol, atol=tol)
    joined = model.prefill(torch.cat(chunks[:2])).kv[:, 1:]  # the second chunk after the first: other KV
    assert not torch.allclose(got[1], joined, rtol=tol, atol=tol)
    with pytest.raises(ValueError):
        model.chunk_kv([chunks[0], chunks[0][:0]])
