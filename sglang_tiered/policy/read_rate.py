"""The SSD read rate that compute-or-load decisions use (`Profile.read_bytes_per_s`, policy/kvpr.py): seeded by the
startup probe, then following what loads actually read. Pure bookkeeping: no torch, no SGLang.

One probe at startup is a poor estimate on its own: on one AMD machine it measured 82 MB/s (it ran beside the
write-through of the first documents) while the loads that followed read at 460-680 MB/s behind the same 200 MB/s
throttle -- and a rate kept as a floor at the probe's value had the loader read activations where KV was cheaper
(1.25-1.38x the better baseline). So every load's reads count, both directions:

* `observe(nbytes, seconds)`: bytes a load read and the wall seconds its reads took -- our loader's (engine/meet.py's
  page reads) and SGLang's own (`TieredSSDStorage.batch_get_v1`, the tier's reads only). Small loads are summed
  until MIN_BYTES (a few pages say little: their fixed costs dominate), then fold into a moving average (WEIGHT of the
  new sample), in both directions: a disk that slows down is seen as soon as one that speeds up.
* The probe is the first sample of that average, not a bound on it.

A load served from the page cache reads faster than the disk, and is counted so: that is how fast those bytes came.
Not thread-safe: the caller holds its lock (SGLang's prefetch thread and the scheduler both report).
"""

from __future__ import annotations

MIN_BYTES = 8 << 20  # reads summed before a sample folds in
WEIGHT = 0.3  # of a new sample in the moving average


class ReadRate:
    """Bytes per second of the SSD read path, as loads see it."""

    def __init__(self, seed_bps: float) -> None:
        if seed_bps <= 0:
            raise ValueError(f"a read rate must be positive, got {seed_bps}")
        self.bps = seed_bps  # the current estimate
        self.samples = 0  # loads folded in since the seed
        self._bytes = 0  # reads not yet folded in
        self._seconds = 0.0

    def observe(self, nbytes: int, seconds: float) -> bool:
        """Count one load's reads; True when they (with those summed before) folded into `bps`."""
        if nbytes <= 0 or seconds <= 0:
            return False
        self._bytes += nbytes
        self._seconds += seconds
        if self._bytes < MIN_BYTES:
            return False
        rate = self._bytes / self._seconds
        self._bytes, self._seconds = 0, 0.0
        self.bps = WEIGHT * rate + (1 - WEIGHT) * self.bps
        self.samples += 1
        return True
