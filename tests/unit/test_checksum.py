"""The store's checksum is zlib's crc32, value for value: files written with either read with the other."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

from sglang_tiered.storage.checksum import crc32


@pytest.mark.parametrize("size", [0, 1, 63, 5 * 1024 + 1, 1 << 20])
def test_crc32_equals_zlibs_on_bytes_and_views(size: int) -> None:
    data = os.urandom(size)
    assert crc32(data) == zlib.crc32(data)
    view = memoryview(np.frombuffer(data, dtype=np.uint8))
    assert crc32(view) == zlib.crc32(view)


def test_crc32_chains_as_zlibs() -> None:
    a, b = os.urandom(70_001), os.urandom(12_345)
    assert crc32(b, crc32(a)) == zlib.crc32(b, zlib.crc32(a)) == zlib.crc32(a + b)
    assert crc32(a + b) != crc32(b + a)
