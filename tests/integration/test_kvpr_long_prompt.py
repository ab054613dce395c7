"""Partial-recompute loading and long prompts: a prompt that SGLang would prefill in pieces (longer than
`--chunked-prefill-size`) is never planned, so it keeps SGLang's own load of its stored prefix. Its own module: the
server it starts must not overlap test_kvpr.py's module-scoped one (SGLang keeps 10 GiB of host memory free, and two
CPU servers beside another leave HiCache none).
"""

from __future__ import annotations

import pytest

from sglang_tiered.models import random_model_dir
from sglang_tiered.server_process import ServerProcess, cached_details
from tests.integration.helpers import tiered_args
from tests.integration.kvpr_helpers import MHA, PAGE, ask, counter, wait_for_activations

pytestmark = [pytest.mark.server, pytest.mark.slow]


def test_a_prompt_longer_than_one_extend_keeps_sglangs_load(tmp_path, essays):
    """A prompt that SGLang would prefill in pieces (longer than --chunked-prefill-size) is not planned for partial
    recompute (the loader computes whole prompts): SGLang loads its stored prefix as usual, nothing is computed."""
    model = random_model_dir(tmp_path / "model", MHA, seed=1)
    args = tiered_args(tmp_path / "ssd", "--dtype", "float32", "--enable-metrics", "--tiered-kvpr", "force",
                       "--chunked-prefill-size", "256")
    prompt = essays[2][:3000] + "\n\nQuestion: What is this essay about?\nAnswer:"
    with ServerProcess(args, log_path=tmp_path / "server.log", model_path=str(model)) as s:
        cold = ask(s, prompt)
        pages = cold["meta_info"]["prompt_tokens"] // PAGE
        wait_for_activations(s, pages)
        s.flush_cache()
        again = ask(s, prompt, 10**6)  # every page computed by our loader, were it planned
        loads, fallbacks = counter(s, "loads"), counter(s, "fallbacks")
    assert cached_details(again)["storage"] >= (pages - 1) * PAGE  # SGLang's own L3 load
    assert again["output_ids"] == cold["output_ids"]
    assert loads == 0 and fallbacks == 0
