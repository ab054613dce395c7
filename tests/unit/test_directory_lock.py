"""One server per SSD directory: the claim is exclusive across processes and dies with its holder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from sglang_tiered.storage.directory_lock import LOCK_FILE, DirectoryInUse, claim

TRY = "import sys; from sglang_tiered.storage.directory_lock import claim; claim(sys.argv[1]); print('claimed')"


def try_claim(root) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", TRY, str(root)], capture_output=True, text=True, timeout=60)


def test_a_second_process_cannot_claim_a_claimed_directory(tmp_path):
    fd = claim(tmp_path)
    try:
        assert (tmp_path / LOCK_FILE).read_text().strip() == str(os.getpid())
        other = try_claim(tmp_path)
        assert other.returncode != 0 and f"in use by another server (pid {os.getpid()})" in other.stderr
    finally:
        os.close(fd)
    assert try_claim(tmp_path).stdout.strip() == "claimed"  # given up: free again


def test_a_killed_holder_leaves_no_claim(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", TRY + "; import time; sys.stdout.flush(); time.sleep(60)",
                               str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "claimed"
        with pytest.raises(DirectoryInUse) as exc:
            claim(tmp_path)
        assert exc.value.holder == str(holder.pid)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    os.close(claim(tmp_path))
