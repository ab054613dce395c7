"""Helpers shared by the integration tests (not fixtures: those are in conftest.py)."""

from __future__ import annotations

import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from sglang_tiered.config import TieredConfig
from sglang_tiered.server_process import ServerProcess, cached_details, metric_total
from tests.rounding import SMOLLM2, rows_alone


def copy_tree(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, dirs_exist_ok=True)


SEP = TieredConfig.blend_separator  # the default chunk separator (`--tiered-blend-separator`)
GOOD = "The gardens along the river were full of visitors because"  # a plain prompt that is served

# SGLang's default prefetch policy ("timeout") gives a stored span 1 s + 0.25 s per 1024 tokens and then computes it;
# on a 2-core machine running two test workers a read can take longer. The tests ask what is loaded, not how fast.
WAIT_FOR_STORAGE = ("--hicache-storage-prefetch-policy", "wait_complete")


def tiered_args(ssd: Path, *extra: str, max_tokens: int = 4096) -> list[str]:
    return ["--kv-backend", "tiered", "--max-total-tokens", str(max_tokens), "--tiered-ssd-dir", str(ssd),
            "--tiered-stats-interval", "0", *WAIT_FOR_STORAGE, *extra]


def chosen_dtype(server: ServerProcess) -> str:
    """The dtype a `--dtype auto` server chose (its startup log line)."""
    line = server.log_lines("--dtype auto on this CPU:")[0]
    return re.search(r"on this CPU: (\w+)", line).group(1)


def flip_middle_byte(path: Path) -> None:
    """Corrupt a stored file the way bit rot would: one byte in its middle inverted (its checksum then fails)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def wait_for_metric(server: ServerProcess, name: str, at_least: float, timeout: float = 15.0) -> str:
    """Our counters are published once a second (metrics.StatsReporter): poll /metrics until `name` reaches
    `at_least` or the timeout passes; returns the last /metrics text."""
    deadline = time.monotonic() + timeout
    while metric_total(text := server.get("/metrics"), name) < at_least and time.monotonic() < deadline:
        time.sleep(0.25)
    return text


@dataclass(frozen=True)
class Answers:
    """What SGLang itself answers a prompt with, by the path it takes: `cold`, a prefill of the whole prompt, and
    `hit`, a device hit of its full pages (the prompt sent again at once). `exact`: this CPU rounds a batch's rows
    alone in the server's dtype (tests/rounding.py), so the two paths give one answer."""

    cold: dict
    hit: dict
    exact: bool

    @property
    def hit_tokens(self) -> int:
        return sum(cached_details(self.hit).values())

    def check(self, out: dict, what: str = "") -> None:
        """`out`, a reply to the same prompt by any path, answers as SGLang does by that path. A miss is the cold
        prefill; a hit of the whole prompt's pages -- on any tier -- is SGLang's own device hit: our tiers hand SGLang
        the very KV its prefill computed, and it computes the rest as after its own hit. Where rows round alone,
        every path must give the cold answer; elsewhere (an Intel Xeon with AMX in bf16: a greedy token can flip
        between a cold prefill and SGLang's own device hit) a partial hit has no exact reference and fails."""
        cached = sum(cached_details(out).values())
        if self.exact or cached == 0:
            assert out["text"] == self.cold["text"], (what, "cold", cached, out["text"], self.cold["text"])
        if cached:
            assert cached == self.hit_tokens or self.exact, (what, f"a hit of {cached} tokens, SGLang's own of "
                                                             f"{self.hit_tokens}: no exact reference on this CPU")
            assert out["text"] == self.hit["text"], (what, "hit", cached, out["text"], self.hit["text"])


def answers(s: ServerProcess, text: str, dtype: str, max_new_tokens: int = 8) -> Answers:
    """SGLang's answers to `text` on `s` (the embedded SmolLM2 in `dtype`), by path, under a fresh cache_salt so that
    nothing stored matches: a cold prefill, then its device hit."""
    salt = f"reference-{uuid.uuid4().hex}"
    got = []
    for _ in range(2):
        status, out = s.request("/generate", {"text": text, "cache_salt": salt, "sampling_params": {
            "max_new_tokens": max_new_tokens, "temperature": 0}}, timeout=300)
        assert status == 200, out
        got.append(out)
    cold, hit = got
    assert sum(cached_details(cold).values()) == 0 and cached_details(hit)["device"] > 0, (cold["meta_info"],
                                                                                           hit["meta_info"])
    return Answers(cold, hit, rows_alone(getattr(torch, dtype), *SMOLLM2))
