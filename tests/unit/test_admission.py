"""Admission of requests that prefill alone (policy/admission.py): exact verdicts for each case."""

from sglang_tiered.policy.admission import admit


def test_an_ordinary_request_joins_a_batch_of_ordinary_requests():
    assert admit([], alone=False) == "join"
    assert admit([False, False], alone=False) == "join"


def test_nothing_joins_a_batch_holding_a_request_that_prefills_alone():
    assert admit([True], alone=False) == "stop"
    assert admit([True], alone=True) == "stop"


def test_a_solo_request_closes_a_batch_that_has_a_request_and_joins_an_empty_one():
    assert admit([False], alone=True) == "stop"
    assert admit([False, False], alone=True) == "stop"
    assert admit([], alone=True) == "join"


def test_a_queue_walk_keeps_first_come_first_served_and_prefills_each_solo_request_alone():
    """SGLang's walk over a FCFS queue, round after round: requests marked True prefill alone."""
    queue = [("b1", True), ("a1", False), ("a2", False), ("b2", True), ("a3", False)]
    rounds = []
    while queue:
        batch: list[tuple[str, bool]] = []
        for rid, alone in queue:
            if admit([a for _, a in batch], alone) == "stop":
                break
            batch.append((rid, alone))
        queue = queue[len(batch):]
        rounds.append([rid for rid, _ in batch])
    assert rounds == [["b1"], ["a1", "a2"], ["b2"], ["a3"]]
