"""The mechanisms under SGLang's overlap loop, the loop every CUDA server runs (a CPU server turns it off,
docs/cpu.md; `SGLANG_TIERED_CPU_OVERLAP=1` keeps it): one fp32 server with it on. A stored prompt comes back from
the SSD tier with the cold answer, by SGLang's load and by our compute-or-load loader (forced per request); a marked
prompt is blended, and its repeat hits the blended KV with the same answer."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from sglang_tiered.integration.server_flags import CPU_OVERLAP_ENV
from sglang_tiered.server_process import ServerProcess, cached_details
from tests.integration.helpers import SEP, tiered_args
from tests.integration.kvpr_helpers import ask

pytestmark = [pytest.mark.server, pytest.mark.slow]

HEAD = "<|im_start|>system\nAnswer the question using the documents.<|im_end|>\n<|im_start|>user\n"
FACTS = ["Alice works at the Amber Museum. ", "The Amber Museum is in Lisbon. "]
TAIL = "\nQuestion: In which city does Alice work?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def overlap_server(tmp_path_factory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("overlap")
    args = tiered_args(tmp / "ssd", "--dtype", "float32", "--enable-metrics", max_tokens=4096)
    with ServerProcess(args, log_path=tmp / "overlap.log", env={CPU_OVERLAP_ENV: "1"}) as server:
        yield server


def from_ssd(s: ServerProcess, text: str, mode: str | None = None) -> dict:
    """`text` asked with device and host emptied, once its pages reached the SSD tier (written behind the
    requests): at most 30 s."""
    deadline = time.monotonic() + 30
    while True:
        s.flush_cache()
        out = ask(s, text, mode)
        if cached_details(out)["storage"] >= 640 or time.monotonic() > deadline:
            return out
        time.sleep(0.5)


def test_the_server_runs_sglangs_overlap_loop(overlap_server):
    assert json.loads(overlap_server.get("/server_info"))["disable_overlap_schedule"] is False


def test_a_stored_prompt_comes_back_from_ssd_by_sglangs_load_and_by_ours(overlap_server, essays):
    s = overlap_server
    cold = ask(s, essays[0])
    for mode in (None, "force"):  # SGLang's load, then compute-or-load forced for this request
        mark = s.log_mark()
        hit = from_ssd(s, essays[0], mode)
        assert cached_details(hit)["storage"] >= 640, (mode, cached_details(hit))
        assert hit["output_ids"] == cold["output_ids"], mode
        if mode == "force":
            assert s.log_lines("tiered kvpr: rid", mark) and not s.log_lines("SGLang computes the span", mark)


def test_a_marked_prompt_is_blended_and_its_repeat_hits_the_blended_kv(overlap_server):
    s = overlap_server
    filler = "The gardens along the river were full of visitors that spring. " * 12
    prompt = HEAD + SEP + FACTS[0] + filler + SEP + filler + FACTS[1] + SEP + TAIL
    mark = s.log_mark()
    first = ask(s, prompt)
    assert len(s.log_lines("tiered blend: rid", mark)) == 1 and not s.log_lines("runs a normal prefill", mark)
    again = ask(s, prompt)
    assert again["meta_info"]["cached_tokens"] >= 64 and again["output_ids"] == first["output_ids"]
