"""IMPRESS arithmetic, pure: which tokens count as important, and the Jaccard gate that decides whether the sampled
heads agree enough to load only the tokens they select.

* Important tokens: at capture, the `ratio` fraction of a prompt's tokens with the highest score (kernels/
  importance.py). Each token keeps an exponential moving average of "was important" (1 or 0), so a node's
  *important tokens* is the sum of that average over its tokens -- the paper's average importance, updated every
  time a later request's prefill sees the node again.
* Gate: the sampled heads each pick their top-k of the n stored tokens; if their sets' mean pairwise Jaccard
  similarity J reaches t = j^alpha with j = (k/n) / (2 - k/n) (the expected Jaccard of two random k-subsets of n is
  about j), the heads agree more than chance and only a selection of about k tokens is loaded (engine/sparse.py);
  otherwise everything is.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence


def important_mask(scores: Sequence[float], ratio: float) -> list[bool]:
    """True for the ceil(ratio * n) highest scores (ties broken by position, earlier first)."""
    n = len(scores)
    k = min(n, max(1, math.ceil(ratio * n - 1e-9))) if n else 0
    order = sorted(range(n), key=lambda i: (-scores[i], i))[:k]
    chosen = set(order)
    return [i in chosen for i in range(n)]


def ema(old: float, new: float, alpha: float) -> float:
    return new if old < 0 else alpha * new + (1 - alpha) * old


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
