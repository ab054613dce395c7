"""Failures inside our own hooks (injected with SGLANG_TIERED_TEST_FAULTS) fall back to SGLang's code for that batch
only: a server of its own, every hook of ours that runs in a forward raising.
"""

from __future__ import annotations

import time

import pytest

from sglang_tiered.server_process import ServerProcess, metric_total
from tests.integration.helpers import GOOD, SEP, tiered_args

pytestmark = pytest.mark.server


@pytest.mark.slow
def test_failures_inside_our_hooks_fall_back_for_that_batch_only(tmp_path):
    """Every hook of ours that runs in a forward raises (SGLANG_TIERED_TEST_FAULTS): marked and plain requests are
    still answered, by SGLang's own admission, forward and attention, and a gated server's offers to the repacker
    are dropped; each failure is logged and counted. Measuring
    the compute-or-load profile (at SGLang's warmup request) fails too: logged once, and SGLang keeps loading every
    stored span."""
    faults = "blend_forward,cpu_attention,admission,kvpr_chunks,repack_offer"
    args = tiered_args(tmp_path / "ssd", "--enable-metrics", "--tiered-importance-load", "gated", max_tokens=2048)
    with ServerProcess(args, log_path=tmp_path / "faults.log",
                       env={"SGLANG_TIERED_TEST_FAULTS": faults}) as s:
        marked = s.generate("Alice works at the Amber Museum." + SEP + "The Amber Museum is in Lisbon." + SEP
                            + "In which city does Alice work?", max_new_tokens=8)
        plain = [s.generate(GOOD, max_new_tokens=8)["text"] for _ in range(2)]
        time.sleep(0.5)
        metrics = s.get("/metrics")
        log = "\n".join(s.log_lines())
        profile = s.log_lines("tiered kvpr: profile ")
    assert marked["meta_info"]["completion_tokens"] >= 1 and plain[0].strip() and plain[0] == plain[1]
    assert "injected fault in kvpr_chunks" in log and "measuring the compute profile failed" in log
    assert not profile  # no profile: SGLang loads every stored span
    assert "injected fault in blend_forward" in log and "SGLang's own forward runs instead" in log
    assert "injected fault in cpu_attention" in log and "torch_native runs instead" in log
    assert "injected fault in admission" in log
    assert "injected fault in repack_offer" in log and "the forward's result stands" in log
    assert metric_total(metrics, "sglang_tiered:repack_offers_total") == 0  # every offer failed: nothing offered
    assert metric_total(metrics, "sglang_tiered:hook_errors_total") >= 5
