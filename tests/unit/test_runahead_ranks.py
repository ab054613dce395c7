"""A long-lived chain (`RunaheadRanks`): this process is the last rank, helpers are real processes joined by gloo.
Exact against single-process prefill (also when extending a cached prefix), and failure paths that must not hang:
a stalled helper (SIGSTOP) times out, a killed helper fails fast, both leave no process behind and the chain can be
started again; a helper that cannot load its model fails `start`. No SGLang."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from sglang_tiered.engine.parallel_prefill import RunaheadError, even_bounds
from sglang_tiered.engine.runahead_ranks import RunaheadRanks
from sglang_tiered.engine.tuning import load_model
from sglang_tiered.server_process import process_alive

SPEC = ("random", dict(hidden=96, layers=4, heads=6, kv_heads=2, head_dim=16, intermediate=192, vocab=300))
TOL = 1e-4


@pytest.fixture(scope="module")
def model():
    return load_model(SPEC, torch.float32)


@pytest.fixture
def chain(model):
    ranks = RunaheadRanks(model, SPEC, 3, timeout_s=3.0)
    ranks.start()
    yield ranks
    ranks.stop()


def test_exact_with_and_without_a_cached_prefix(model, chain):
    ids = torch.randint(0, 300, (61,), generator=torch.Generator().manual_seed(0))
    ref = model.prefill(ids)
    for bounds in (even_bounds(61, 3), [0, 40, 55, 61]):  # even and uneven, 61 not divisible by 3
        res = chain.prefill(ids, bounds)
        assert (res.logits - ref.logits).abs().max() <= TOL
        assert (res.kv - ref.kv).abs().max() <= TOL
        assert torch.allclose(model.logits(res.last_hidden[None])[0], ref.logits, atol=TOL)
    prefix = 25  # the last rank holds the prefix KV; rank 0 receives it, the chain extends it
    res = chain.prefill(ids[prefix:], [25, 37, 50, 61], prefix_kv=lambda layer: ref.kv[layer, :prefix])
    assert (res.logits - ref.logits).abs().max() <= TOL
    assert (res.kv - ref.kv).abs().max() <= TOL
    kv_row = 2 * 2 * 16 * 4  # bytes per token and layer (k+v, 2 heads, dim 16, fp32)
    # rank 1 -> 0: prefix; rank 0 -> 1: [0, 37); rank 1 -> 2: [0, 50); per layer
    assert res.bytes_sent == 4 * kv_row * (25 + 37 + 50)


def test_stalled_helper_times_out_then_restart_works(model, chain):
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(1))
    pids = chain.helper_pids
    os.kill(pids[1], signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(RunaheadError):
        chain.prefill(ids, even_bounds(40, 3))
    assert time.monotonic() - t0 < 3.0 * 2 + 2  # one timed-out wait, then teardown
    assert not chain.ready and not any(process_alive(p) for p in pids)
    chain.start()
    res = chain.prefill(ids, even_bounds(40, 3))
    assert (res.logits - model.prefill(ids).logits).abs().max() <= TOL


def test_killed_helper_mid_chain_fails_fast(model, chain):
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(2))
    pids = chain.helper_pids
    os.kill(pids[0], signal.SIGSTOP)  # rank 0 holds the job unread; the chain blocks in rank 1 and here

    def kill_soon():
        time.sleep(0.5)
        os.kill(pids[0], signal.SIGKILL)

    import threading

    threading.Thread(target=kill_soon).start()
    t0 = time.monotonic()
    with pytest.raises(RunaheadError):
        chain.prefill(ids, even_bounds(40, 3))
    assert time.monotonic() - t0 < 3.0  # a closed connection is seen at once, well before the timeout chain
    assert not any(process_alive(p) for p in pids)


def test_helper_that_cannot_load_fails_start(model):
    bad = RunaheadRanks(model, ("pretrained", "/nonexistent"), 2, timeout_s=3.0)
    with pytest.raises(RunaheadError, match="failed to start"):
        bad.start()
    assert not bad.ready and bad.helper_pids == []


def test_stop_leaves_no_process(chain):
    pids = chain.helper_pids
    assert pids and all(process_alive(p) for p in pids)
    chain.stop()
    assert not any(process_alive(p) for p in pids)
    with pytest.raises(RunaheadError):
        chain.prefill(torch.zeros(8, dtype=torch.int64), even_bounds(8, 3))
