"""Compute-or-load (`--tiered-kvpr`) in a live CPU server on a multi-head-attention model (random weights, the
embedded tokenizer, fp32 so that the exact paths compare token for token), where activations are stored and the
two-sided loader reads its half as activations (KVPR) -- one scheduler (engine/meet.py).

A prompt is served cold (its pages and their activations reach the SSD tier); then, with device and host flushed,
the same prompt is loaded from SSD by SGLang's own L3 prefetch (the reference) and by our loader with the meet point
forced at 0 (every page recomputed from activations), one page, the middle, all but one page and all pages (every
page computed from token ids), and with a device-cached prefix ahead of the span: the greedy output is identical
every time. A corrupt activation page is loaded as KV (counted, identical); a KV page gone from disk makes SGLang
compute the span (counted, identical). A prompt that SGLang prefills in pieces (longer than `--chunked-prefill-size`)
is never planned: it keeps SGLang's own load.
Activation pages count against the one SSD capacity: the directory never exceeds it while prompts flood it, and a
stored prompt still loads exactly.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sglang_tiered.engine.llama import LlamaConfig
from sglang_tiered.models import random_model_dir
from sglang_tiered.server_process import ServerProcess, cached_details, metric_total
from tests.dirsize import Sampler
from tests.integration.helpers import tiered_args
from tests.integration.kvpr_helpers import (
    MHA,
    PAGE,
    ask,
    assert_as_sglangs_load,
    counter,
    wait_for_activations,
)
from tests.page_cache import drop_from_page_cache
from tests.rounding import rows_alone

pytestmark = [pytest.mark.server, pytest.mark.slow]

PIECE = 1024  # --chunked-prefill-size: every prompt here is one extend but the long one's
CAPACITY = 128 << 20  # ~48 pages of KV + activations (fp32): every test's prompts fit, the flood at the end does not


@pytest.fixture(scope="module")
def mha_server(tmp_path_factory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("kvpr")
    model = random_model_dir(tmp / "model", MHA, seed=1)
    args = tiered_args(tmp / "ssd", "--dtype", "float32", "--enable-metrics", "--tiered-kvpr", "force",
                       "--chunked-prefill-size", str(PIECE), "--tiered-ssd-capacity", str(CAPACITY),
                       "--tiered-host-size", "2x",  # never shrunk by SGLang while other servers hold memory
                       max_tokens=8192)
    with ServerProcess(args, log_path=tmp / "server.log", model_path=str(model)) as s:
        s.ssd, s.model = tmp / "ssd", model
        yield s


def load_lines(s: ServerProcess, mark: int) -> list[str]:
    return s.log_lines("tiered kvpr: rid", since=mark)


def test_every_meet_point_gives_the_output_of_sglangs_load(mha_server, essays):
    s = mha_server
    prompt = essays[2][:3000] + "\n\nQuestion: What is this essay about?\nAnswer:"
    cold = ask(s, prompt)
    ids = cold["meta_info"]["prompt_tokens"]
    pages = (ids - 1) // PAGE  # (the last token is always computed)
    wait_for_activations(s, ids // PAGE)
    s.flush_cache()
    native = ask(s, prompt, "off", logprobs=True)
    assert cached_details(native)["storage"] >= (pages - 1) * PAGE  # SGLang's own L3 load
    assert native["output_ids"] == cold["output_ids"]
    recomputed = counter(s, "tokens_recomputed")
    exact = rows_alone(torch.float32, MHA.hidden, MHA.kv_heads * MHA.head_dim, MHA.intermediate)
    for split in (0, 1, pages // 2, pages - 1, pages):
        s.flush_cache()
        drop_from_page_cache(*s.ssd.glob("*/*/*.kvp"))  # read from the disk
        mark = s.log_mark()
        out = ask(s, prompt, split * PAGE, logprobs=True)
        assert_as_sglangs_load(out, native, "float32", exact, split)  # bit for bit where rows round alone
        lines = load_lines(s, mark)
        assert len(lines) == 1 and f"met at page {split} of {pages}:" in lines[0], lines
        assert f"({(pages - split) * PAGE} from activations" in lines[0], lines[0]  # the loaded half: recomputed
    assert counter(s, "tokens_recomputed") - recomputed == sum(pages - k for k in (0, 1, pages // 2, pages - 1,
                                                                                    pages)) * PAGE
    assert counter(s, "bytes_saved") > 0

    # a device-cached prefix ahead of the span: its first 2 pages on device, the rest from SSD, met in the middle
    s.flush_cache()
    assert ask(s, prompt[:600], "off")["meta_info"]["prompt_tokens"] > 2 * PAGE
    mark = s.log_mark()
    out = ask(s, prompt, (pages - 2) // 2 * PAGE)
    device = cached_details(out)["device"]
    assert device >= 2 * PAGE and out["output_ids"] == native["output_ids"]
    lines = load_lines(s, mark)
    assert len(lines) == 1 and f"prefix={device} " in lines[0] and f"met at page {(pages - 2) // 2} of " in lines[0]


def test_corrupt_activations_load_as_kv_and_a_lost_kv_page_is_computed(mha_server, essays):
    s = mha_server
    prompt = essays[4][:2500] + "\n\nQuestion: Who wrote this?\nAnswer:"
    written = counter(s, "activation_pages_written")
    cold = ask(s, prompt)
    wait_for_activations(s, written + cold["meta_info"]["prompt_tokens"] // PAGE)
    newest = sorted(s.ssd.glob("*/*/*.x.kvp"), key=lambda p: p.stat().st_mtime)
    victims = newest[-3:]  # activation pages of this prompt
    for path in victims:
        raw = bytearray(path.read_bytes())
        raw[-100] ^= 0xFF
        path.write_bytes(bytes(raw))
    misses, fallbacks = counter(s, "activation_misses"), counter(s, "fallbacks")
    s.flush_cache()
    assert ask(s, prompt, 0)["output_ids"] == cold["output_ids"]  # every page loaded (as activations where stored)
    assert counter(s, "activation_misses") - misses >= 1  # read as that page's KV instead
    assert counter(s, "fallbacks") == fallbacks

    for path in victims:  # at least one of them lies in the stored span the loader reads
        Path(str(path).replace(".x.kvp", ".kvp")).unlink()
    s.flush_cache()
    assert ask(s, prompt, 0)["output_ids"] == cold["output_ids"]
    assert counter(s, "fallbacks") - fallbacks == 1  # SGLang computed the span
    assert "SGLang computes the span" in s.log_lines("tiered kvpr: rid")[-1]


def test_a_bad_kvpr_parameter_is_a_400(mha_server):
    status, body = mha_server.request("/generate", {"text": "hello", "sampling_params": {
        "max_new_tokens": 2, "custom_params": {"tiered_kvpr": "sometimes"}}})
    assert status == 400 and "tiered_kvpr" in str(body)
    status, _ = mha_server.request("/generate", {"text": "hello", "sampling_params": {
        "max_new_tokens": 2, "custom_params": {"tiered_kvpr": -5}}})
    assert status == 400


def test_kvpr_profile_prints_what_the_server_measured(mha_server, tmp_path, essays):
    s = mha_server
    prompt = essays[6][:1500] + "\n\nQuestion: Why?\nAnswer:"  # one load of our own: the server writes its profile
    written = counter(s, "activation_pages_written")
    cold = ask(s, prompt)
    wait_for_activations(s, written + cold["meta_info"]["prompt_tokens"] // PAGE)
    s.flush_cache()
    ask(s, prompt)
    cli = Path(sys.executable).parent / "sglang-tiered"
    r = subprocess.run([str(cli), "kvpr-profile", "--ssd-dir", str(mha_server.ssd)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "SSD read" in r.stdout and "K/V recompute" in r.stdout and "gate open" in r.stdout
    assert "a span page computed in " in r.stdout and "auto, 4096 stored tokens: " in r.stdout

    gqa = random_model_dir(tmp_path / "gqa", LlamaConfig(hidden=64, layers=2, heads=4, kv_heads=1, head_dim=16,
                                                          intermediate=128, vocab=49152))
    r = subprocess.run([str(cli), "kvpr-profile", "--ssd-dir", str(tmp_path / "ssd"), "--model-path", str(gqa)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "no activations: activations are 2.00x the size of the KV" in r.stdout  # hidden 64 vs 2 x 1 x 16
    assert "a span page computed in " in r.stdout
    empty = subprocess.run([str(cli), "kvpr-profile", "--ssd-dir", str(tmp_path / "none")], capture_output=True,
                           text=True, timeout=120)
    assert empty.returncode == 1 and "no profile" in empty.stderr


def test_a_prompt_longer_than_one_extend_keeps_sglangs_load(mha_server, essays):
    """A prompt that SGLang would prefill in pieces (longer than --chunked-prefill-size) is not planned for partial
    recompute (the loader computes whole prompts): SGLang loads its stored prefix as usual, nothing is computed."""
    s = mha_server
    prompt = essays[8] + essays[9] + "\n\nQuestion: What are these essays about?\nAnswer:"
    written, loads, fallbacks = counter(s, "activation_pages_written"), counter(s, "loads"), counter(s, "fallbacks")
    cold = ask(s, prompt)
    assert cold["meta_info"]["prompt_tokens"] > PIECE
    pages = cold["meta_info"]["prompt_tokens"] // PAGE
    wait_for_activations(s, written + pages)
    s.flush_cache()
    again = ask(s, prompt, 10**6)  # every page computed by our loader, were it planned
    assert cached_details(again)["storage"] >= (pages - 1) * PAGE  # SGLang's own L3 load
    assert again["output_ids"] == cold["output_ids"]
    assert counter(s, "loads") == loads and counter(s, "fallbacks") == fallbacks


def test_activation_pages_share_the_budget(mha_server, essays):
    """Prompts worth more KV + activation pages than the capacity: no sample of the directory exceeds it, pages are
    evicted, and the last prompt still loads exactly."""
    s = mha_server
    texts = [e[:2000] + "\n\nQuestion: What is this about?\nAnswer:" for e in essays[10:20]]  # ~80 pages
    sampler = Sampler(s.ssd)
    try:
        written = counter(s, "activation_pages_written")
        outs = [ask(s, text) for text in texts]
        wait_for_activations(s, written + sum(o["meta_info"]["prompt_tokens"] // PAGE for o in outs))
        out = outs[-1]
        s.flush_cache()
        again = ask(s, texts[-1])
        assert cached_details(again)["storage"] > 0 or s.log_lines(f"rid {again['meta_info']['id']} loaded")
        assert again["output_ids"] == out["output_ids"]
    finally:
        biggest = sampler.stop()
    assert 0 < biggest <= CAPACITY, (biggest, CAPACITY)
    assert metric_total(s.get("/metrics"), "sglang_tiered:ssd_evicted_pages_total") > 0
