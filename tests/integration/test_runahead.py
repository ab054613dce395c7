"""Chained prefill (KV-Runahead) in a real SGLang server: CPU, the embedded SmolLM2 in fp32 (so that the engine's
kernels and SGLang's agree to greedy-token identity), 2 ranks: this server's scheduler plus one helper process.

The fp32 reference server (SGLang's own prefill, see conftest.py) and a server with runahead answer the same prompts
in the same order:
1. long prompts are prefilled through the chain (logged) and the greedy output is token-identical to the baseline,
   also for a prompt that extends a cached radix prefix (the chain extends it);
2. a stalled helper (SIGSTOP) -> that prefill times out and falls back to SGLang's prefill, identical output;
3. a helper killed while the chain waits on it -> immediate fallback, identical output;
4. after each failure the chain restarts in the background and the next long prompt is chained again;
5. `/metrics` counts the chained prefills and the fallbacks;
6. when the server stops, no helper process survives;
and a chain whose helpers cannot restart (weights gone from the model directory) is given up after MAX_RESTARTS + 1
consecutive failures, logged once, while the server keeps answering.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from sglang_tiered.server_process import ServerProcess, metric_total, process_alive
from tests.integration.helpers import tiered_args

pytestmark = [pytest.mark.server, pytest.mark.slow]

TIMEOUT_S = 3


def server(tmp: Path, name: str, *extra: str, model_path: str = "smollm2") -> ServerProcess:
    args = tiered_args(tmp / f"ssd-{name}", "--dtype", "float32", *extra, max_tokens=8192)
    return ServerProcess(args, log_path=tmp / f"{name}.log", model_path=model_path)


def lines(log: Path, pattern: str) -> list[str]:
    return [ln for ln in log.read_text(errors="replace").splitlines() if pattern in ln]


def wait_ready(log: Path, count: int, timeout: float = 120.0) -> list[int]:
    """Helper pids of the `count`-th 'chain ranks ready' line, once it is logged."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready = lines(log, "chain ranks ready")
        if len(ready) >= count:
            return [int(p) for p in re.search(r"helper pids \[([\d, ]+)\]", ready[count - 1]).group(1).split(",")]
        time.sleep(0.5)
    raise TimeoutError(f"chain not ready ({count}) after {timeout} s")


@pytest.fixture(scope="module")
def chain(tmp_path_factory, model_dir):
    """One runahead server for the module, on a copy of the model directory made of symlinks (so that the
    give-up test can take the weights away). Yields (server, log, model directory, helper pids seen)."""
    tmp = tmp_path_factory.mktemp("runahead")
    model = tmp / "model"
    model.mkdir()
    for f in model_dir.iterdir():
        if f.is_file():
            os.symlink(f, model / f.name)
    pids: list[int] = []
    with server(tmp, "chain", "--tiered-runahead-ranks", "2", "--tiered-runahead-min-tokens", "256",
                "--tiered-runahead-timeout", str(TIMEOUT_S), "--enable-metrics", model_path=str(model)) as s:
        yield s, tmp / "chain.log", model, pids
    assert not any(process_alive(p) for p in pids)  # no helper outlives the server


