"""integration/ahead.py over stand-ins of SGLang's scheduler: the pass that runs a prefill-alone request before a
chunked request's next piece, once per piece, and SGLang's own pass in every other case."""

from __future__ import annotations

import sys
from collections import Counter
from types import SimpleNamespace as NS

import pytest

from sglang_tiered.integration.ahead import AheadOfChunks


class Rt:
    def __init__(self) -> None:
        self.events = NS(counts=Counter())
        self.events.count = lambda event, value=1: self.events.counts.update({event: value})


def req(rid: str, tokens: int = 100, alone: bool = False) -> NS:
    return NS(rid=rid, origin_input_ids=[1] * tokens, output_ids=[], prefix_len=0, alone=alone)


class Scheduler:
    """What the pass reads and rebinds: the chunked request, the waiting queue, the chunk budget. `admit` decides
    which queued requests the pass admits (SGLang's budget checks); `requeue` are requests it preempts."""

    def __init__(self, chunked, queue, limit: int = 1024, admit=lambda r: True, requeue=()) -> None:
        self.chunked_req, self.waiting_queue, self.chunked_prefill_size = chunked, list(queue), limit
        self.admit, self.requeue, self.passes = admit, list(requeue), []

    def get_new_batch_prefill(self, running_batch):
        """SGLang's pass, as far as this hook sees it: the chunked piece first, then what the queue admits."""
        self.passes.append((self.chunked_req, list(self.waiting_queue)))
        batch = [self.chunked_req] if self.chunked_req is not None else []
        batch += [r for r in self.waiting_queue if self.admit(r)]
        self.waiting_queue = [r for r in self.waiting_queue if r not in batch] + self.requeue
        self.requeue = []
        return NS(batch_to_run=batch or None, running_batch=running_batch)


def run(hook: AheadOfChunks, s: Scheduler):
    return hook._around(type(s).get_new_batch_prefill, s, "running")


def hook() -> tuple[AheadOfChunks, Rt]:
    rt = Rt()
    return AheadOfChunks(rt, lambda r: r.alone), rt


def test_a_prefill_alone_request_next_in_line_runs_before_the_next_piece_once_per_piece():
    h, rt = hook()
    long, mine, other, after = req("long", 5000), req("mine", alone=True), req("other"), req("after", alone=True)
    s = Scheduler(long, [mine, other])
    plan = run(h, s)
    assert plan.batch_to_run == [mine] and s.passes == [(None, [mine])]  # the piece set aside for this pass
    assert s.chunked_req is long and s.waiting_queue == [other]  # restored; the others keep their places
    assert rt.events.counts["prefill_ahead_of_chunks"] == 1
    # the next pass runs the piece, whatever waits (once per piece)
    s.waiting_queue = [after, other]
    assert run(h, s).batch_to_run == [long, after, other] and s.passes[-1] == (long, [after, other])
    # the piece done (the chunked request has computed more): the next one may be preceded again
    long.prefix_len = 1024
    s.waiting_queue = [after]
    assert run(h, s).batch_to_run == [after] and s.chunked_req is long
    assert rt.events.counts["prefill_ahead_of_chunks"] == 2


@pytest.mark.parametrize("case", ["no chunked request", "not next in line", "does not prefill alone",
                                  "longer than one chunk", "mixed chunks"])
def test_every_other_pass_is_sglangs(case):
    h, rt = hook()
    long, mine, other = req("long", 5000), req("mine", alone=True), req("other")
    s = {"no chunked request": Scheduler(None, [mine, other]),
         "not next in line": Scheduler(long, [other, mine]),
         "does not prefill alone": Scheduler(long, [other]),
         "longer than one chunk": Scheduler(long, [req("big", 1025, alone=True)]),
         "mixed chunks": Scheduler(long, [mine])}[case]
    s.is_mixed_chunk = case == "mixed chunks"
    queue = list(s.waiting_queue)
    run(h, s)
    assert s.passes == [(s.chunked_req, queue)] and rt.events.counts["prefill_ahead_of_chunks"] == 0


def test_a_request_the_pass_does_not_admit_leaves_the_piece_to_run_in_the_same_pass():
    h, rt = hook()
    long, mine, other = req("long", 5000), req("mine", alone=True), req("other")
    s = Scheduler(long, [mine, other], admit=lambda r: r is not mine)  # (no room for it)
    plan = run(h, s)
    assert s.passes == [(None, [mine]), (long, [mine, other])]  # then SGLang's pass, as it was
    assert plan.batch_to_run == [long, other] and s.waiting_queue == [mine] and s.chunked_req is long
    assert rt.events.counts["prefill_ahead_of_chunks"] == 0
    run(h, s)
    assert s.passes[-1] == (long, [mine])  # (its piece was set aside once: not again)


def test_requests_the_pass_preempts_are_kept_in_the_queue():
    h, _ = hook()
    long, mine, other, preempted = req("long", 5000), req("mine", alone=True), req("other"), req("preempted")
    s = Scheduler(long, [mine, other], requeue=[preempted])
    run(h, s)
    assert s.waiting_queue == [other, preempted] and s.chunked_req is long


def test_a_failing_check_is_counted_and_sglang_schedules():
    rt = Rt()

    def broken(r):
        raise RuntimeError("boom")

    h = AheadOfChunks(rt, broken)
    long, mine = req("long", 5000), req("mine", alone=True)
    s = Scheduler(long, [mine])
    assert run(h, s).batch_to_run == [long, mine]
    assert rt.events.counts["hook_errors"] == 1 and s.chunked_req is long


def test_off_keeps_sglangs_order_and_registers_nothing(monkeypatch):
    registered = []
    hooks = NS(HookRegistry=NS(register=lambda *a: registered.append(a)), HookType=NS(AROUND="around"))
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins.hook_registry", hooks)
    rt = Rt()
    off, on = AheadOfChunks(rt, lambda r: r.alone, on=False), AheadOfChunks(rt, lambda r: r.alone)
    long, mine = req("long", 5000), req("mine", alone=True)
    s = Scheduler(long, [mine])
    assert not off.would_go(s, mine) and on.would_go(s, mine)  # the same case
    off.register()
    assert registered == []
    on.register()
    assert [a[0] for a in registered] == ["sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill"]


@pytest.mark.parametrize("flag", ["on", "off"])
def test_the_servers_flag_reaches_the_forward_hook(monkeypatch, flag):
    from sglang_tiered.config import TieredConfig
    from sglang_tiered.integration import settings
    from sglang_tiered.integration.model_forward import ForwardHook
    from sglang_tiered.integration.runtime import Runtime

    published = settings.Settings(config=TieredConfig(ahead_of_chunks=flag), model="m", model_path="m", cpu_only=True)
    monkeypatch.setenv(settings.ENV, published.to_json())
    assert ForwardHook(Runtime()).ahead.on is (flag == "on")
