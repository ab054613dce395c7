"""Importance capture and importance-aware placement in live servers (CPU, the embedded SmolLM2).

1. Capture is read-only: greedy output with capture on equals capture off (`--tiered-importance-heads 0`), and the
   importance table learns every complete page of every prompt under the keys the SSD tier files the pages under;
   it survives a restart (the log in the namespace directory).
2. Placement: with a device pool of 2048 tokens, a prompt reused twice, then three other prompts pushing it out.
   Under `lru` (SGLang's order) the reused prompt, least recently used, would leave device memory first (checked
   by hand: its next request is a host hit); under `importance` it has the most reuses and stays, the other
   prompts go. The answers equal LRU's. The test fails if the policy is silently ignored (SGLang's Rust tree core
   takes no Python strategy).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from sglang_tiered.server_process import ServerProcess, cached_details, metric_total
from sglang_tiered.storage.importance_table import ImportanceTable
from sglang_tiered.storage.page_file import PAGE_SUFFIX
from tests.integration.conftest import PROMPT_CHARS
from tests.integration.helpers import chosen_dtype, tiered_args
from tests.rounding import SMOLLM2, rows_alone

pytestmark = [pytest.mark.server, pytest.mark.slow]

PAGE = 64


def server(tmp: Path, name: str, *extra: str, max_tokens: int = 4096) -> ServerProcess:
    return ServerProcess(tiered_args(tmp / f"ssd-{name}", "--enable-metrics", *extra, max_tokens=max_tokens),
                         log_path=tmp / f"{name}.log")


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


def test_importance_placement_keeps_the_reused_prompt_on_device(tmp_path, essays, shared_server):
    """Under LRU (SGLang's order) the popular prompt -- computed once, reused twice, then three other prompts -- is
    the least recently used when the pool runs out, and leaves device memory first; a policy that were silently
    ignored (SGLang's Rust tree core takes no Python strategy) would show exactly that. Under `importance` it has
    the most reuses and stays. The answers equal those of the shared server (LRU placement)."""
    long = [e for e in essays if len(e) == PROMPT_CHARS]  # about 700 tokens each: three fit in the pool, four do not
    popular, others = long[30], long[31:34]
    with server(tmp_path, "importance", "--tiered-placement", "importance", "--tiered-host-size", "2x",
                "--dtype", chosen_dtype(shared_server), max_tokens=2048) as s:
        first = [s.generate(popular, max_new_tokens=8) for _ in range(3)]  # computed once, reused twice
        rest = [s.generate(text, max_new_tokens=8) for text in others]
        again = s.generate(popular, max_new_tokens=8)
        assert s.log_lines("tiered placement: importance on SGLang's python tree core")
    assert cached_details(first[2])["device"] >= 640  # the popular prompt really was reused
    assert cached_details(again)["device"] >= 640, cached_details(again)  # kept on device
    lru = [shared_server.generate(t, max_new_tokens=8)["output_ids"] for t in (popular, *others)]
    assert [r["output_ids"] for r in (first[0], *rest)] == lru
    assert again["output_ids"] == first[2]["output_ids"]  # device hits of the same pages (a cold prefill's answer
    # can differ from a hit's on a CPU whose kernels round a batch's rows by its shape: tests/rounding.py)
    if rows_alone(getattr(torch, chosen_dtype(shared_server)), *SMOLLM2):
        assert again["output_ids"] == first[0]["output_ids"]
