"""Whether a scheduler runs a prefill (extend) forward now, told to the launcher through one small shared file.

SGLang's scheduler takes in new requests only between forwards. The launcher, which sends them, cannot see whether
one runs: `ForwardBoard` is a file of SLOTS slots at `<ssd_dir>/forwards.board` (a file of the whole server, counted
against the capacity with the root's others, storage/ssd_tier.ROOT_FILES), mapped shared by every process of the
server. Each scheduler rank writes its own slot -- `running` (1 while an extend forward runs) and `ended` (extend
forwards ended so far), two little-endian u64 -- and the launcher reads them (integration/arrival.py). One writer per
slot; an aligned 8-byte store is seen whole.

The launcher creates the file, zeroed, before it starts the schedulers (`create`); a rank that finds no file writes
nothing (`open` returns None). No SGLang here.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import Optional

from sglang_tiered.storage.files import write_atomic

BOARD_FILE = "forwards.board"
SLOTS = 64  # scheduler ranks a board holds (a rank's slot: its index modulo SLOTS)
_SLOT = struct.Struct("<QQ")  # running, ended


class ForwardBoard:
    def __init__(self, mapping: mmap.mmap) -> None:
        self._map = mapping

    @staticmethod
    def create(ssd_dir: str | os.PathLike) -> None:
        """Write a zeroed board under `ssd_dir` (the launcher, before its schedulers start)."""
        write_atomic(Path(ssd_dir) / BOARD_FILE, bytes(SLOTS * _SLOT.size))

    @classmethod
    def open(cls, ssd_dir: str | os.PathLike) -> Optional[ForwardBoard]:
        """The board under `ssd_dir`, mapped shared; None where there is none of the right size."""
        try:
            fd = os.open(Path(ssd_dir) / BOARD_FILE, os.O_RDWR)
        except OSError:
            return None
        try:
            if os.fstat(fd).st_size != SLOTS * _SLOT.size:
                return None
            return cls(mmap.mmap(fd, SLOTS * _SLOT.size, mmap.MAP_SHARED))
        finally:
            os.close(fd)

    def begin(self, slot: int) -> None:
        """Rank `slot` starts an extend forward."""
        _, ended = self._read(slot)
        _SLOT.pack_into(self._map, (slot % SLOTS) * _SLOT.size, 1, ended)

    def end(self, slot: int) -> None:
        """Rank `slot`'s extend forward ended."""
        _, ended = self._read(slot)
        _SLOT.pack_into(self._map, (slot % SLOTS) * _SLOT.size, 0, ended + 1)

    def running(self) -> bool:
        """Whether any rank runs an extend forward now."""
        return any(self._read(i)[0] for i in range(SLOTS))

    def ended(self) -> int:
        """Extend forwards ended so far, every rank's together."""
        return sum(self._read(i)[1] for i in range(SLOTS))

    def _read(self, slot: int) -> tuple[int, int]:
        return _SLOT.unpack_from(self._map, (slot % SLOTS) * _SLOT.size)
