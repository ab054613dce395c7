"""Two-sided loading of a stored span on the GQA default model (SmolLM2, fp32 so that exact paths compare token for
token): the front computed from token ids while the back is read (`engine/meet.py`, through the door's kvpr loader).

A prompt is served cold and its pages reach the SSD tier; then, with device and host flushed, it is loaded by
SGLang's own L3 prefetch (the reference) and by the two-sided loader with the meet point forced by
`custom_params.tiered_kvpr` (tokens computed) at 0, one page, the middle, all but one page and all: greedy output
identical every time, one log line per load naming the meet point; and by SGLang's forward computing all of it
(`"compute"`: nothing read, counted, not a fallback). The same with a device-cached prefix ahead of the
span. A corrupt page in the loaded half: a counted fallback, SGLang computes the span, the same output. Tokens our
loader read are reported as SGLang reports its own L3 hits (`cached_tokens_details["storage"]`).

The server measures which load is faster for spans compute would not join (`--tiered-kvpr-choice measured`): loads
of requests admitted at idle are timed, and `auto` gives the next such span to the load measured faster, with the
same output; among another client's decodes the same, on samples kept apart.
"""

from __future__ import annotations

import re
import time

import pytest
import torch

from sglang_tiered.policy.kvpr import MEET_LOADERS
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


def assert_alone(line: str) -> None:
    """A span `auto` gave our loader although compute would not gain on it (the measured choice, behind prefills) is
    read by the loader alone: the meet point forced to 0, MEET_LOADERS threads."""
    assert "met at page 0 of" in line and f"by {MEET_LOADERS} thread(s)" in line, line


