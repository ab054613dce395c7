"""storage/arrival_reads.py: a request's stored files read into the page cache from its arrival, the last first, until
told to stop (real files, the kernel's page cache; no SGLang)."""

from __future__ import annotations

import os
import queue
import threading

import pytest

from sglang_tiered.storage import page_cache
from sglang_tiered.storage.arrival_reads import ArrivalRead, ArrivalReads
from tests.page_cache import drop_from_page_cache

SIZE = 3 * (1 << 20) + 12345  # more than the buffer: a file is read in several pieces


def cold_files(directory, n: int) -> list:
    """`n` files of SIZE bytes under `directory`, written, synced and dropped from the page cache."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        path = directory / f"{i:02d}.kvp"
        path.write_bytes(bytes([i]) * SIZE)
        drop_from_page_cache(path)
        paths.append(path)
    return paths


def resident(path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        return page_cache.resident(fd, range(0, SIZE, 4096))
    finally:
        os.close(fd)


@pytest.fixture
def done():
    return queue.Queue()


def test_a_job_reads_every_file_into_the_page_cache(tmp_path, done):
    paths = cold_files(tmp_path, 4)
    assert not any(resident(p) for p in paths)
    reads = ArrivalReads(done.put)
    reads.start("r1", paths, stop=lambda: False)
    read = done.get(timeout=30)
    assert read == ArrivalRead("r1", 4, 4 * SIZE, read.seconds, 0, 0) and read.seconds > 0
    assert all(resident(p) for p in paths)


def test_the_last_page_is_read_first_and_a_stop_leaves_the_front_unread(tmp_path, done):
    """`stop` is asked before every file: once it says so, the job ends and the files nearest the front (those
    compute reaches first) stay where they were."""
    paths = cold_files(tmp_path, 5)
    asked = []

    def stop() -> bool:
        asked.append(sum(resident(p) for p in paths))
        return len(asked) > 2  # two files read, then stopped

    reads = ArrivalReads(done.put)
    reads.start("r2", paths, stop)
    read = done.get(timeout=30)
    assert (read.files, read.left, read.nbytes, read.missing) == (2, 3, 2 * SIZE, 0)
    assert asked == [0, 1, 2]
    assert [resident(p) for p in paths] == [False, False, False, True, True]


def test_a_file_gone_before_its_turn_is_counted_and_skipped(tmp_path, done):
    paths = cold_files(tmp_path, 3)
    paths[1].unlink()
    reads = ArrivalReads(done.put)
    reads.start("r3", paths, stop=lambda: False)
    read = done.get(timeout=30)
    assert (read.files, read.missing, read.left, read.nbytes) == (2, 1, 0, 2 * SIZE)


def test_jobs_run_in_the_order_they_arrived_and_a_failing_stop_ends_only_its_job(tmp_path, done):
    """The scheduler serves requests first come first served: the first job's reads come first. A job whose `stop`
    raises is logged and dropped; the thread goes on with the next."""
    first, second, third = cold_files(tmp_path / "a", 2), cold_files(tmp_path / "b", 2), cold_files(tmp_path / "c", 1)
    gate = threading.Event()

    def held() -> bool:
        gate.wait(30)  # the first job holds the thread until the others are queued
        return False

    def broken() -> bool:
        raise RuntimeError("a stop that fails")

    reads = ArrivalReads(done.put)
    reads.start("first", first, held)
    reads.start("broken", second, broken)
    reads.start("third", third, lambda: False)
    assert reads.queued() >= 2
    gate.set()
    names = [done.get(timeout=30).name for _ in range(2)]
    assert names == ["first", "third"]
    assert not any(resident(p) for p in second) and all(resident(p) for p in first + third)


def test_the_launcher_finds_its_ranks_directories_and_each_ranks_leading_run(tmp_path):
    """integration/arrival.py's file side: the namespace directories whose SERVER file holds the launcher's pid (not
    another server's, not one without the file), and per rank the leading run of stored page files, page by page
    from the front, as far as each rank stored them."""
    from sglang_tiered.integration.arrival import served_dirs, stored_run
    from sglang_tiered.storage.ssd_tier import SERVER_FILE, page_path

    keys = [f"{i:02x}" + "ab" * 31 for i in range(6)]
    ranks = [tmp_path / "ns-rank0", tmp_path / "ns-rank1"]
    other = tmp_path / "ns-other"
    for d, stored in ((ranks[0], range(4)), (ranks[1], (0, 1, 3)), (other, range(6))):
        for i in stored:
            path = page_path(d, keys[i])
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"x")
    for d in ranks:
        (d / SERVER_FILE).write_text("4242\n")
    (other / SERVER_FILE).write_text("999\n")
    (tmp_path / "ns-unserved").mkdir()
    assert served_dirs(tmp_path, 4242) == ranks
    assert served_dirs(tmp_path / "missing", 4242) == []
    pages, paths = stored_run(ranks, keys)
    assert pages == 4  # rank 0 holds pages 0-3; rank 1 only 0-1 in a row (page 2 missing)
    assert paths == [page_path(ranks[0], keys[0]), page_path(ranks[1], keys[0]), page_path(ranks[0], keys[1]),
                     page_path(ranks[1], keys[1]), page_path(ranks[0], keys[2]), page_path(ranks[0], keys[3])]
    assert stored_run([], keys) == (0, [])


def test_the_forward_board_shows_another_process_s_extend_forward(tmp_path):
    """storage/forward_board.py: what a scheduler process marks on its slot, the launcher's process reads -- running
    while its forward runs, one more ended after it; none without a board of the right size."""
    import subprocess
    import sys

    from sglang_tiered.storage.forward_board import BOARD_FILE, ForwardBoard

    assert ForwardBoard.open(tmp_path) is None
    (tmp_path / BOARD_FILE).write_bytes(b"\0" * 10)
    assert ForwardBoard.open(tmp_path) is None
    ForwardBoard.create(tmp_path)
    board = ForwardBoard.open(tmp_path)
    assert board is not None and not board.running() and board.ended() == 0
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfrom sglang_tiered.storage.forward_board import ForwardBoard\n"
         f"b = ForwardBoard.open({str(tmp_path)!r})\nb.begin(3)\nprint('began', flush=True)\nsys.stdin.readline()\n"
         "b.end(3)\nb.begin(65)\nb.end(65)\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert child.stdout.readline().strip() == "began"
        assert board.running() and board.ended() == 0
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(timeout=30) == 0
    finally:
        if child.poll() is None:
            child.kill()
    assert not board.running() and board.ended() == 2  # slot 65 is slot 1: each slot its own count
    ForwardBoard.create(tmp_path)  # a new server's launcher: zeroed
    assert ForwardBoard.open(tmp_path).ended() == 0
