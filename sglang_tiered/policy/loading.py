"""Loading controller for blending (CacheBlend): pick the recompute ratio from measured load and compute speed.

Per layer, a blend loads the reused tokens' KV (bytes / load bandwidth) while it recomputes a fraction r of them
(r x the time of one full layer over those tokens). Loading layer l+1 overlaps recomputing layer l, so recompute
is free up to the point where it takes as long as the load:

    r_match = load_seconds_per_layer / full_layer_seconds
    r       = clamp(max(r_match, floor), 0, 1)           floor = the quality floor r* (15 % by default)

Both speeds are exponentially weighted moving averages of observations (seconds per byte loaded; seconds per
token-layer computed), so the ratio follows the hardware and the tier the KV came from. Until both have been
observed the controller answers the floor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

DEFAULT_RATIO = 0.15  # the quality floor r*: fraction of reused tokens recomputed per layer
POSITION_TOKENS = 32  # the first tokens of each chunk recomputed under position selection (EPIC's k <= 32)


@dataclass
class _Ewma:
    alpha: float
    value: Optional[float] = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.alpha * x + (1 - self.alpha) * self.value


class LoadingController:
    def __init__(self, floor: float = DEFAULT_RATIO, alpha: float = 0.3) -> None:
        if not 0.0 < floor <= 1.0:
            raise ValueError(f"the quality floor must be in (0, 1], got {floor}")
        self.floor = floor
        self._s_per_byte = _Ewma(alpha)
        self._s_per_token_layer = _Ewma(alpha)

    def observe_load(self, seconds: float, nbytes: int) -> None:
        """`nbytes` of reused KV were loaded (and re-rotated) in `seconds`."""
        if nbytes > 0 and seconds >= 0:
            self._s_per_byte.add(seconds / nbytes)

    def observe_compute(self, seconds: float, token_layers: int) -> None:
        """`token_layers` (tokens x layers) were computed in `seconds`."""
        if token_layers > 0 and seconds >= 0:
            self._s_per_token_layer.add(seconds / token_layers)

    def ratio(self, reused_tokens: int, bytes_per_token_layer: int) -> float:
        """Recompute ratio for a request reusing `reused_tokens` tokens of KV."""
        if self._s_per_byte.value is None or self._s_per_token_layer.value is None or reused_tokens <= 0:
            return self.floor
        load = self._s_per_byte.value * bytes_per_token_layer * reused_tokens
        full = self._s_per_token_layer.value * reused_tokens
        return min(1.0, max(self.floor, load / full))

    def describe(self) -> dict:
        return {"floor": self.floor, "s_per_byte": self._s_per_byte.value,
                "s_per_token_layer": self._s_per_token_layer.value}
