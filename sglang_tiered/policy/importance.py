"""IMPRESS arithmetic, pure: the Jaccard gate that decides whether the sampled heads agree enough to load only the
tokens they select.

* Gate: the sampled heads each pick their top-k of the n stored tokens; if their sets' mean pairwise Jaccard
  similarity J reaches t = j^alpha with j = (k/n) / (2 - k/n) (the expected Jaccard of two random k-subsets of n is
  about j), the heads agree more than chance and only a selection of about k tokens is loaded (engine/sparse.py);
  otherwise everything is. The alternative `mass` gate (engine/sparse.py) passes a layer when the selection leaves
  out at most a set share of the window's attention instead.
* Probe skipping (`GateHistory`): a layer whose gate failed on each of its last `streak` measured loads loads all
  of the stored span at once, without reading its probe first -- the outcome a failed gate has anyway (exact for
  that layer), less the probe's bytes. Every `explore`-th load measures every layer again.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

GATES = ("jaccard", "mass")  # --tiered-importance-gate; jaccard is IMPRESS's


def jaccard(a: set[int], b: set[int]) -> float:
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


def mean_pairwise_jaccard(sets: Sequence[set[int]]) -> float:
    pairs = list(itertools.combinations(sets, 2))
    return sum(jaccard(a, b) for a, b in pairs) / len(pairs) if pairs else 1.0


def gate_threshold(k: int, n: int, alpha: float = 0.6) -> float:
    """t = j^alpha, j = (k/n) / (2 - k/n): the Jaccard two heads must reach for their top-k sets to be trusted."""
    if n <= 0 or not 0 < k <= n:
        raise ValueError(f"need 0 < k <= n, got k={k}, n={n}")
    f = k / n
    return (f / (2 - f)) ** alpha


class GateHistory:
    """Which layers a sparse load reads without a probe (see the module docstring). Not thread-safe: one per
    scheduler process, used from its thread. `streak` 0: never skip."""

    def __init__(self, streak: int, explore: int = 8) -> None:
        if streak < 0 or explore < 1:
            raise ValueError(f"need streak >= 0 and explore >= 1, got {streak} and {explore}")
        self.streak, self.explore = streak, explore
        self._fails: dict[int, int] = {}  # layer -> consecutive failed gates on the loads that measured it
        self._loads = 0

    def skip(self) -> frozenset[int]:
        """The layers the next load reads without a probe (call once per load)."""
        self._loads += 1
        if self.streak == 0 or self._loads % self.explore == 0:
            return frozenset()
        return frozenset(layer for layer, n in self._fails.items() if n >= self.streak)

    def record(self, passed: Mapping[int, bool]) -> None:
        """The gate outcomes of one load, for the layers it measured (skipped layers are not in `passed`)."""
        for layer, ok in passed.items():
            self._fails[layer] = 0 if ok else self._fails.get(layer, 0) + 1
