"""Importance capture and importance-aware placement in live servers (CPU, the embedded SmolLM2).

1. Capture is read-only: greedy output with capture on equals capture off (`--tiered-importance-heads 0`), and the
   importance table learns every complete page of every prompt under the keys the SSD tier files the pages under;
   it survives a restart (the log in the namespace directory).
2. Placement: with a device pool of 2048 tokens, a prompt reused twice, then three other prompts pushing it out.
   Under `lru` (SGLang's order) the reused prompt, least recently used, leaves device memory first; under
   `importance` it has the most reuses and stays, the other prompts go. The answers are identical either way.
   The test would fail if the policy were silently ignored (SGLang's Rust tree core takes no Python strategy).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sglang_tiered.server_process import ServerProcess, cached_details, metric_total
from sglang_tiered.storage.importance_table import ImportanceTable
from sglang_tiered.storage.page_file import PAGE_SUFFIX
from tests.integration.conftest import PROMPT_CHARS
from tests.integration.helpers import chosen_dtype, tiered_args

pytestmark = [pytest.mark.server, pytest.mark.slow]

PAGE = 64


def server(tmp: Path, name: str, *extra: str, max_tokens: int = 4096) -> ServerProcess:
    return ServerProcess(tiered_args(tmp / f"ssd-{name}", "--enable-metrics", *extra, max_tokens=max_tokens),
                         log_path=tmp / f"{name}.log")


def test_capture_is_read_only_and_learns_every_page(tmp_path, essays, shared_server):
    prompts = [essays[20], essays[21][:1200], essays[20] + essays[22][:800]]  # the third extends the first
    with server(tmp_path, "off", "--tiered-importance-heads", "0", "--dtype", chosen_dtype(shared_server)) as s:
        off = [s.generate(p, max_new_tokens=16)["output_ids"] for p in prompts]
    mark = shared_server.log_mark()
    shared_server.flush_cache()
    before = shared_server.get("/metrics")
    on = [shared_server.generate(p, max_new_tokens=16) for p in prompts]
    assert [r["output_ids"] for r in on] == off
    assert not shared_server.log_lines("tiered importance: capture failed", mark)
    after = shared_server.get("/metrics")
    scored = metric_total(after, "sglang_tiered:importance_prompts_total") - \
        metric_total(before, "sglang_tiered:importance_prompts_total")
    assert scored == len(prompts)

    # every complete page of each prompt is known, under the SSD tier's own keys (after write-through)
    pages = sum(r["meta_info"]["prompt_tokens"] // PAGE for r in on)
    ns_dir = next(p.parent for p in shared_server.ssd.glob("*/NAMESPACE.json"))
    deadline = time.monotonic() + 30
    while len(list(ns_dir.rglob(f"*{PAGE_SUFFIX}"))) < pages // 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    stored = {p.name[: -len(PAGE_SUFFIX)] for p in ns_dir.rglob(f"*{PAGE_SUFFIX}")}
    table = ImportanceTable(PAGE, directory=ns_dir, readonly=True)  # a reader of the log, as after a restart
    known = {k for k in stored if table.get(k) is not None}
    assert stored and known == stored, (len(stored), len(known))
    third = on[2]["meta_info"]
    assert cached_details(on[2])["device"] >= 640  # reused the first prompt's pages ...
    reused = [table.get(k).reuses for k in stored]
    assert max(reused) >= 1 and third["cached_tokens"] >= 640  # ... and they were counted as reused
    imp = [table.get(k).tokens for k in stored]
    assert all(((t >= 0) & (t <= 1)).all() for t in imp)
    share = sum(float(t.sum()) for t in imp) / (len(imp) * PAGE)
    assert 0.05 < share < 0.6, share  # ~ the 20 % ratio (pages observed by two prompts average their verdicts)


def placement_run(tmp: Path, placement: str, essays: list[str]) -> tuple[list[dict], dict]:
    long = [e for e in essays if len(e) == PROMPT_CHARS]  # about 700 tokens each: three fit in the pool, four do not
    popular, others = long[30], long[31:34]
    with server(tmp, placement, "--tiered-placement", placement, "--tiered-host-size", "2x",
                max_tokens=2048) as s:
        first = [s.generate(popular, max_new_tokens=8) for _ in range(3)]  # computed once, reused twice
        for text in others:
            s.generate(text, max_new_tokens=8)
        again = s.generate(popular, max_new_tokens=8)
        assert s.log_lines(f"tiered placement: {placement} on SGLang's python tree core") or placement == "lru"
    return first, again


def test_importance_placement_keeps_the_reused_prompt_on_device_where_lru_evicts_it(tmp_path, essays):
    lru_first, lru_again = placement_run(tmp_path, "lru", essays)
    imp_first, imp_again = placement_run(tmp_path, "importance", essays)
    assert cached_details(imp_first[2])["device"] >= 640  # the popular prompt really was reused
    assert cached_details(lru_again)["device"] == 0, cached_details(lru_again)  # LRU: evicted, oldest
    assert cached_details(imp_again)["device"] >= 640, cached_details(imp_again)  # importance: kept
    assert [r["output_ids"] for r in (*lru_first, lru_again)] == [r["output_ids"] for r in (*imp_first, imp_again)]
