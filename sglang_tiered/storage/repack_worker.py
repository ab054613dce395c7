"""Group files built in a child process (`groups.build_group`: the probe's rotation and quantization, the chunk
layout, checksums, the write), so that a repack in a server neither holds the scheduler's GIL nor competes with a
forward for a core: the child runs at the lowest CPU priority with one BLAS thread, and the OS gives the cores to
the forward first. Numpy and files only, no torch, no SGLang.

Protocol (one request at a time, over the child's stdin and stdout): the parent writes an 8-byte length, a pickled
header (the path, the namespace, the page keys, each payload's length, the probe heads, chunk and bits), then the
payloads' raw bytes; the child answers with an 8-byte length and a pickled (True, bytes written) or (False, error).

Contracts
* `build` has `groups.build_group`'s contract: the group file written atomically at `path`, its size returned, or
  OSError (the child's error, or the child gone) with no file at `path` left by this call (nor the temporary file
  of a write the child did not finish).
* A child that died (killed, crashed) is started again at the next `build`; the child exits when its stdin closes,
  so it never outlives its parent, and runs in the parent's process group (stopping the server stops it).
* Thread-safe: concurrent `build` calls are served one after the other.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import BinaryIO, Optional

from sglang_tiered.storage.namespace import Namespace
from sglang_tiered.storage.page_file import TMP_SUFFIX

_LEN = struct.Struct("<Q")
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class RepackWorker:
    """The parent's handle on the child process."""

    def __init__(self) -> None:
        self._proc: Optional[subprocess.Popen] = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    def build(self, path: str, ns: Namespace, keys: Sequence[str], payloads: Sequence[bytes],
              probe_heads: Sequence[int], chunk: int, probe_bits: int) -> int:
        header = pickle.dumps((path, ns, list(keys), [len(p) for p in payloads], [int(h) for h in probe_heads],
                               chunk, probe_bits))
        with self._lock:
            proc = self._started()
            try:
                _write_all(proc.stdin.fileno(), [memoryview(_LEN.pack(len(header))), memoryview(header),
                                                 *(memoryview(p) for p in payloads)])
                ok, value = pickle.loads(_read_message(proc.stdout))
            except (OSError, EOFError, pickle.UnpicklingError) as exc:
                self._stop()
                for leftover in glob.glob(f"{glob.escape(path)}.*{TMP_SUFFIX}"):  # a write the child did not finish
                    with contextlib.suppress(OSError):
                        os.unlink(leftover)
                raise OSError(f"repack worker gone: {exc}") from exc
        if not ok:
            raise OSError(value)
        return int(value)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the child. A build still running after `timeout` seconds has its child killed (it raises OSError)."""
        if not self._lock.acquire(timeout=timeout):
            proc = self._proc
            if proc is not None:
                proc.kill()
            self._lock.acquire()
        try:
            self._stop()
        finally:
            self._lock.release()

    def _started(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            env = {**os.environ, **ONE_THREAD}
            self._proc = subprocess.Popen([sys.executable, "-m", "sglang_tiered.storage.repack_worker"],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        return self._proc

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _write_all(fd: int, bufs: list[memoryview]) -> None:
    for buf in bufs:
        buf = buf.cast("B")
        while buf.nbytes:
            buf = buf[os.write(fd, buf) :]


def _read_exact(stream: BinaryIO, n: int) -> bytearray:
    out = bytearray(n)
    view, done = memoryview(out), 0
    while done < n:
        got = stream.readinto(view[done:])
        if not got:
            raise EOFError(f"stream closed after {done} of {n} bytes")
        done += got
    return out


def _read_message(stream: BinaryIO) -> bytes:
    (n,) = _LEN.unpack(_read_exact(stream, _LEN.size))
    return bytes(_read_exact(stream, n))


def main() -> int:
    """The child: serve build requests until stdin closes."""
    os.nice(19)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # an interrupted server stops it by closing its stdin
    from sglang_tiered.storage.groups import build_group  # numpy after the one-thread environment is set

    inp, out = sys.stdin.buffer.raw, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to the server's log, never into the replies
    while True:
        try:
            path, ns, keys, sizes, heads, chunk, bits = pickle.loads(_read_message(inp))
            payloads = [_read_exact(inp, n) for n in sizes]
        except EOFError:
            return 0
        try:
            reply = (True, build_group(path, ns, keys, payloads, heads, chunk, bits))
        except Exception as exc:  # the parent counts it; the child serves the next request
            reply = (False, f"{type(exc).__name__}: {exc}")
        body = pickle.dumps(reply)
        out.write(_LEN.pack(len(body)) + body)
        out.flush()


if __name__ == "__main__":
    sys.exit(main())
