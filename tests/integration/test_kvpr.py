"""Compute-or-load (`--tiered-kvpr`) in a live CPU server on a multi-head-attention model (random weights, the
embedded tokenizer, fp32 so that the exact paths compare token for token), where activations are stored and the
two-sided loader reads its half as activations (KVPR) -- one scheduler (engine/meet.py).

A prompt is served cold (its pages and their activations reach the SSD tier); then, with device and host flushed,
the same prompt is loaded from SSD by SGLang's own L3 prefetch (the reference) and by our loader with the meet point
forced at 0 (every page recomputed from activations), one page, the middle, all but one page and all pages (every
page computed from token ids), and with a device-cached prefix ahead of the span: the greedy output is identical
every time. A corrupt activation page is loaded as KV (counted, identical); a KV page gone from disk makes SGLang
compute the span (counted, identical). A prompt that SGLang prefills in pieces (longer than `--chunked-prefill-size`)
is never planned: it keeps SGLang's own load. A request admitted behind another request's chunked prefill has its
span read before its forward, as KV (identical), as has one admitted behind a request waiting for the next prefill
batch; where those pages are corrupt, SGLang computes the span (counted, identical). On the GQA default model no
activations are stored, and it says why.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sglang_tiered.engine.llama import LlamaConfig
from sglang_tiered.models import random_model_dir
from sglang_tiered.server_process import ServerProcess, cached_details, metric_total
from tests.integration.helpers import flip_middle_byte, tiered_args, wait_for_metric
from tests.integration.kvpr_helpers import (
    MHA,
    PAGE,
    ask,
    assert_as_sglangs_load,
    counter,
    greedy,
    wait_for_activations,
)
from tests.page_cache import drop_from_page_cache
from tests.rounding import rows_alone

pytestmark = [pytest.mark.server, pytest.mark.slow]

PIECE = 1024  # --chunked-prefill-size: every prompt here is one extend but the long one's
AHEAD = "sglang_tiered:prefill_ahead_of_chunks_total"


@pytest.fixture(scope="module")
def mha_server(tmp_path_factory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("kvpr")
    model = random_model_dir(tmp / "model", MHA, seed=1)
    args = tiered_args(tmp / "ssd", "--dtype", "float32", "--enable-metrics", "--tiered-kvpr", "force",
                       "--chunked-prefill-size", str(PIECE), max_tokens=8192)
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
        drop_from_page_cache(*s.ssd.glob("*/*/*.kvp"))  # read from the disk: a sample of compute beside the loader
        mark = s.log_mark()
        out = ask(s, prompt, split * PAGE, logprobs=True)
        assert_as_sglangs_load(out, native, "float32", exact, split)  # bit for bit where rows round alone
        lines = load_lines(s, mark)
        assert len(lines) == 1 and f"met at page {split} of {pages}:" in lines[0], lines
        assert f"({(pages - split) * PAGE} from activations" in lines[0], lines[0]  # the loaded half: recomputed
        # compute's chunks beside the loader are timed against the profile (policy/kvpr.chunk_slowdown)
        assert ("x the profile beside the loader" in lines[0]) == (0 < split < pages), lines[0]
    assert counter(s, "tokens_recomputed") - recomputed == sum(pages - k for k in (0, 1, pages // 2, pages - 1,
                                                                                    pages)) * PAGE
    assert counter(s, "bytes_saved") > 0

    # the span's files in the page cache (read here): a forced load reads as asked but is no sample of the disk or
    # of compute beside the loader
    s.flush_cache()
    for path in s.ssd.glob("*/*/*.kvp"):
        path.read_bytes()
    mark = s.log_mark()
    assert ask(s, prompt, pages // 2 * PAGE)["output_ids"] == native["output_ids"]
    line = load_lines(s, mark)[0]
    assert f"({(pages - pages // 2) * PAGE} from activations" in line, line
    assert f"{pages} of its pages in the page cache at its plan: no sample" in line, line
    assert "compute's chunks no sample (the loader read the page cache)" in line, line

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


def early_split(line: str) -> tuple[int, int, int]:
    """A load line's tokens loaded from activations, tokens loaded as KV and pages read before the forward."""
    got = re.search(r"\((\d+) from activations, [\d.]+ MiB; (\d+) KV, [\d.]+ MiB; \d+ activation pages missing/"
                    r"corrupt; (\d+) pages read before the forward", line)
    assert got, line
    return tuple(int(g) for g in got.groups())


