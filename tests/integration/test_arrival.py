"""integration/arrival.py's decision in the launcher, with SGLang's own page keys and real files (no server).

Reads at arrival start only while a scheduler marks a prefill forward on the board, for a request our loader may
read (not `tiered_kvpr` 'off' or 'compute', not a prompt to blend), whose stored run holds at least
`--tiered-kvpr-min-tokens`, under `--tiered-kvpr-arrival-reads on`; the job stops at that forward's end; a failure
inside the decision is logged and the request goes on unmarked. The live server side (a request sent during
another's prefill forward) is in test_meet_load.py.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from types import SimpleNamespace as NS

import pytest

pytestmark = pytest.mark.sglang

PAGE = 64
PAGES = 4
IDS = list(range(1000, 1000 + PAGES * PAGE + 9))  # four whole pages and a bit


class Counts:
    """A stand-in for the process's `Events`, keeping what was counted."""

    def __init__(self) -> None:
        self.seen: dict[str, float] = {}
        self.done = threading.Event()

    def count(self, event: str, value: float = 1) -> None:
        if value <= 0:  # as Events: nothing counted
            return
        self.seen[event] = self.seen.get(event, 0) + value
        if event == "kvpr_arrival_reads":
            self.done.set()


@pytest.fixture
def server(tmp_path, monkeypatch):
    """A launcher's view of a server: settings published, a zeroed forward board, one rank's namespace directory
    (its SERVER file names this process) holding IDS's pages; returns a function making an `Arrival` under the
    given flags, with the board and the page files."""
    from sglang_tiered.config import TieredConfig
    from sglang_tiered.integration import settings
    from sglang_tiered.integration.arrival import Arrival
    from sglang_tiered.integration.keys import prompt_page_keys
    from sglang_tiered.integration.runtime import Runtime
    from sglang_tiered.storage.forward_board import ForwardBoard
    from sglang_tiered.storage.ssd_tier import SERVER_FILE, page_path

    ssd = tmp_path / "ssd"
    rank = ssd / "ns-rank0"
    rank.mkdir(parents=True)
    (rank / SERVER_FILE).write_text(f"{os.getpid()}\n")
    files = []
    for key in prompt_page_keys(IDS, None, None, len(IDS) - 1, PAGE):
        path = page_path(rank, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"kv" * 4096)
        files.append(path)
    ForwardBoard.create(ssd)
    board = ForwardBoard.open(ssd)

    def make(**flags) -> Arrival:
        config = TieredConfig(**{"ssd_dir": str(ssd), "kvpr": "auto", "kvpr_min_tokens": PAGE, **flags})
        published = settings.Settings(config=config, model="m", model_path="m", cpu_only=True)
        monkeypatch.setenv(settings.ENV, published.to_json())
        rt = Runtime()
        rt.events = Counts()
        return Arrival(rt)

    return NS(make=make, board=board, files=files)


def launcher(states: dict | None = None):
    """The TokenizerManager's parts arrival.py reads: the page size and the requests' states."""
    return NS(server_args=NS(page_size=PAGE), rid_to_state={} if states is None else states)


def request(rid: str = "r1", ids=IDS, **custom):
    return NS(rid=rid, input_ids=list(ids), extra_key=None, cache_salt=None, lora_id=None,
              sampling_params=NS(custom_params=dict(custom) or None))


def waiting():
    """A request's state while it waits for its first token."""
    return NS(finished=False, time_stats=NS(first_token_time=0))


def started(arrival) -> list:
    """The names of the jobs `arrival` starts from now on (started as before)."""
    names, real = [], arrival.reads.start

    def start(name, paths, stop):
        names.append(name)
        real(name, paths, stop)

    arrival.reads.start = start
    return names


def marked(obj) -> bool:
    from sglang_tiered.integration.requests import ARRIVAL_PARAM

    return bool((obj.sampling_params.custom_params or {}).get(ARRIVAL_PARAM))


def test_a_request_sent_during_a_prefill_forward_has_its_stored_run_read(server):
    arrival = server.make()
    server.board.begin(0)
    obj = request()
    arrival.before_send(launcher({"r1": waiting()}), obj)
    assert marked(obj)  # its load will be no sample of the disk
    counts = arrival.rt.events
    assert counts.done.wait(30)
    assert counts.seen == {"kvpr_arrival_reads": 1, "kvpr_arrival_bytes": sum(p.stat().st_size for p in server.files)}


@pytest.mark.parametrize("case", ["flag off", "kvpr off", "kvpr compute", "blend prompt", "no forward running",
                                  "the forward ended", "run shorter than min tokens", "nothing stored"])
def test_no_reads_where_they_could_not_help(server, case):
    arrival = server.make(kvpr_arrival_reads="off" if case == "flag off" else "on",
                          **({"kvpr_min_tokens": PAGE * PAGES + 1} if case == "run shorter than min tokens" else {}))
    if case != "no forward running":
        server.board.begin(0)
    if case == "the forward ended":
        server.board.end(0)
    custom = {"kvpr off": {"tiered_kvpr": "off"}, "kvpr compute": {"tiered_kvpr": "compute"},
              "blend prompt": {"tiered_chunks": [PAGE, PAGE]}}.get(case, {})
    obj = request(ids=[7] * len(IDS) if case == "nothing stored" else IDS, **custom)
    jobs = started(arrival)
    arrival.before_send(launcher({"r1": waiting()}), obj)
    assert not marked(obj) and jobs == []


def test_the_job_stops_when_that_forward_ends(server):
    """`stop` is asked before each file: once the marked forward ended on the board, the job ends with files left
    (the scheduler takes the request in and reads the rest itself)."""
    arrival = server.make()
    server.board.begin(0)
    obj = request()
    asked = queue.Queue()
    gate = threading.Event()
    real = arrival.reads.start

    def start(name, paths, stop):  # hold the job at its first question until the forward has ended
        def held() -> bool:
            asked.put(True)
            gate.wait(30)
            return stop()
        real(name, paths, held)

    arrival.reads.start = start
    arrival.before_send(launcher({"r1": waiting()}), obj)
    assert asked.get(timeout=30)
    server.board.end(0)
    gate.set()
    counts = arrival.rt.events
    assert counts.done.wait(30)
    assert counts.seen["kvpr_arrival_stopped"] == 1 and "kvpr_arrival_bytes" not in counts.seen


def test_the_job_stops_when_the_request_has_its_first_token_or_is_gone(server):
    arrival = server.make()
    server.board.begin(0)
    for rid, states in (("first-token", {"first-token": NS(finished=False, time_stats=NS(first_token_time=1.0))}),
                        ("gone", {})):
        arrival.rt.events = counts = Counts()
        arrival.before_send(launcher(states), request(rid))
        assert counts.done.wait(30)
        assert counts.seen == {"kvpr_arrival_reads": 1, "kvpr_arrival_stopped": 1}


def test_a_failure_in_the_decision_is_logged_and_the_request_goes_on_unmarked(server, caplog):
    arrival = server.make()
    server.board.begin(0)
    obj = request()
    broken = NS(rid_to_state={})  # no server_args: the page size cannot be read
    jobs = started(arrival)
    with caplog.at_level(logging.ERROR, logger="sglang_tiered"):
        assert arrival.before_send(broken, obj) is None
    assert "reads at arrival failed for rid r1" in caplog.text
    assert not marked(obj) and jobs == []
    arrival.before_send(launcher({"r1": waiting()}), obj)  # the next request is served as before
    assert marked(obj) and jobs == ["r1"] and arrival.rt.events.done.wait(30)
