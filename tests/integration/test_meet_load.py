"""Two-sided loading of a stored span on the GQA default model (SmolLM2, fp32 so that exact paths compare token for
token): the front computed from token ids while the back is read (`engine/meet.py`, through the door's kvpr loader).

A prompt is served cold and its pages reach the SSD tier; then, with device and host flushed, it is loaded by
SGLang's own L3 prefetch (the reference) and by the two-sided loader with the meet point forced by
`custom_params.tiered_kvpr` (tokens computed) at 0, one page, the middle, all but one page and all: greedy output
identical every time, one log line per load naming the meet point. The same with a device-cached prefix ahead of
the span. A corrupt page in the loaded half: a counted fallback, SGLang computes the span, the same output. Tokens
our loader read are reported as SGLang reports its own L3 hits (`cached_tokens_details["storage"]`). No activations
are stored for this model (GQA: they would be larger than the KV they replace), and the log says why.
"""

from __future__ import annotations

import time

import pytest
import torch

from sglang_tiered.server_process import ServerProcess, cached_details, metric_total
from tests.integration.helpers import chosen_dtype, flip_middle_byte
from tests.integration.kvpr_helpers import PAGE, ask, assert_as_sglangs_load, counter
from tests.page_cache import drop_from_page_cache
from tests.rounding import SMOLLM2, rows_alone

pytestmark = [pytest.mark.server, pytest.mark.slow]


def meet_line(s: ServerProcess, out: dict) -> str:
    rid = out["meta_info"]["id"]
    lines = [line for line in s.log_lines("tiered kvpr: rid") if f"rid {rid} " in line]
    assert len(lines) == 1, s.log_tail()
    return lines[0]