def test_chained_prefill_is_exact_and_survives_dead_and_stalled_ranks(essays, fp32_server, chain):
    a, c, d, e = essays[0], essays[2], essays[3], essays[4]
    b = a + essays[1][:1600]  # extends a's cached prefix by ~400 tokens
    prompts = [a, b, c, d, e]
    fp32_server.flush_cache()
    base = [fp32_server.generate(p, max_new_tokens=12)["text"] for p in prompts]  # SGLang's own fp32 prefill

    s, log, _, pids_seen = chain
    pids_seen += wait_ready(log, 1)
    assert s.generate(a, max_new_tokens=12)["text"] == base[0]
    assert s.generate(b, max_new_tokens=12)["text"] == base[1]
    chained = lines(log, "tiered runahead: rid")
    assert len(chained) == 2 and "radix_prefix=0" in chained[0], chained
    assert re.search(r"radix_prefix=[1-9]\d* ranks=2", chained[1]), chained  # the chain extended a prefix

    os.kill(pids_seen[0], signal.SIGSTOP)  # stall: the chain waits TIMEOUT_S, then SGLang prefills
    t0 = time.monotonic()
    assert s.generate(c, max_new_tokens=12)["text"] == base[2]
    assert time.monotonic() - t0 < 60
    assert "chain failed" in lines(log, "runs a normal prefill")[-1]

    pids_seen += wait_ready(log, 2)  # restarted in the background
    assert not process_alive(pids_seen[0])
    victim = pids_seen[1]
    os.kill(victim, signal.SIGSTOP)  # the job waits unread; the chain blocks on the victim, which then dies
    threading.Timer(1.0, os.kill, (victim, signal.SIGKILL)).start()
    t0 = time.monotonic()
    assert s.generate(d, max_new_tokens=12)["text"] == base[3]
    fallbacks = lines(log, "runs a normal prefill")
    assert len(fallbacks) == 2 and "chain failed" in fallbacks[-1], fallbacks

    pids_seen += wait_ready(log, 3)
    assert s.generate(e, max_new_tokens=12)["text"] == base[4]
    assert len(lines(log, "tiered runahead: rid")) == 5 and "(chained prefills 3, fallbacks 2)" in \
        lines(log, "tiered runahead: rid")[-1]
    text = s.get("/metrics")
    assert metric_total(text, "sglang_tiered:runahead_prefills_total") == 3
    assert metric_total(text, "sglang_tiered:runahead_fallbacks_total") == 2
    assert metric_total(text, "sglang_tiered:runahead_bytes_sent_total") > 0
    assert not any(process_alive(p) for p in pids_seen[:-1])  # the replaced helpers are gone


def test_a_chain_that_keeps_failing_is_given_up_and_the_server_keeps_answering(essays, chain):
    """Helpers load the weights from the model directory whenever they (re)start. Take the weights away and kill
    the helper: the chain fails, every restart fails, and after MAX_RESTARTS + 1 consecutive failures the server
    stops trying; every request is still answered by SGLang's own prefill. (Runs after the test above on the same
    server, whose last chained prefill succeeded: the failure count starts at 0.)"""
    from sglang_tiered.integration.runahead import MAX_RESTARTS

    s, log, model, pids = chain
    mark = s.log_mark()
    ready = lines(log, "chain ranks ready")
    helper = int(re.search(r"helper pids \[([\d, ]+)\]", ready[-1]).group(1).split(",")[0])
    pids.append(helper)
    for f in model.glob("*.safetensors"):
        f.unlink()
    os.kill(helper, signal.SIGKILL)
    assert s.generate(essays[5], max_new_tokens=4)["text"].strip()  # the chain fails: a normal prefill
    assert "chain failed" in s.log_lines("runs a normal prefill", mark)[-1]
    deadline = time.monotonic() + 180
    while not s.log_lines(f"failed to start ({MAX_RESTARTS + 1}/{MAX_RESTARTS + 1})", mark):
        assert time.monotonic() < deadline, s.log_lines("failed to start", mark)
        s.generate("A short prompt keeps the scheduler stepping", max_new_tokens=4)  # restarts need forwards
        time.sleep(1.0)
    attempts = len(s.log_lines("failed to start", mark))
    assert attempts == MAX_RESTARTS  # the first failure was the chain itself, then the restarts
    for essay in essays[6:8]:
        assert s.generate(essay, max_new_tokens=4)["text"].strip()
    assert "(given up)" in s.log_lines("runs a normal prefill", mark)[-1]
    assert len(s.log_lines(f"giving up after {MAX_RESTARTS + 1} consecutive chain failures", mark)) == 1
    assert len(s.log_lines("failed to start", mark)) == attempts  # no further attempt
    assert not s.log_lines("chain ranks ready", mark)
