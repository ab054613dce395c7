"""Failure paths that need a second process: a writer killed mid-stream, and a file-size limit (disk full)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from sglang_tiered.storage.page_file import PAGE_SUFFIX
from sglang_tiered.storage.ssd_tier import SSDTier, check_integrity

from .test_ssd_tier import PAGE, empty, joined, key, ns, page

WRITER = textwrap.dedent(
    """
    import sys, resource, signal
    sys.path.insert(0, {root!r})
    from tests.unit.test_ssd_tier import key, ns, page
    from sglang_tiered.storage.ssd_tier import SSDTier
    limit = {fsize_limit}
    if limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG, like a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    tier = SSDTier(sys.argv[1], ns(), capacity_bytes=10**9, io_threads=4)
    for i in range({count}):
        tier.write_pages([(key(i * 4 + j), page(i * 4 + j)) for j in range(4)])
        print(i, flush=True)
    print("stats", tier.stats.snapshot()["io_errors"], tier.stats.snapshot()["written_pages"], flush=True)
    """
)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_writer(tmp_path, count: int, fsize_limit: int = 0) -> subprocess.Popen:
    code = WRITER.format(root=ROOT, count=count, fsize_limit=fsize_limit)
    return subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)


def test_writer_killed_mid_stream_leaves_only_whole_pages(tmp_path):
    proc = start_writer(tmp_path, count=100_000)
    try:
        for _ in range(30):  # let it write a while
            assert proc.stdout.readline()
        time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    tier = SSDTier(tmp_path, ns(), capacity_bytes=10**9)
    assert len(tier) >= 4 * 30
    assert not list(tier.dir.rglob("*.tmp"))  # interrupted writes cleaned up on start
    check_integrity(tier)
    keys = sorted(p.name[: -len(PAGE_SUFFIX)] for p in tier.dir.rglob(f"*{PAGE_SUFFIX}"))
    wanted = {key(i): i for i in range(len(keys) + 8)}
    reads = [(k, empty()) for k in keys]
    assert tier.read_pages(reads) == [True] * len(keys)  # every visible page is complete and verified
    for k, segs in reads:
        assert joined(segs) == joined(page(wanted[k]))
    assert tier.stats.snapshot()["corrupt_pages"] == 0


def test_file_size_limit_counts_io_errors_and_keeps_going(tmp_path):
    proc = start_writer(tmp_path, count=5, fsize_limit=PAGE // 2)  # no page fits: every write fails
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    _, io_errors, written = out.strip().splitlines()[-1].split()
    assert int(io_errors) == 20 and int(written) == 0
    tier = SSDTier(tmp_path, ns(), capacity_bytes=10**9)
    assert len(tier) == 0 and not list(tier.dir.rglob("*.tmp"))
