"""Admission of requests that prefill alone (policy/admission.py): exact verdicts for each case."""

from sglang_tiered.policy.admission import admit


def test_an_ordinary_request_joins_a_batch_of_ordinary_requests():
    assert admit([], alone=False, yielded=False) == "join"
    assert admit([False, False], alone=False, yielded=False) == "join"


def test_nothing_joins_a_batch_holding_a_request_that_prefills_alone():
    assert admit([True], alone=False, yielded=False) == "stop"
    assert admit([True], alone=True, yielded=True) == "stop"


def test_a_solo_request_that_cannot_join_is_passed_over_not_blocking_the_queue():
    assert admit([False], alone=True, yielded=False) == "skip"
    assert admit([False], alone=True, yielded=True) == "skip"


def test_a_solo_request_first_in_line_yields_exactly_once():
    assert admit([], alone=True, yielded=False) == "skip"
    assert admit([], alone=True, yielded=True) == "join"


def test_a_queue_walk_batches_ordinary_requests_past_solo_ones_and_admits_each_solo_one_next():
    """SGLang's walk over a FCFS queue, round after round: requests marked True prefill alone."""
    queue = [("b1", True), ("a1", False), ("b2", True), ("a2", False)]
    yielded: set[str] = set()
    rounds = []
    while queue:
        batch: list[tuple[str, bool]] = []
        for rid, alone in list(queue):
            verdict = admit([a for _, a in batch], alone, rid in yielded)
            if verdict == "stop":
                break
            if verdict == "skip":
                yielded.add(rid)
                continue
            batch.append((rid, alone))
        queue = [q for q in queue if q not in batch]
        rounds.append([rid for rid, _ in batch])
    assert rounds == [["a1", "a2"], ["b1"], ["b2"]]


def test_without_passing_over_a_solo_request_closes_the_batch_or_joins_an_empty_one():
    assert admit([False], alone=True, yielded=False, pass_over=False) == "stop"
    assert admit([], alone=True, yielded=False, pass_over=False) == "join"
    assert admit([True], alone=False, yielded=False, pass_over=False) == "stop"
    assert admit([False], alone=False, yielded=False, pass_over=False) == "join"