def page_files(s: ServerProcess, ids: list[int]) -> list:
    """The SSD tier's files of the pages of `ids` that are stored, in page order."""
    from sglang.srt.mem_cache.utils import get_hash_str

    keys = get_hash_str(ids[: len(ids) // PAGE * PAGE], None, page_size=PAGE)
    return [p for k in keys for p in s.ssd.glob(f"*/{k[:2]}/{k}.kvp")]


def wait_for_profile(s: ServerProcess, timeout: float) -> None:
    """Until the server logged its measured profile (at its first idle moment after startup: no request of ours
    needed), at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not s.log_lines("tiered kvpr: profile") and time.monotonic() < deadline:
        time.sleep(0.3)
    assert s.log_lines("tiered kvpr: profile"), s.log_tail()


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
    wait_for_profile(s, 30)
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
    warm = ask(s, ids, "off")  # the span's files still in the page cache since their write: no sample of the disk
    assert cached_details(warm)["storage"] >= (pages - 1) * PAGE and warm["output_ids"] == cold["output_ids"]
    assert counter(s, "read_samples") == samples
    s.flush_cache()
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
    # `compute`: SGLang's forward computes the whole span (its L3 prefetch skipped: nothing read), counted, logged,
    # and timed for the choice between the two ways (policy/compute_choice.py)
    s.flush_cache()
    spans, samples, mark = counter(s, "computed_spans"), counter(s, "forward_samples"), s.log_mark()
    out = ask(s, ids, "compute", logprobs=True)
    assert out["output_ids"] == native["output_ids"] and cached_details(out).get("storage", 0) == 0
    assert counter(s, "computed_spans") == spans + 1 and counter(s, "forward_samples") > samples
    assert s.log_lines(f"SGLang's forward computes the {pages * PAGE} stored tokens (prefix=0 mode=compute)",
                       since=mark), s.log_tail()
    assert not s.log_lines("runs a normal prefill", since=mark)  # not a fallback
    grown = s.log_lines("tiered kvpr: the loads' KV buffer now holds")  # the kept buffer's size, logged as it grows
    assert grown and int(re.search(r"\((\d+) tokens' KV\)", grown[-1]).group(1)) >= len(ids), grown

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


def test_auto_takes_the_load_this_server_measured_faster(fp32_server, essays, model_dir):
    from transformers import AutoTokenizer

    s = fp32_server
    text = essays[12] + "\n\nQuestion: Who wrote this?\nAnswer:"
    ids = AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"]
    pages = (len(ids) - 1) // PAGE
    cold = served_and_stored(s, ids, pages)
    samples, arrivals = counter(s, "choice_samples"), counter(s, "arrival_reads")
    for mode in ("off", 0, "off", 0):  # SGLang's load and ours (reading everything), each timed twice at idle
        s.flush_cache()
        out = ask(s, ids, mode)
        assert out["output_ids"] == cold["output_ids"] and cached_details(out)["storage"] >= (pages - 1) * PAGE, mode
    assert counter(s, "choice_samples") == samples + 4
    assert counter(s, "arrival_reads") == arrivals  # at idle a request is admitted at once: no reads at arrival
    span = f"{1 << (pages.bit_length() - 1)}-{(2 << (pages.bit_length() - 1)) - 1} pages"
    rates = [line for line in s.log_lines(f"tiered kvpr: stored spans of {span}:")]
    assert rates, s.log_tail()
    ours_ahead = rates[-1].endswith("our loader takes them")
    chosen = {c: counter(s, f"choice_{c}") for c in ("ours", "sglang", "explorations")}
    s.flush_cache()
    out = ask(s, ids)  # auto, the server's default
    assert out["output_ids"] == cold["output_ids"] and cached_details(out)["storage"] >= (pages - 1) * PAGE
    retry = counter(s, "choice_explorations") == chosen["explorations"] + 1  # (a periodic retry of the one behind)
    want_ours = ours_ahead != retry
    ours = [line for line in s.log_lines("tiered kvpr: rid") if f"rid {out['meta_info']['id']} " in line]
    assert bool(ours) == want_ours, (rates[-1], retry, ours)
    if ours:
        why = "trying our loader" if retry else "our loader is faster"
        assert f"mode=auto: measured choice, {why}" in ours[0], ours[0]
        assert_alone(ours[0])
    assert counter(s, "choice_ours") == chosen["ours"] + want_ours
    assert counter(s, "choice_sglang") == chosen["sglang"] + (not want_ours)


def test_a_span_admitted_right_after_another_prefill_goes_to_our_loader(fp32_server, essays, model_dir):
    """SGLang's scheduler skips a request whose L3 prefetch still runs, so behind other prefills SGLang's load waits
    for one more of their forwards: `auto` gives such a span to our loader (`behind_prefills`), same output. Sent
    while that forward runs, the request has its span's files read into the page cache by the launcher from its
    arrival (integration/arrival.py): every one of them, logged and counted; its load is no sample of the read rate."""
    import threading

    from transformers import AutoTokenizer

    s = fp32_server
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(essays[13] + "\n\nQuestion: Who is this for?\nAnswer:")["input_ids"]
    noise = tok("\n\n".join(essays[14:20]))["input_ids"][:1500]  # another prefill: 3-4 s in fp32 here
    pages = (len(ids) - 1) // PAGE
    cold = served_and_stored(s, ids, pages)
    s.flush_cache()
    files = page_files(s, ids)
    drop_from_page_cache(*files)
    behind, samples = counter(s, "choice_behind_prefills"), counter(s, "choice_samples")
    arrivals, arrival_bytes = counter(s, "arrival_reads"), counter(s, "arrival_bytes")
    other = threading.Thread(target=s.request, args=("/generate", {
        "input_ids": noise, "sampling_params": {"max_new_tokens": 1, "custom_params": {"tiered_kvpr": "off"}}}))
    other.start()
    try:
        time.sleep(0.5)  # (SGLang logs a prefill batch after its forward: nothing to wait for)
        out = ask(s, ids)  # auto, sent while the other prefill's forward runs
    finally:
        other.join(120)
    assert out["output_ids"] == cold["output_ids"] and cached_details(out)["storage"] >= (pages - 1) * PAGE
    line = meet_line(s, out)
    assert "mode=auto: behind prefills (" in line and f"of {pages}:" in line, line
    assert_alone(line)
    assert counter(s, "choice_behind_prefills") == behind + 1
    # our loader waited for nothing before its forward: that forward's time is a sample of it (read everything)
    assert counter(s, "choice_samples") == samples + 1
    # the launcher read every file of the span while the other forward ran; the load read the page cache
    rid = out["meta_info"]["id"]
    arrival = [line for line in s.log_lines("tiered kvpr: rid") if f"rid {rid}: " in line]
    assert len(arrival) == 1 and f": {len(files)} of {len(files)} stored page files" in arrival[0], arrival
    assert "from its arrival, during a prefill forward" in arrival[0], arrival[0]
    assert counter(s, "arrival_reads") == arrivals + 1
    assert counter(s, "arrival_bytes") == arrival_bytes + sum(f.stat().st_size for f in files)
    assert "read path read into the page cache from its arrival: no sample" in line, line


def test_a_span_left_to_sglangs_load_is_timed_whole_even_when_it_brings_nothing(fp32_server, essays, model_dir):
    """The measured choice times SGLang's load over the span it gave it, whatever that load brought in: where its
    prefetch brings nothing (here the span's first page is corrupt, so SGLang computes the span) the request's time
    is still a sample of SGLang's load. Counted as no sample, it left SGLang's load unmeasured and the choice kept
    giving it spans (measured: 12-13 s a request where our loader took 2.9 s). Having brought in less than half of
    the span, it is a conclusive sample: SGLang's load is not given a second such span to measure."""
    from transformers import AutoTokenizer

    s = fp32_server
    wait_for_profile(s, 60)
    ids = AutoTokenizer.from_pretrained(model_dir)(essays[21])["input_ids"][:200]  # 3 pages: a span size no other
    pages = (len(ids) - 1) // PAGE                                                   # test here stores
    cold = served_and_stored(s, ids, pages)
    flip_middle_byte(page_files(s, ids)[0])
    s.flush_cache()
    samples, given = counter(s, "choice_samples"), counter(s, "choice_sglang")
    out = ask(s, ids)  # auto: the first span of this size, so SGLang's load is tried first
    assert out["output_ids"] == cold["output_ids"] and cached_details(out)["storage"] == 0
    assert counter(s, "choice_sglang") == given + 1
    assert counter(s, "choice_samples") == samples + 1
    # it brought in nothing, so that one sample is conclusive: the next span of this size is our loader's to try
    # (the corrupt page was dropped when read and written through again from the computed span)
    s.flush_cache()
    ours = counter(s, "choice_ours")
    out = ask(s, ids)
    assert out["output_ids"] == cold["output_ids"]
    assert counter(s, "choice_ours") == ours + 1 and counter(s, "choice_sglang") == given + 1
    assert "mode=auto: measured choice, trying our loader" in meet_line(s, out), meet_line(s, out)
    assert_alone(meet_line(s, out))


def test_among_decodes_auto_takes_the_load_measured_faster_among_decodes(fp32_server, essays, model_dir):
    """Samples of requests admitted while another client decodes are kept apart from the idle ones (measured on
    SmolLM2 at 100 MB/s: among decodes SGLang's load took 0.18-0.30 s more than our loader, at idle 0.04-0.1 s), and
    `auto` among decodes follows them. Five stored spans of 5 pages (the device and host flushed while idle: no
    flush is possible while the other client decodes), the first four loaded by SGLang's load and by ours, twice
    each, the fifth by `auto`: same outputs, one sample each, the choice the log line names."""
    import threading

    from transformers import AutoTokenizer

    s = fp32_server
    tok = AutoTokenizer.from_pretrained(model_dir)
    pages = 5
    docs = [tok(essays[i])["input_ids"][: pages * PAGE + 9] for i in range(22, 27)]
    cold = [served_and_stored(s, ids, pages)["output_ids"] for ids in docs]
    s.flush_cache()
    mark = s.log_mark()
    rid = "test-decoding-client"
    decoder = threading.Thread(target=s.request, args=("/generate", {
        "input_ids": tok("Count to a thousand:")["input_ids"], "rid": rid,
        "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}), kwargs={"timeout": 300})
    decoder.start()
    try:
        deadline = time.monotonic() + 60
        while not s.log_lines("Decode batch", since=mark) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert s.log_lines("Decode batch", since=mark), s.log_tail()
        samples = counter(s, "choice_samples_decoding")
        outs = []
        for ids, mode in zip(docs, ("off", 0, "off", 0)):
            time.sleep(0.2)  # (a decode batch runs between two of ours: the last batch is not a prefill)
            outs.append(ask(s, ids, mode))
        rates = s.log_lines("tiered kvpr: stored spans of 4-7 pages among decodes:", since=mark)
        time.sleep(0.2)
        outs.append(ask(s, docs[-1]))  # auto
        assert decoder.is_alive()  # the other client decoded all along
    finally:
        s.post("/abort_request", {"rid": rid})
        decoder.join(120)
    for out, want in zip(outs, cold):
        assert out["output_ids"] == want and cached_details(out)["storage"] >= (pages - 1) * PAGE
    assert counter(s, "choice_samples_decoding") == samples + 5
    assert rates and "loads timed among decodes" in rates[-1], s.log_tail()
    rid_auto = outs[-1]["meta_info"]["id"]
    ours = [line for line in s.log_lines("tiered kvpr: rid", since=mark) if f"rid {rid_auto} " in line]
    assert bool(ours) == rates[-1].endswith("our loader takes them"), (rates, ours)
    if ours:
        assert "mode=auto: measured choice, our loader is faster" in ours[0], ours[0]
        assert_alone(ours[0])