def page_files(s: ServerProcess, ids: list[int]) -> list:
    """The SSD tier's files of the pages of `ids` that are stored, in page order."""
    from sglang.srt.mem_cache.utils import get_hash_str

    keys = get_hash_str(ids[: len(ids) // PAGE * PAGE], None, page_size=PAGE)
    return [p for k in keys for p in s.ssd.glob(f"*/{k[:2]}/{k}.kvp")]


def profiled_before_ready(s: ServerProcess) -> None:
    """The server measured its compute profile during SGLang's warmup request: logged before SGLang's ready line, so
    no request of ours waited for it."""
    log = s.log_lines()
    profile = next((i for i, line in enumerate(log) if "tiered kvpr: profile measured in" in line), None)
    ready = next((i for i, line in enumerate(log) if "The server is fired up" in line), None)
    assert profile is not None and ready is not None and profile < ready, (profile, ready, s.log_tail())


def served_and_stored(s: ServerProcess, ids: list[int], pages: int) -> dict:
    """Serve `ids` computed (SGLang's prefill) and wait, at most 60 s, until its `pages` pages are on the SSD tier."""
    out = ask(s, ids, "off")
    deadline = time.monotonic() + 60
    while len(page_files(s, ids)) < pages and time.monotonic() < deadline:
        time.sleep(0.3)
    return out


def test_every_meet_point_gives_the_output_of_sglangs_load(fp32_server, essays, model_dir):
    from transformers import AutoTokenizer

    s = fp32_server
    profiled_before_ready(s)
    text = essays[11] + "\n\nQuestion: What is the point?\nAnswer:"
    ids = AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"]
    cold = ask(s, ids)
    pages = (len(ids) - 1) // PAGE  # (the last token is always computed)
    deadline = time.monotonic() + 60  # written through to SSD; the loader's read bandwidth measured
    while (len(list(s.ssd.glob("*/*/*.kvp"))) < pages or not s.log_lines("tiered kvpr: SSD read bandwidth")) and \
            time.monotonic() < deadline:
        time.sleep(0.3)
    s.flush_cache()
    samples = counter(s, "read_samples")
    exact = rows_alone(torch.float32, *SMOLLM2)  # (engine/llama.py rounds as SGLang does: on this CPU, bit for bit?)
    drop_from_page_cache(*page_files(s, ids))
    native = ask(s, ids, "off", logprobs=True)
    assert cached_details(native)["storage"] >= (pages - 1) * PAGE and native["output_ids"] == cold["output_ids"]
    assert counter(s, "read_samples") > samples  # SGLang's own reads (> 8 MiB) tell the read rate the disk's speed
    for split in (0, 1, pages // 2, pages - 1, pages):
        s.flush_cache()
        out = ask(s, ids, split * PAGE, logprobs=True)
        assert_as_sglangs_load(out, native, "float32", exact, split)  # bit for bit where rows round alone
        assert cached_details(out).get("storage", 0) == (pages - split) * PAGE, split  # the pages read, reported
        line = meet_line(s, out)
        assert f"met at page {split} of {pages}:" in line and "prefix=0 " in line, line
    # a device-cached prefix ahead of the span: its first 3 pages on device, the rest from SSD. The same tokens; the
    # log-probabilities need not be SGLang's load's bit for bit here: the 2 pages computed behind the device prefix
    # round as SGLang's prefill behind it would (test_engine_rounding.py), not as the prefill the pages were stored from
    s.flush_cache()
    ask(s, ids[: 3 * PAGE + 5], "off")
    out = ask(s, ids, 2 * PAGE)
    assert cached_details(out)["device"] == 3 * PAGE and out["output_ids"] == native["output_ids"]
    assert cached_details(out)["storage"] == (pages - 5) * PAGE  # 3 pages from device, 2 computed, the rest read
    line = meet_line(s, out)
    assert f"prefix={3 * PAGE} " in line and f"met at page 2 of {pages - 3}:" in line, line

    # a corrupt page in the loaded half: counted fallback, SGLang computes the span, the same output
    flip_middle_byte(page_files(s, ids)[pages - 1])
    before = metric_total(s.get("/metrics"), "sglang_tiered:kvpr_fallbacks_total")
    s.flush_cache()
    mark = s.log_mark()
    out = ask(s, ids, PAGE)
    assert out["output_ids"] == native["output_ids"]
    assert s.log_lines("tiered kvpr: rid", since=mark) and \
        "runs a normal prefill (stored span unreadable" in s.log_lines("tiered kvpr: rid", since=mark)[0]
    assert metric_total(s.get("/metrics"), "sglang_tiered:kvpr_fallbacks_total") == before + 1


def test_meet_points_give_sglangs_load_bit_for_bit_in_the_servers_dtype(shared_server, essays, model_dir):
    """The default server's dtype (`--dtype auto`: bf16 on a CPU with AVX-512 BF16): the pages computed from token
    ids round as SGLang's own prefill of the prompt (engine/llama.py, `part_attention`), so the output's
    log-probabilities are those of SGLang's load, bit for bit, not only within the dtype's rounding -- on a CPU whose
    kernels round a row alone (tests/rounding.py; not an Intel Xeon with AMX: there within a tolerance)."""
    from transformers import AutoTokenizer

    s = shared_server
    dtype = chosen_dtype(s)
    text = essays[13] + "\n\nQuestion: What is the point?\nAnswer:"
    ids = AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"]
    pages = (len(ids) - 1) // PAGE
    served_and_stored(s, ids, pages)
    s.flush_cache()
    native = ask(s, ids, "off", logprobs=True)
    assert cached_details(native)["storage"] >= (pages - 1) * PAGE
    for split in (1, pages // 2, pages - 1):
        s.flush_cache()
        out = ask(s, ids, split * PAGE, logprobs=True)
        assert f"met at page {split} of {pages}:" in meet_line(s, out)
        assert_as_sglangs_load(out, native, dtype, rows_alone(getattr(torch, dtype), *SMOLLM2), split)


def test_the_gqa_default_model_keeps_l_zero_and_says_why(shared_server):
    lines = shared_server.log_lines("tiered kvpr: no activations stored for this model")
    assert lines and "1.50x" in lines[0] and "GQA" in lines[0]
    assert not list(shared_server.ssd.glob("*/*/*.x.kvp"))
