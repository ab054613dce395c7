"""`MooncakeStore`: the `RemoteStore` contract (remote.py) on Mooncake Store over TCP.

Each server is a Mooncake client that also contributes `segment_bytes` of its memory to the shared pool (Mooncake
places objects in any client's segment), so the pool's size is the sum of the servers' segments; objects in a server's
segment leave with that server. `mooncake_master --enable_http_metadata_server=true` runs the master and the
metadata server in one process.

Measured on Mooncake 0.3.13 (mooncake-transfer-engine-non-cuda): with the master down `setup` blocks about 90 s and
then fails, so `connect` first probes the master's port (1 s timeout) and fails fast; a connected client's calls fail
at once while the master is down (-900) and work again a few seconds after it is back (the client re-mounts its
segment by itself; objects stored before the restart are gone with the master's metadata).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional
from urllib.parse import urlparse

from sglang_tiered.storage.remote import RemoteError

SCHEME = "mooncake"
DEFAULT_METADATA_PORT = 8080  # mooncake_master's --http_metadata_server_port default
# Mooncake's NO_AVAILABLE_HANDLE: no segment has room for the object now. Measured on 0.3.13: puts faster than the
# master's eviction (it frees 5 % of the pool past a 90 % watermark, in the background) get it while the master answers.
NO_ROOM = -200


@dataclass(frozen=True)
class MooncakeAddress:
    """Where the shared store lives: the master's RPC address and the metadata server's URL."""

    host: str
    port: int
    metadata: str

    @classmethod
    def parse(cls, url: str, metadata: str = "") -> MooncakeAddress:
        """`mooncake://HOST:PORT` (the master's RPC port). Raises ValueError with the reason."""
        parsed = urlparse(url)
        if parsed.scheme != SCHEME or not parsed.hostname or parsed.path not in ("", "/"):
            raise ValueError(f"expected {SCHEME}://HOST:PORT (the mooncake_master RPC address), got {url!r}")
        try:
            port = parsed.port
        except ValueError:
            port = None
        if not port:
            raise ValueError(f"no valid port in {url!r} (mooncake_master listens on --rpc_port, default 50051)")
        metadata = metadata or f"http://{parsed.hostname}:{DEFAULT_METADATA_PORT}/metadata"
        if not metadata.startswith(("http://", "https://")):
            raise ValueError(f"the metadata server is an http:// URL (…/metadata), got {metadata!r}")
        return cls(parsed.hostname, port, metadata)

    @property
    def master(self) -> str:
        return f"{self.host}:{self.port}"

    def local_address(self) -> str:
        """This machine's address on the route to the master (what other clients connect to for our segment)."""
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((self.host, self.port))
                return s.getsockname()[0]
            except OSError:
                return "127.0.0.1"

    def reachable(self, timeout: float = 1.0) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=timeout):
                return True
        except OSError:
            return False


def _with_port(host: str) -> str:
    """`host:port` for this client's transfer endpoint: a free port unless one is given. (Without a port Mooncake
    0.3.13 picks one itself, and two servers started at the same moment were seen picking the same one: the second
    server's segment then shadows the first's and its transfers fail.)"""
    if ":" in host:
        return host
    with socket.socket() as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


def import_client():
    """Mooncake's client class; ImportError with what to install when it is missing."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise ImportError(
            f"Mooncake Store is not usable ({exc}): pip install mooncake-transfer-engine-non-cuda, and on Debian "
            "apt-get install libibverbs1 librdmacm1 (needed even over TCP)"
        ) from exc
    return MooncakeDistributedStore


class MooncakeStore:
    def __init__(self, address: MooncakeAddress, *, segment_bytes: int, object_bytes: int, buffer_objects: int = 8,
                 local_host: str = "") -> None:
        """Connects now. Raises RemoteError (master unreachable, setup refused) or ImportError (not installed).
        `object_bytes`: the largest object put or got; this client's transfer buffer holds `buffer_objects` of them
        (every object of one batched get must fit in it at once: `get_many` splits larger batches)."""
        self.object_bytes, self.batch = int(object_bytes), max(1, buffer_objects // 2)
        buffer_bytes = 4 * 1024**2 + buffer_objects * self.object_bytes
        client = import_client()
        if not address.reachable():
            raise RemoteError(f"mooncake master {address.master} is not reachable")
        self.address = address
        self.local = _with_port(local_host or address.local_address())
        self._store = client()
        rc = self._store.setup(self.local, address.metadata, int(segment_bytes), int(buffer_bytes), "tcp", "",
                               address.master)
        if rc != 0:
            raise RemoteError(f"mooncake setup with master {address.master} failed (code {rc})")

    def put(self, key: str, blob: bytes) -> None:
        rc = self._store.put(key, blob)
        if rc == NO_ROOM:
            raise RemoteError(f"mooncake has no room for the object now (code {rc}: it evicts past its watermark; "
                              "more or larger --tiered-remote-segment give it more)")
        if rc != 0:
            raise RemoteError(f"mooncake put failed (code {rc})")

    def get(self, key: str) -> Optional[bytes]:
        # Mooncake's get answers b"" for a missing object and for a failed transfer alike; `exists` tells them apart
        # where it matters (RemoteTier asks it first).
        blob = self._store.get(key)
        return bytes(blob) if blob else None

    def get_many(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        # One batch must fit in the transfer buffer at once (beyond it Mooncake answers b"" for the rest), and a
        # concurrent put needs room too: at most half the buffer per batch.
        keys = list(keys)
        out: list[Optional[bytes]] = []
        for i in range(0, len(keys), self.batch):
            out.extend(bytes(b) if b else None for b in self._store.get_batch(keys[i : i + self.batch]))
        return out

    def exists(self, keys: Sequence[str]) -> list[bool]:
        codes = self._store.batch_is_exist(list(keys))
        if any(c < 0 for c in codes):
            raise RemoteError(f"mooncake is_exist failed (code {min(codes)})")
        return [c == 1 for c in codes]

    def close(self) -> None:
        try:
            self._store.close()
        except Exception:  # closing a client whose master is gone may fail; nothing is left to release
            pass
