"""The repack worker (a real child process, real files, no SGLang): it writes the same group file as the in-process
build, runs at the lowest CPU priority, reports a failed build as OSError and serves the next one, is started
again after it was killed, stops a build still running when closed, and a tier repacks through it."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time

import pytest

from sglang_tiered.storage import group_file
from sglang_tiered.storage.groups import build_group
from sglang_tiered.storage.namespace import Namespace
from sglang_tiered.storage.page_file import PAGE_SUFFIX
from sglang_tiered.storage.repack_worker import RepackWorker
from sglang_tiered.storage.ssd_tier import SSDTier
from tests.unit.test_groups import bf16_page, joined, key, ns


def payloads(n: int) -> list[bytes]:
    return [joined(bf16_page(i)) for i in range(n)]


def sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture
def worker():
    w = RepackWorker()
    yield w
    w.close()


def test_the_child_writes_the_in_process_build_byte_for_byte(tmp_path, worker):
    keys, data = [key(i) for i in range(5)], payloads(5)
    here = build_group(str(tmp_path / "here.kvg"), ns(), keys, data, [0, 1], 16, 4)
    there = worker.build(str(tmp_path / "there.kvg"), ns(), keys, data, [0, 1], 16, 4)
    assert here == there == os.path.getsize(tmp_path / "there.kvg")
    assert sha(tmp_path / "here.kvg") == sha(tmp_path / "there.kvg")
    assert os.getpriority(os.PRIO_PROCESS, worker.pid) == 19


def test_a_failed_build_is_an_oserror_and_the_child_serves_the_next(tmp_path, worker):
    keys, data = [key(i) for i in range(2)], payloads(2)
    with pytest.raises(OSError, match="No such file or directory"):
        worker.build(str(tmp_path / "missing" / "g.kvg"), ns(), keys, data, [0], 16, 4)
    with pytest.raises(OSError, match="ValueError"):  # a payload of the wrong size
        worker.build(str(tmp_path / "short.kvg"), ns(), keys, [data[0], data[1][:-2]], [0], 16, 4)
    assert not (tmp_path / "short.kvg").exists() and not list(tmp_path.glob("*.tmp*"))
    pid = worker.pid
    assert worker.build(str(tmp_path / "g.kvg"), ns(), keys, data, [0], 16, 4) > 0
    assert worker.pid == pid


def test_a_killed_child_is_started_again(tmp_path, worker):
    keys, data = [key(i) for i in range(2)], payloads(2)
    worker.build(str(tmp_path / "a.kvg"), ns(), keys, data, [0], 16, 4)
    first = worker.pid
    os.kill(first, signal.SIGKILL)
    time.sleep(0.2)
    assert worker.build(str(tmp_path / "b.kvg"), ns(), keys, data, [0], 16, 4) > 0
    assert worker.pid not in (None, first)


def test_the_child_exits_when_closed(tmp_path):
    w = RepackWorker()
    w.build(str(tmp_path / "a.kvg"), ns(), [key(0)], payloads(1), [0], 16, 4)
    pid = w.pid
    w.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_tier_repacks_through_the_worker(tmp_path, worker):
    tier = SSDTier(tmp_path, ns(), 1 << 24)
    keys = [key(i) for i in range(4)]
    assert all(tier.write_pages([(k, bf16_page(i)) for i, k in enumerate(keys)]))
    assert tier.groups.repack(keys, [0, 1], build=worker.build)
    meta = tier.group_of(keys[0])
    assert meta is not None and meta.keys == tuple(keys)
    assert [p.name for p in tmp_path.rglob(f"*{group_file.GROUP_SUFFIX}")] == [f"{meta.gid}{group_file.GROUP_SUFFIX}"]
    assert not list(tmp_path.rglob(f"*{PAGE_SUFFIX}"))  # the member pages' files are gone
    tier.close()


def test_close_stops_a_build_still_running(tmp_path):
    big = Namespace(model="m:1", dtype="torch.bfloat16", page_size=64, layout="layer_first", layer_num=30,
                    kv_heads=3, head_dim=64)
    page = bytes(2 * 30 * 64 * 3 * 64 * 2)
    w = RepackWorker()
    errors: list[BaseException] = []

    def build() -> None:
        try:
            w.build(str(tmp_path / "big.kvg"), big, [key(i) for i in range(128)], [page] * 128, [0, 1, 2], 16, 4)
        except OSError as exc:
            errors.append(exc)

    thread = threading.Thread(target=build)
    thread.start()
    time.sleep(0.3)  # the request is being sent or built: 188 MB at the lowest priority
    pid = w.pid
    w.close(timeout=0.01)
    thread.join(10)
    assert not thread.is_alive() and len(errors) == 1 and "repack worker gone" in str(errors[0])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert list(tmp_path.iterdir()) == []  # neither the group nor the temporary file of its write
