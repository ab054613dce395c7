"""The SSD read rate compute-or-load decides by: seeded by a probe at startup, then following what loads read --
our loader's and SGLang's own. Pure bookkeeping: no torch, no SGLang. Not thread-safe: the caller holds its lock.

Reads are summed until MIN_BYTES (a few pages say little: their fixed costs dominate), then fold into a moving
average (WEIGHT of the new sample) in both directions, so a disk that slows down is seen as soon as one that speeds up.
The probe is the first sample, not a bound: on one machine it measured 82 MB/s beside the first write-through while
the loads that followed read at 460-680 MB/s.
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
        self.samples = 0  # samples folded in since the seed
        self._bytes, self._seconds = 0, 0.0  # reads not yet folded in

    def observe(self, nbytes: int, seconds: float) -> bool:
        """Count one load's reads (bytes over the wall seconds they took); True when they folded into `bps`."""
        if nbytes <= 0 or seconds <= 0:
            return False
        self._bytes, self._seconds = self._bytes + nbytes, self._seconds + seconds
        if self._bytes < MIN_BYTES:
            return False
        rate = self._bytes / self._seconds
        self._bytes, self._seconds = 0, 0.0
        self.bps = WEIGHT * rate + (1 - WEIGHT) * self.bps
        self.samples += 1
        return True
