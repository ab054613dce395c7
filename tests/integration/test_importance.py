"""Importance capture in live servers (CPU, the embedded SmolLM2).

1. Capture is read-only: greedy output with capture on equals capture off (`--tiered-importance-heads 0`), and the
   importance table learns every complete page of every prompt under the keys the SSD tier files the pages under;
   it survives a restart (the log in the namespace directory).
Importance-aware placement is tested on the store's server (tests/integration/test_store.py).
"""

from __future__ import annotations

import time

import pytest

from sglang_tiered.server_process import cached_details, metric_total
from sglang_tiered.storage.importance_table import ImportanceTable
from sglang_tiered.storage.page_file import PAGE_SUFFIX

pytestmark = [pytest.mark.server, pytest.mark.slow]

PAGE = 64


def prompt_page_keys(ids: list[int]) -> list[str]:
    """Storage keys of the complete pages of a prompt (SGLang's hash chain, what the SSD tier files pages under)."""
    from array import array

    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    n = len(ids) // PAGE * PAGE
    return list(get_storage_hash_str(RadixKey(array("q", ids[:n])), None, page_size=PAGE)) if n else []


def test_capture_is_read_only_and_learns_every_page(essays, shared_server, torch_native_server):
    """The torch_native server runs with capture off (`--tiered-importance-heads 0`) in the shared server's dtype;
    test_cpu_attention shows the two attention paths agree token for token, so equal outputs here mean capture
    changed nothing."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(shared_server.model_dir)
    texts = [essays[20], essays[21][:1200], essays[20] + essays[22][:800]]  # the third extends the first
    prompts = [tok(t)["input_ids"] for t in texts]
    off = [torch_native_server.generate_ids(p, max_new_tokens=16)["output_ids"] for p in prompts]
    mark = shared_server.log_mark()
    shared_server.flush_cache()
    before = shared_server.get("/metrics")
    on = [shared_server.generate_ids(p, max_new_tokens=16) for p in prompts]
    assert [r["output_ids"] for r in on] == off
    assert not shared_server.log_lines("tiered importance: capture failed", mark)
    after = shared_server.get("/metrics")
    scored = metric_total(after, "sglang_tiered:importance_prompts_total") - \
        metric_total(before, "sglang_tiered:importance_prompts_total")
    assert scored == len(prompts)

    # every complete page of each prompt is known, under the key the SSD tier files it under
    keys = {k for p in prompts for k in prompt_page_keys(p)}
    ns_dir = next(p.parent for p in shared_server.ssd.glob("*/NAMESPACE.json"))
    deadline = time.monotonic() + 30
    while not all((ns_dir / k[:2] / f"{k}{PAGE_SUFFIX}").exists() for k in keys) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all((ns_dir / k[:2] / f"{k}{PAGE_SUFFIX}").exists() for k in keys)  # written through under these keys
    table = ImportanceTable(PAGE, directory=ns_dir, readonly=True)  # a reader of the log, as after a restart
    assert all(table.get(k) is not None for k in keys)
    first = prompt_page_keys(prompts[0])
    assert cached_details(on[2])["device"] >= 640  # the third prompt reused the first one's pages ...
    assert all(table.get(k).reuses >= 1 for k in first)  # ... and they were counted as reused
    imp = [table.get(k).tokens for k in keys]
    assert all(((t >= 0) & (t <= 1)).all() for t in imp)
    share = sum(float(t.sum()) for t in imp) / (len(imp) * PAGE)
    assert 0.05 < share < 0.6, share  # ~ the 20 % ratio (pages observed by two prompts average their verdicts)
