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
* `spread=True`: reads with gaps between them (the loader recomputed K and V from activations between its reads). A
  kernel throttle (blkio `read_bps_device`) grants a group the bytes it did not use during a gap, so those reads go
  through faster than the rate the disk sustains (measured at 100 MB/s on the MHA model: activation loads 269-725
  MB/s, KV loads read back to back 102-113 MB/s). Their rate is only an upper bound on the disk's: it folds in where
  it is below the estimate (the disk slowed down), never up. Spread and back-to-back reads are summed apart.

A load served from the page cache is no sample: its callers leave it out (integration/kvpr.py: a span with pages in
the page cache at its plan, or its first read there at the load; integration/storage_backend.py: SGLang's reads whose
first or last page is there, probed before the read). Counted, such loads raised the estimate to memory speed (2-3.5
GB/s behind a 100 MB/s throttle), and later plans of cold spans would have read a slow disk as a fast one (stop 66).
Not thread-safe: the caller holds its lock (SGLang's prefetch thread and the scheduler both report).
"""

from __future__ import annotations

MIN_BYTES = 8 << 20  # reads summed before a sample folds in
WEIGHT = 0.3  # of a new sample in the moving average


def moving_average(estimate: float, sample: float) -> float:
    """`estimate` moved towards `sample` by WEIGHT (also the activation loads' cost, integration/kvpr.py)."""
    return WEIGHT * sample + (1 - WEIGHT) * estimate


class ReadRate:
    """Bytes per second of the SSD read path, as loads see it."""

    def __init__(self, seed_bps: float) -> None:
        if seed_bps <= 0:
            raise ValueError(f"a read rate must be positive, got {seed_bps}")
        self.bps = seed_bps  # the current estimate
        self.samples = 0  # loads folded in since the seed
        self._pending = {False: (0, 0.0), True: (0, 0.0)}  # reads not yet folded in (bytes, seconds), by `spread`

    def observe(self, nbytes: int, seconds: float, *, spread: bool = False) -> bool:
        """Count one load's reads; True when they (with those summed before) folded into `bps`. `spread`: reads
        with gaps between them, whose rate only bounds the disk's from above (see the module's docstring)."""
        if nbytes <= 0 or seconds <= 0:
            return False
        summed, spent = self._pending[spread]
        summed, spent = summed + nbytes, spent + seconds
        self._pending[spread] = (summed, spent) if summed < MIN_BYTES else (0, 0.0)
        rate = summed / spent
        if summed < MIN_BYTES or (spread and rate >= self.bps):
            return False
        self.bps = moving_average(self.bps, rate)
        self.samples += 1
        return True
