"""Gated sparse loading (`--tiered-importance-load gated`) in a live server (CPU, SmolLM2 in fp32 so that exact paths
compare token for token).

1. A prompt is served cold; its pages reach the SSD tier and are repacked into a group (logged).
2. With device and host flushed (the prompt only on the SSD tier, as a group):
   * `tiered_importance: off` -- SGLang loads the repacked pages out of the group: output identical to the cold run
     (repacking is exact);
   * `full` -- the sparse path with every token loaded (the gate forced to fail): identical too;
   * `gated` -- the gate decides per layer: answered, fewer bytes read than `full`, token-layers skipped,
     counted; and kept out of the radix tree (the same request again is a sparse load again, not a device hit),
     which then skips the probe of the layers whose gate failed the first time (same output, their probes' bytes
     saved).
3. A request naming the mass gate (`custom_params.tiered_importance_gate`): the mass gate decides (logged), passes
   some layers, reads less than `full`, and answers; a request with its own ratio has its own probe-skipping history.
4. On the same server, one chunk of the group file is overwritten under it (size unchanged; its checksum catches it
   when a load reads it): a `full` request is answered by SGLang's prefill -- output identical to the cold run --,
   the fallback and the corrupt group are counted, the group file is gone, and the next request computes the
   prompt (nothing from storage) with the same output.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator

import pytest

from sglang_tiered.integration.sparse import LOG_PATTERN
from sglang_tiered.server_process import ServerProcess, cached_details, metric_total
from sglang_tiered.storage.group_file import read_meta
from tests.integration.helpers import tiered_args, wait_for_metric
from tests.integration.kvpr_helpers import PAGE

pytestmark = [pytest.mark.server, pytest.mark.slow]


PIECE = 1024  # --chunked-prefill-size: one essay is one extend, two are not


@pytest.fixture(scope="module")
def gated_server(tmp_path_factory) -> Iterator[ServerProcess]:
    """One server for the module; the test that reads its only group file runs first. Its host pool is given
    (`2x`): left to SGLang, a start while other servers hold the machine's memory gets a pool shrunk below the
    20-page prompt below (1,152 tokens seen), whose pages then never reach the SSD tier to be repacked; given, such
    a start is refused and tried again (`ServerProcess.start`)."""
    tmp = tmp_path_factory.mktemp("gated")
    args = tiered_args(tmp / "ssd", "--tiered-importance-load", "gated", "--dtype", "float32", "--enable-metrics",
                       "--tiered-importance-probe-skip", "1",  # a layer failed once is loaded unprobed next
                       "--chunked-prefill-size", str(PIECE), "--tiered-host-size", "2x")
    with ServerProcess(args, log_path=tmp / "gated.log") as s:
        s.ssd = tmp / "ssd"
        yield s


def ask(s: ServerProcess, text: str, mode: str | None = None, gate: str | None = None,
        ratio: float | None = None) -> dict:
    params: dict = {"max_new_tokens": 12, "temperature": 0, "custom_params": {}}
    if mode:
        params["custom_params"]["tiered_importance"] = mode
    if gate:
        params["custom_params"]["tiered_importance_gate"] = gate
    if ratio is not None:
        params["custom_params"]["tiered_importance_ratio"] = ratio
    status, body = s.request("/generate", {"text": text, "sampling_params": params})
    assert status == 200, body
    return body


def wait_for_repack(s: ServerProcess, since: int = 0, pages: int = 1) -> None:
    """Until a repack of at least `pages` pages is logged after `since` (a smaller one can be an earlier test's
    pages, stored again)."""
    def done() -> bool:
        return any(int(m.group(1)) >= pages for line in s.log_lines("tiered repack:", since)
                   if (m := re.search(r"tiered repack: (\d+) pages", line)))

    deadline = time.monotonic() + 60
    while not done() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert done(), f"the prompt's {pages} pages were never repacked"


def test_repacked_pages_load_exactly_and_gated_loads_read_less(gated_server, essays):
    prompt = essays[7] + "\n\nQuestion: What is this essay about?\nAnswer:"
    s = gated_server
    cold = ask(s, prompt)
    wait_for_repack(s)
    deadline = time.monotonic() + 10  # counters reach /metrics within a second or so
    while metric_total(s.get("/metrics"), "sglang_tiered:ssd_repacked_pages_total") == 0 and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    metrics = s.get("/metrics")
    # the repack took every page from the copy kept at its write: nothing was read back from the SSD
    repacked = metric_total(metrics, "sglang_tiered:ssd_repacked_pages_total")
    assert repacked >= 10 and metric_total(metrics, "sglang_tiered:ssd_repack_pages_kept_total") == repacked
    assert metric_total(metrics, "sglang_tiered:ssd_repack_pages_read_total") == 0
    assert list(s.ssd.glob("*/groups/*.kvg"))

    s.flush_cache()  # device and host: the prompt is on the SSD tier only
    full_load = ask(s, prompt, "off")
    assert cached_details(full_load)["storage"] >= 640  # SGLang read the pages back through the group
    assert full_load["output_ids"] == cold["output_ids"]

    s.flush_cache()
    exact = ask(s, prompt, "full")
    assert exact["output_ids"] == cold["output_ids"]
    # counters are published once a second: wait for each load's count (full, gated, gated again) to show
    before = wait_for_metric(s, "sglang_tiered:sparse_requests_total", 1)
    s.flush_cache()
    gated = ask(s, prompt)
    mid = wait_for_metric(s, "sglang_tiered:sparse_requests_total", 2)
    gated_again = ask(s, prompt)
    after = wait_for_metric(s, "sglang_tiered:sparse_requests_total", 3)
    lines = s.log_lines("tiered sparse: rid")

    # 3. the mass gate, named by the request (custom_params.tiered_importance_gate; the server's is Jaccard),
    # then a Jaccard load at the request's own ratio
    s.flush_cache()
    mass = ask(s, prompt, gate="mass")
    after_mass = wait_for_metric(s, "sglang_tiered:sparse_requests_total", 4)
    s.flush_cache()
    ask(s, prompt, ratio=0.5)
    wait_for_metric(s, "sglang_tiered:sparse_requests_total", 5)
    mass_lines = s.log_lines("tiered sparse: rid")[3:]

    # 4. a `full` load reads every chunk of every layer: one corrupt chunk (layer 2) ends it
    (group,) = s.ssd.glob("*/groups/*.kvg")
    fd = os.open(group, os.O_RDWR)
    try:
        at = read_meta(fd).chunk_offset(2, 3) + 7
        os.pwrite(fd, bytes(b ^ 0xFF for b in os.pread(fd, 16, at)), at)
    finally:
        os.close(fd)
    s.flush_cache()
    mark = s.log_mark()
    recovered = ask(s, prompt, "full")
    after_corruption = wait_for_metric(s, "sglang_tiered:ssd_corrupt_pages_total", 10)  # the group's pages
    s.flush_cache()
    computed = ask(s, prompt, "off")
    fallbacks = s.log_lines("tiered sparse: rid", since=mark)

    assert gated["meta_info"]["completion_tokens"] >= 1
    assert len(lines) == 3 and "mode=full" in lines[0] and "mode=gated" in lines[1], lines
    assert "loaded 1.000 of the stored token-layers" in lines[0]
    parsed = [LOG_PATTERN.search(line) for line in lines]  # what the benchmark reads from these lines
    assert all(parsed) and parsed[1].group(1) == gated["meta_info"]["id"], lines

    def between(a: str, b: str, name: str) -> float:
        return metric_total(b, f"sglang_tiered:sparse_{name}_total") - \
            metric_total(a, f"sglang_tiered:sparse_{name}_total")

    def delta(name: str) -> float:  # over both gated loads
        return between(before, after, name)

    full_bytes = metric_total(before, "sglang_tiered:sparse_bytes_read_total")  # the `full` load alone
    assert delta("requests") == 2
    assert delta("gate_passes") >= 1 and delta("tokens_skipped") > 0
    assert metric_total(before, "sglang_tiered:sparse_bytes_skipped_total") == 0  # the `full` load skipped none
    # SmolLM2 in fp32: K and V of 3 KV heads x 64 dims x 4 bytes per token-layer
    assert delta("bytes_skipped") == delta("tokens_skipped") * 2 * 3 * 64 * 4
    assert delta("bytes_read") / 2 < full_bytes  # each gated load read less than the full one
    assert cached_details(gated_again)["device"] == 0  # approximate KV never entered the radix tree

    # probe skipping (--tiered-importance-probe-skip 1): the layers whose gate failed on the first gated load are
    # loaded whole without their probe on the second -- what their failed gate loaded anyway, so the same output --
    # and each saves exactly its probe: 4-bit keys (64 dims in 32 bytes) + fp16 scales of the 3 KV heads for every
    # stored token
    failed = between(before, mid, "gate_fails")
    assert failed > 0 and between(before, mid, "probes_skipped") == 0
    assert between(mid, after, "probes_skipped") == failed and f"({int(failed)} unprobed)" in lines[2], lines
    assert gated_again["output_ids"] == gated["output_ids"]
    stored = int(parsed[2].group(2))
    saved = between(before, mid, "bytes_read") - between(mid, after, "bytes_read")
    assert saved == failed * stored * 3 * (32 + 2)

    assert mass["meta_info"]["completion_tokens"] >= 1
    assert len(mass_lines) == 2 and "mode=gated mass gate passed" in mass_lines[0], mass_lines
    passed = between(after, after_mass, "gate_passes")
    assert 0 < passed < 30  # SmolLM2: 30 layers
    assert 0 < between(after, after_mass, "attention_dropped") <= 0.15 * passed
    assert between(after, after_mass, "bytes_read") < full_bytes
    # a request's own ratio (custom_params.tiered_importance_ratio): logged, with its own probe-skipping history --
    # the Jaccard loads at the default 0.2 before it failed layers it would otherwise skip unprobed
    assert "ratio 0.20" in lines[1] and "(0 unprobed)" not in lines[2], lines
    assert "mode=gated jaccard gate passed" in mass_lines[1], mass_lines
    assert "ratio 0.50" in mass_lines[1] and "(0 unprobed)" in mass_lines[1], mass_lines

    assert recovered["output_ids"] == cold["output_ids"]
    assert any("stored span unreadable" in line and "SGLang computes the span" in line for line in fallbacks), \
        fallbacks
    assert metric_total(after_corruption, "sglang_tiered:sparse_fallbacks_total") == 1
    # full, the two gated, mass and ratio 0.5 loads; the `full` one after the corruption ended before it was counted
    assert metric_total(after_corruption, "sglang_tiered:sparse_requests_total") == 5
    assert not group.exists()
    assert cached_details(computed)["storage"] == 0 and computed["output_ids"] == cold["output_ids"]


def test_a_prompt_longer_than_one_extend_keeps_sglangs_load(gated_server, essays):
    """A gated request that SGLang would prefill in pieces (longer than --chunked-prefill-size) cannot be loaded
    sparsely (a piece is not the whole prompt): it keeps SGLang's own load of its stored prefix -- exact, counted,
    logged -- rather than skipping that load and leaving SGLang to compute the span."""
    s = gated_server
    prompt = essays[5] + essays[6] + "\n\nQuestion: What are these essays about?\nAnswer:"
    mark = s.log_mark()
    before = metric_total(s.get("/metrics"), "sglang_tiered:sparse_too_long_total")
    cold = ask(s, prompt)
    assert cold["meta_info"]["prompt_tokens"] > PIECE
    wait_for_repack(s, mark, pages=cold["meta_info"]["prompt_tokens"] // PAGE)
    s.flush_cache()
    again = ask(s, prompt)
    too_long = s.log_lines("not loaded sparsely", mark)
    computed = s.log_lines("SGLang computes the span", mark)
    counted = metric_total(wait_for_metric(s, "sglang_tiered:sparse_too_long_total", before + 1),
                           "sglang_tiered:sparse_too_long_total") - before
    assert cached_details(again)["storage"] >= 640  # SGLang read the stored prefix back
    assert again["output_ids"] == cold["output_ids"]
    assert len(too_long) == 1 and f"exceed --chunked-prefill-size {PIECE}" in too_long[0], too_long
    assert not computed and counted == 1