def read_early_as_kv(s: ServerProcess, mark: int, out: dict, pages: int) -> int:
    """Check the load line of the request answered by `out` (logged after `mark`, a span of `pages` pages): some of
    its pages read before the forward, all of those as KV, the rest from activations, behind a positive expected
    wait for other forwards. Returns the pages read before the forward."""
    line = [x for x in load_lines(s, mark) if f"rid {out['meta_info']['id']} " in x]
    assert len(line) == 1, s.log_tail()
    from_x, kv, read_early = early_split(line[0])
    assert read_early >= 1 and kv == read_early * PAGE and from_x + kv == pages * PAGE, line[0]
    assert float(re.search(r"([\d.]+)s of other forwards expected ahead", line[0]).group(1)) > 0, line[0]
    return read_early


@functools.cache
def tokenizer(model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def tokens(s: ServerProcess, text: str) -> list[int]:
    return tokenizer(s.model)(text)["input_ids"]


def stored(s: ServerProcess, *prompts: list[int]) -> list[dict]:
    """Serve each prompt cold (its KV and activation pages reach the SSD tier); their replies."""
    written = counter(s, "activation_pages_written")
    colds = [ask(s, ids) for ids in prompts]
    wait_for_activations(s, written + sum(len(ids) // PAGE for ids in prompts))
    return colds


def together(s: ServerProcess, prompts: list[list[int]], modes: list) -> list[dict]:
    """One request of several prompts (the scheduler admits them in one round), 10 greedy tokens each; `modes`: each
    one's `tiered_kvpr` (None: 1 token, our loader off)."""
    params = [{"max_new_tokens": 1, "custom_params": {"tiered_kvpr": "off"}} if m is None else greedy(m)
              for m in modes]
    status, replies = s.request("/generate", {"input_ids": prompts, "sampling_params": params})
    assert status == 200, replies
    return replies


def test_requests_admitted_behind_a_chunked_prefill_go_before_its_next_pieces(mha_server, essays):
    """Two requests whose spans our loader takes arrive together while another request's chunked prefill has pieces
    to go. Each goes before one of the next pieces instead of after the last (integration/ahead.py, once per piece):
    the first expects no wait; the second waits for the piece between them, its span read meanwhile
    (engine/early_reads.py) as KV although activations are stored (placing KV is a copy, activations a recompute),
    and its forward reads only what was not in yet. Every output, the chunked request's too, is the computed one."""
    s = mha_server
    first = tokens(s, essays[9][:1500] + "\n\nQuestion: What is the claim?\nAnswer:")
    ids = tokens(s, essays[10][:3000] + "\n\nQuestion: What does the author want?\nAnswer:")
    cold_first, cold = stored(s, first, ids)
    noise = {"text": "\n\n".join(essays[12:20]),  # (about 5600 tokens: six pieces)
             "sampling_params": {"max_new_tokens": 4, "temperature": 0, "custom_params": {"tiered_kvpr": "off"}}}
    status, alone = s.request("/generate", {**noise, "cache_salt": "alone"})  # (a fresh salt: computed in pieces)
    assert status == 200 and alone["meta_info"]["prompt_tokens"] > 4 * PIECE, alone
    s.flush_cache()
    early, ahead = counter(s, "early_pages"), metric_total(s.get("/metrics"), AHEAD)
    mark = s.log_mark()
    replies: list = []
    other = threading.Thread(target=lambda: replies.append(s.request("/generate", {**noise, "cache_salt": "beside"})))
    other.start()
    try:
        deadline = time.monotonic() + 60
        while not s.log_lines(f"#new-token: {PIECE},", since=mark) and time.monotonic() < deadline:
            time.sleep(0.02)  # its first piece is scheduled or done: several are to go after these requests
        out_first, out = together(s, [first, ids], [0, 0])
    finally:
        other.join(120)
    assert replies and replies[0][0] == 200 and replies[0][1]["output_ids"] == alone["output_ids"], replies
    assert out_first["output_ids"] == cold_first["output_ids"] and out["output_ids"] == cold["output_ids"]
    assert metric_total(wait_for_metric(s, AHEAD, ahead + 2), AHEAD) == ahead + 2
    line = [x for x in load_lines(s, mark) if f"rid {out_first['meta_info']['id']} " in x]
    assert len(line) == 1 and "0.00s of other forwards expected ahead" in line[0], line
    first_early = early_split(line[0])[2]  # (its reads began at admission too: what came in before its forward)
    assert counter(s, "early_pages") == early + first_early + read_early_as_kv(s, mark, out, (len(ids) - 1) // PAGE)


def test_a_span_admitted_behind_a_waiting_request_is_read_before_its_forward_as_kv(mha_server, essays):
    """Two requests arrive together (one batch of token ids: the scheduler admits both in one round). The second,
    whose span our loader takes, prefills alone, so it waits for the first's forward: its span is read meanwhile, as
    KV (as behind a chunked prefill), and the output is the computed one. The first is ~950 tokens, the span 6 pages:
    their KV (53 MB) is read in well within that forward (policy/kvpr.early_as_kv) on any disk of 200 MB/s or more."""
    s = mha_server
    ids = tokens(s, essays[33][:1600] + "\n\nQuestion: What is the argument?\nAnswer:")
    ahead = tokens(s, essays[35] + "\n\n" + essays[36][:1000])
    assert len(ahead) < PIECE, len(ahead)  # one forward, not a chunked prefill
    (cold,) = stored(s, ids)
    s.flush_cache()
    mark = s.log_mark()
    out = together(s, [ahead, ids], [None, 0])[1]
    assert out["output_ids"] == cold["output_ids"]
    read_early_as_kv(s, mark, out, (len(ids) - 1) // PAGE)


def test_a_corrupt_page_read_before_the_forward_is_a_counted_fallback(mha_server, essays):
    """The pages read early (behind a waiting request, as KV) are corrupt: the forward meets the read's miss where
    it waits for the page, counts a fallback, and SGLang computes the span -- the computed output."""
    s = mha_server
    ids = tokens(s, essays[23][:3000] + "\n\nQuestion: What is the main point?\nAnswer:")
    ahead = tokens(s, essays[25] + "\n\n" + essays[26][:1000])
    assert len(ahead) < PIECE, len(ahead)

    def kv_files() -> set[Path]:
        return {p for p in s.ssd.glob("*/*/*.kvp") if not p.name.endswith(".x.kvp")}

    before = kv_files()
    (cold,) = stored(s, ids)
    victims = kv_files() - before  # this prompt's KV pages (its activations stay readable)
    assert len(victims) >= (len(ids) - 1) // PAGE
    for path in victims:
        flip_middle_byte(path)
    s.flush_cache()
    fallbacks = counter(s, "fallbacks")
    mark = s.log_mark()
    out = together(s, [ahead, ids], [None, 0])[1]
    assert out["output_ids"] == cold["output_ids"]
    assert counter(s, "fallbacks") - fallbacks == 1
    line = [x for x in load_lines(s, mark) if f"rid {out['meta_info']['id']} " in x]
    assert len(line) == 1 and "stored span unreadable" in line[0] and "SGLang computes the span" in line[0], line


def test_a_bad_kvpr_parameter_is_a_400(mha_server):
    status, body = mha_server.request("/generate", {"text": "hello", "sampling_params": {
        "max_new_tokens": 2, "custom_params": {"tiered_kvpr": "sometimes"}}})
    assert status == 400 and "tiered_kvpr" in str(body)
    status, _ = mha_server.request("/generate", {"text": "hello", "sampling_params": {
        "max_new_tokens": 2, "custom_params": {"tiered_kvpr": -5}}})
    assert status == 400


def test_the_gqa_default_model_keeps_l_zero_and_says_why(shared_server):
    lines = shared_server.log_lines("tiered kvpr: no activations stored for this model")
    assert lines and "1.50x" in lines[0] and "GQA" in lines[0]
    assert not list(Path(shared_server.args[shared_server.args.index("--tiered-ssd-dir") + 1]).glob("*/*/*.x.kvp"))


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
    assert "a 4096-token span: " in r.stdout and "a computed chunk " in r.stdout  # (its fixed part and per token)

    gqa = random_model_dir(tmp_path / "gqa", LlamaConfig(hidden=64, layers=2, heads=4, kv_heads=1, head_dim=16,
                                                          intermediate=128, vocab=49152))
    r = subprocess.run([str(cli), "kvpr-profile", "--ssd-dir", str(tmp_path / "ssd"), "--model-path", str(gqa)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "no activations: activations are 2.00x the size of the KV" in r.stdout  # hidden 64 vs 2 x 1 x 16
    assert "a computed chunk " in r.stdout
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
