"""How to split a prompt over the ranks of a chained prefill: searched on the hardware, kept in a lookup table.

A partition is a list of per-rank fractions of the prompt (summing to 1; earlier ranks take more, because later
ranks wait for the chain and attend to more keys). `measure(fractions) -> seconds` is the time to first token of
one chained prefill with that split (the caller measures it on real ranks).

* Two ranks: binary search on the slope of TTFT(f) for rank 0's fraction f (TTFT is unimodal in f: too small and
  rank 1 does most of the work, too large and rank 1 idles).
* More ranks: hierarchical grid search: a coarse grid over the simplex, then a finer grid around the best cell,
  recursively, down to `min_stride`.
* `PartitionTable`: context length x ranks -> fractions, JSON on disk, linear interpolation between the two nearest
  lengths (clamped outside the measured range).
"""

from __future__ import annotations

import bisect
import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

Measure = Callable[[list[float]], float]
Progress = Optional[Callable[[str], None]]


def binary_search_two(measure: Measure, lo: float = 0.5, hi: float = 0.95, tol: float = 0.01,
                      delta: float = 0.01, confirm: int = 3, progress: Progress = None) -> tuple[list[float], float]:
    """Rank 0's fraction in [lo, hi] minimising TTFT, by bisection on the sign of the slope, then a confirmation
    round: the `confirm` best points seen and the starting `lo` (the even split by default) are measured afresh and
    the lowest fresh time wins, so one lucky measurement cannot pick the split. Returns (fractions, seconds)."""
    seen: dict[float, list[float]] = {}

    def t(f: float, again: bool = False) -> float:
        f = round(f, 4)
        if f not in seen or again:
            seen.setdefault(f, []).append(measure([f, 1 - f]))
            if progress:
                progress(f"  split {f:.3f}/{1 - f:.3f}: {seen[f][-1] * 1000:.1f} ms")
        return sum(seen[f]) / len(seen[f])

    def mean(f: float) -> float:
        return sum(seen[f]) / len(seen[f])

    start = lo
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if t(mid + delta / 2) < t(mid - delta / 2):
            lo = mid
        else:
            hi = mid
    if not confirm:
        best = min(seen, key=mean)
        return [best, 1 - best], mean(best)
    finalists = {*sorted(seen, key=mean)[:confirm], round(start, 4)}
    fresh = {}
    for f in sorted(finalists):
        t(f, again=True)
        fresh[f] = seen[f][-1]
    best = min(fresh, key=fresh.get)
    return [best, 1 - best], fresh[best]


def _simplex_grid(center: Sequence[float], radius: float, stride: float, floor: float) -> list[list[float]]:
    """Points of a grid with `stride` within `radius` of `center` on the first p - 1 coordinates, every fraction
    >= floor, summing to 1."""
    axes = []
    for c in center[:-1]:
        steps = int(round(radius / stride))
        axes.append([round(c + k * stride, 6) for k in range(-steps, steps + 1)])
    out = []
    for head in itertools.product(*axes):
        last = 1 - sum(head)
        point = [*head, round(last, 6)]
        if all(x >= floor for x in point):
            out.append(point)
    return out or [list(center)]


def grid_search(measure: Measure, ranks: int, stride: float = 0.1, min_stride: float = 0.025,
                floor: float = 0.02, progress: Progress = None) -> tuple[list[float], float]:
    """Hierarchical grid search over partitions of `ranks` ranks. Returns (fractions, seconds)."""
    seen: dict[tuple, float] = {}

    def t(point: list[float]) -> float:
        key = tuple(round(x, 4) for x in point)
        if key not in seen:
            seen[key] = measure(list(key))
            if progress:
                progress(f"  split {'/'.join(f'{x:.3f}' for x in key)}: {seen[key] * 1000:.1f} ms")
        return seen[key]

    center = [1.0 / ranks] * ranks
    radius = 1.0
    while True:
        for point in _simplex_grid(center, radius, stride, floor):
            t(point)
        center = list(min(seen, key=seen.get))
        if stride / 2 < min_stride:
            break
        radius, stride = stride, stride / 2
    best = min(seen, key=seen.get)
    return list(best), seen[best]


def search(measure: Measure, ranks: int, progress: Progress = None) -> tuple[list[float], float]:
    if ranks == 1:
        return [1.0], measure([1.0])
    if ranks == 2:
        return binary_search_two(measure, progress=progress)
    return grid_search(measure, ranks, progress=progress)


@dataclass
class PartitionTable:
    """{ranks: {context length: fractions}}; `lookup` interpolates linearly between measured lengths."""

    entries: dict[int, dict[int, list[float]]] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def add(self, ranks: int, length: int, fractions: Sequence[float]) -> None:
        total = float(sum(fractions))
        self.entries.setdefault(ranks, {})[length] = [f / total for f in fractions]

    def lookup(self, ranks: int, length: int) -> list[float]:
        rows = self.entries.get(ranks)
        if not rows:
            raise KeyError(f"no partitions for {ranks} ranks (have {sorted(self.entries)})")
        lengths = sorted(rows)
        if length <= lengths[0]:
            return list(rows[lengths[0]])
        if length >= lengths[-1]:
            return list(rows[lengths[-1]])
        i = bisect.bisect_left(lengths, length)
        if lengths[i] == length:
            return list(rows[length])
        a, b = lengths[i - 1], lengths[i]
        w = (length - a) / (b - a)
        mixed = [(1 - w) * x + w * y for x, y in zip(rows[a], rows[b])]
        total = sum(mixed)
        return [x / total for x in mixed]

    def save(self, path: str | Path) -> None:
        data = {"meta": self.meta,
                "entries": {str(r): {str(n): f for n, f in sorted(rows.items())} for r, rows in self.entries.items()}}
        Path(path).write_text(json.dumps(data, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> PartitionTable:
        data = json.loads(Path(path).read_text())
        entries = {int(r): {int(n): list(f) for n, f in rows.items()} for r, rows in data["entries"].items()}
        return cls(entries, data.get("meta", {}))


def flop_balanced_bounds(prefix: int, tokens: int, ranks: int, linear_flops: float, pair_flops: float) -> list[int]:
    """Bounds (absolute positions, [prefix, ..., prefix + tokens]) giving every rank the same FLOPs: a token costs
    `linear_flops` (projections, MLP) plus `pair_flops` per key it attends to (itself and all before it, the prefix
    included). The default when no measured table exists; every rank gets at least one token."""
    import math

    if tokens < ranks:
        raise ValueError(f"cannot split {tokens} tokens over {ranks} ranks")

    def cost(x: float) -> float:  # FLOPs of positions [0, x)
        return linear_flops * x + pair_flops * x * (x + 1) / 2

    def position(c: float) -> float:  # inverse of cost
        a, b = pair_flops / 2, linear_flops + pair_flops / 2
        return c / b if a == 0 else (-b + math.sqrt(b * b + 4 * a * c)) / (2 * a)

    base, total = cost(prefix), cost(prefix + tokens) - cost(prefix)
    out = [prefix]
    for r in range(1, ranks):
        lo, hi = out[-1] + 1, prefix + tokens - (ranks - r)
        out.append(min(max(round(position(base + total * r / ranks)), lo), hi))
    out.append(prefix + tokens)
    return out
