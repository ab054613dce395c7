"""The demo's verdict (no server): hits from our tiers are held to SGLang's own device hit of the prompt; that hit
against the cold prefill is shown, not counted (it is SGLang's rounding, not the tiers')."""

from __future__ import annotations

from sglang_tiered.demo import _report

NONE = {"device": 0, "host": 0, "storage": 0}


def rows(repeat: str, host: str, ssd: str, host_hit: int = 640) -> list:
    return [("cold prefill", "none", 652, NONE, 1.5, "cold answer"),
            ("repeat", "device", 652, {**NONE, "device": 640}, 0.6, repeat),
            ("after device eviction", "host", 652, {**NONE, "host": host_hit}, 0.6, host),
            ("after host eviction", "storage", 652, {**NONE, "storage": 640}, 0.6, ssd)]


def test_tiers_that_answer_as_the_cold_prefill_and_the_device_hit_pass():
    failures, lines, cold, hit = _report(rows("cold answer", "cold answer", "cold answer"))
    assert failures == 0 and cold == hit == "cold answer"
    assert lines[1].endswith("yes") and lines[3].endswith("yes")


def test_a_device_hit_that_rounds_otherwise_is_shown_and_the_tiers_held_to_it():
    failures, lines, cold, hit = _report(rows("hit answer", "hit answer", "hit answer"))
    assert failures == 0 and (cold, hit) == ("cold answer", "hit answer")
    assert "SGLang's own hit" in lines[1]


def test_a_tier_that_answers_otherwise_than_the_device_hit_fails():
    failures, lines, _, _ = _report(rows("hit answer", "hit answer", "cold answer"))
    assert failures == 1 and lines[3].endswith("NO")


def test_a_step_that_missed_its_tier_fails():
    failures, lines, _, _ = _report(rows("cold answer", "cold answer", "cold answer", host_hit=0))
    assert failures == 1 and "expected a host hit" in lines[2]
