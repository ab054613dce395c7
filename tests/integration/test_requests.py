"""No request takes the server down: a table of bad requests against a live server (the shared one), each answered
with a 4xx that says what is wrong, while a well-formed client keeps being served with the output it gets alone.
"""

from __future__ import annotations

import re
import threading

import pytest

from tests.integration.helpers import GOOD, SEP

pytestmark = pytest.mark.server

CHAT = "/v1/chat/completions"

BAD = [  # (path, body, words the error message must contain)
    ("/generate", {"text": ""}, "empty"),
    ("/generate", {"text": SEP * 3}, "only '<|chunk|>' separators"),
    ("/generate", {"text": "doc one" + SEP + SEP + "question"}, "chunk 2 of 2 is empty"),
    ("/generate", {"text": SEP + "doc" + SEP + "question"}, "chunk 1 of 2 is empty"),
    ("/generate", {"text": "doc" + SEP}, "the question) is empty"),
    ("/generate", {"text": ("word" + SEP) * 3000 + "question"}, "3000 chunk separators"),
    ("/generate", {"text": SEP * 5000}, "5000 chunk separators"),
    ("/generate", {"input_ids": [1, 2, 999999]}, "input_ids[2] = 999999 is outside the model's vocabulary"),
    ("/generate", {"input_ids": [1, -5, 3]}, "input_ids[1] = -5"),
    ("/generate", {"input_ids": [49152]}, "[0, 49152)"),
    ("/generate", {"input_ids": []}, "empty"),
    ("/generate", {"input_ids": [1, 2.5]}, "int"),
    ("/generate", {"text": ["a fine prompt", ""]}, "empty"),
    ("/generate", {"input_ids": [[5, 6], [7, 10**9]]}, "outside the model's vocabulary"),
    ("/generate", {"text": "hi", "sampling_params": {"custom_params": {"tiered_chunks": ["a"]}}},
     "list of integers"),
    ("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"custom_params": {"tiered_chunks": [1, 0, 2]}}},
     "chunk 2 of 2 is empty"),
    ("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"custom_params": {"tiered_chunks": [1, 1]}}},
     "adds up to 2 tokens; the prompt has 3"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"custom_params": {"tiered_importance": "sparse"}}},
     "custom_params.tiered_importance must be one of"),
    ("/generate", {"text": "hi", "sampling_params": {"custom_params": {"tiered_importance_gate": "vote"}}},
     "custom_params.tiered_importance_gate must be one of ('jaccard', 'mass')"),
    ("/generate", {"text": "hi", "sampling_params": {"custom_params": {"tiered_importance_ratio": 0}}},
     "custom_params.tiered_importance_ratio must be a number in (0, 1], got 0"),
    ("/generate", {"text": "hi", "sampling_params": {"custom_params": {"tiered_importance_ratio": "half"}}},
     "custom_params.tiered_importance_ratio must be a number in (0, 1]"),
    ("/v1/completions", {"model": "m", "prompt": "", "max_tokens": 4}, "empty"),
    ("/v1/completions", {"model": "m", "prompt": [5, 999999], "max_tokens": 4}, "999999"),
    ("/v1/completions", {"model": "m", "prompt": SEP + SEP, "max_tokens": 4}, "separators"),
    ("/v1/completions", {"model": "m", "prompt": "doc" + SEP + SEP + "q", "max_tokens": 4}, "is empty"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": SEP + SEP}], "max_tokens": 4}, "is empty"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "a" + SEP + SEP + "b"}], "max_tokens": 4},
     "is empty"),
    (CHAT, {"model": "m", "messages": [], "max_tokens": 4}, "empty"),
]


def message(body: dict) -> str:
    err = body.get("error", body)
    return str(err.get("message", err) if isinstance(err, dict) else err)


def test_bad_requests_get_a_4xx_and_nothing_else_happens(shared_server):
    s = shared_server
    alone = s.generate(GOOD, max_new_tokens=12)["text"]
    outputs: list[str] = []
    stop = threading.Event()

    def good_client() -> None:  # a well-formed client, busy while the bad requests arrive
        while not stop.is_set():
            outputs.append(s.generate(GOOD, max_new_tokens=12)["text"])

    client = threading.Thread(target=good_client)
    client.start()
    try:
        answers = [(path, body, *s.request(path, body)) for path, body, _ in BAD]
    finally:
        stop.set()
        client.join(timeout=120)
    for (path, body, status, reply), (_, _, words) in zip(answers, BAD):
        assert 400 <= status < 500, (path, body, status, reply)
        assert words in message(reply), (path, str(body)[:80], message(reply))
    assert s.get("/health") is not None
    assert outputs and all(out == alone for out in outputs), outputs  # unaffected, and never failed
    assert s.generate(GOOD, max_new_tokens=12)["text"] == alone


def test_many_small_chunks_are_served(shared_server):
    """A hundred separators with text between them are a valid (if unusual) prompt: blended, answered (the chunks
    in the prompt's last partial page are computed fresh: a repeat's prefix match stops before them)."""
    mark = shared_server.log_mark()
    text = "".join(f"Fact {i}.{SEP}" for i in range(100)) + "Which fact comes first?"
    out = shared_server.generate(text, max_new_tokens=4)
    assert out["meta_info"]["completion_tokens"] >= 1
    line = shared_server.log_lines("tiered blend: rid", mark)[0]
    got = re.search(r"chunks=(\d+) \(new (\d+)\)", line)
    assert got and got.group(1) == got.group(2) and 80 <= int(got.group(1)) < 100, line


def test_dtype_auto_is_measured_and_logged(shared_server):
    line = shared_server.log_lines("--dtype auto on this CPU:")[0]
    assert "CPU capability" in line and "float32" in line and "bfloat16" in line and "x the slowest" in line


def test_a_cpu_server_runs_sglangs_loop_without_overlap(shared_server):
    """docs/cpu.md: on a CPU the overlap loop's launch of the next batch is the whole forward, so the server runs
    SGLang's loop without overlap: said in the log, and what the running server reports as its settings."""
    import json

    assert shared_server.log_lines("--disable-overlap-schedule (CPU")
    info = json.loads(shared_server.get("/server_info"))
    assert info["disable_overlap_schedule"] is True
