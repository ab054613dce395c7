"""The partial-recompute split (KVPR): how many leading pages of a stored prefix to load as activations and
recompute, while the KV of the rest streams in. Pure arithmetic, no torch, no SGLang.

A stored span of s tokens is loaded layer by layer. For its first l tokens the loader reads the layer inputs X
(`x_bytes` per token-layer) and recomputes K = X W_K, V = X W_V (`recompute_s` per token-layer); for the other s - l
tokens it reads the KV (`kv_bytes` per token-layer). The seed paper's Eq. 10-11 for one layer,

    t(l) = M_X[0:l] / v + max(t_rec(l), M_KV[l:s] / v),

assumes X crosses the link first and the recompute then overlaps the KV transfer. Our loader reads every layer's
data one layer ahead of the compute over ONE channel (the SSD), so only the first layer's X is exposed; the X of
the other layers shares the channel with the KV and joins the transfer term, and the compute stream also carries
the new tokens' layers and the handling of every stored token (`fixed`):

    t(l) = X_1[0:l] / v + max(L * l * recompute_s + fixed,  (M_X[0:l] - X_1[0:l] + M_KV[l:s]) / v)
    fixed = L * (new tokens * layer_s + s * stored_s)

with L layers, M over all layers and X_1 the first layer's. `choose_split` evaluates t at every page boundary
(exact over the integer range) and returns the smallest l of the minimum. l = 0 whenever X is not smaller than the
KV it replaces (GQA models such as SmolLM2: `gate()` says why) or when recompute is slower than the transfer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# `auto` takes our loader (at its best l, 0 included) only when it predicts at least this fraction off SGLang's own
# load (`sglang_load_time`): below it, the model's error and our loader's fixed cost eat the gain.
AUTO_MIN_GAIN = 0.15


@dataclass(frozen=True)
class Profile:
    """Measured speeds of this machine for the served model (see engine/kvpr_profile.py)."""

    read_bytes_per_s: float  # the SSD read path, page cache bypassed
    recompute_s: float  # seconds to recompute K and V of one token in one layer from its activations
    layer_s: float  # seconds of one layer of the model for one new token (projections and MLP, no long attention)
    stored_s: float = 0.0  # compute-stream seconds per stored token-layer, however it arrived (assembling the
    #                        span's KV, attending over it, writing it to the pool)


@dataclass(frozen=True)
class Shape:
    """Bytes per token per layer of the two representations."""

    layers: int
    x_bytes: int  # hidden * itemsize
    kv_bytes: int  # 2 * kv_heads * head_dim * itemsize


@dataclass(frozen=True)
class Split:
    pages: int  # l in pages: the leading pages recomputed from activations
    tokens: int  # l in tokens
    predicted_s: float  # t(l)
    full_s: float  # t(0): everything loaded as KV
    reason: str  # why this l (one line, for the log)


def gate(shape: Shape) -> Optional[str]:
    """None if activations can pay on this model, else why not."""
    if shape.x_bytes >= shape.kv_bytes:
        return (f"activations are {shape.x_bytes / shape.kv_bytes:.2f}x the size of the KV they would replace "
                "(hidden size >= 2 x kv_heads x head_dim): a GQA model, nothing to save")
    return None


def load_time(l_tokens: int, s_tokens: int, new_tokens: int, shape: Shape, prof: Profile) -> float:
    """t(l) of the module docstring, in seconds."""
    v = prof.read_bytes_per_s
    x1 = l_tokens * shape.x_bytes / v
    transfer = (shape.layers - 1) * l_tokens * shape.x_bytes / v + (s_tokens - l_tokens) * shape.layers * \
        shape.kv_bytes / v
    compute = shape.layers * (l_tokens * prof.recompute_s + new_tokens * prof.layer_s + s_tokens * prof.stored_s)
    return x1 + max(compute, transfer)


def sglang_load_time(s_tokens: int, new_tokens: int, shape: Shape, prof: Profile, device_bps: float) -> float:
    """What SGLang's own L3 load costs, for comparison: it reads every page of the span (at the device's rate,
    `device_bps`) before the forward starts, then computes the new tokens -- no overlap."""
    return s_tokens * shape.layers * shape.kv_bytes / device_bps + shape.layers * new_tokens * prof.layer_s


def takes_over(split: Split, sglang_s: float, min_gain: float = AUTO_MIN_GAIN) -> bool:
    """`auto`: does our loader at `split` (l = 0 included) predict at least `min_gain` off SGLang's own load
    (`sglang_load_time`)?"""
    return split.predicted_s <= (1 - min_gain) * sglang_s


def choose_split(pages: int, page_size: int, new_tokens: int, shape: Shape, prof: Profile,
                 max_pages: Optional[int] = None) -> Split:
    """The l (whole pages, at most `max_pages` -- the leading pages whose activations are stored) minimizing t(l)."""
    if pages < 0 or page_size < 1:
        raise ValueError(f"pages must be >= 0 and page_size >= 1, got {pages}, {page_size}")
    s = pages * page_size
    full = load_time(0, s, new_tokens, shape, prof)
    why_not = gate(shape)
    if why_not is not None:
        return Split(0, 0, full, full, why_not)
    limit = pages if max_pages is None else max(0, min(pages, max_pages))
    best, best_t = 0, full
    for p in range(1, limit + 1):
        t = load_time(p * page_size, s, new_tokens, shape, prof)
        if t < best_t:
            best, best_t = p, t
    if best == 0:
        hidden = load_time(0, 0, new_tokens, shape, prof) >= full - 1e-12
        reason = ("no stored activations" if limit == 0 else
                  "the transfer already hides behind the new tokens' compute" if hidden else
                  "recomputing does not shorten the load at this bandwidth")
    else:
        reason = f"predicted {best_t:.3f}s vs {full:.3f}s for a full load"
    return Split(best, best * page_size, best_t, full, reason)


class Calibration:
    """Fits the compute stream's two per-token costs from observed loads: busy_s - new * layer_s = recomputed *
    recompute_s + stored * stored_s (all counts in token-layers), by least squares over exponentially decayed
    sums (`decay` per load). Until loads with different splits make the fit well posed, only stored_s moves (with
    recompute_s held at the profile's)."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self.rr = self.rs = self.ss = self.ry = self.sy = 0.0

    def observe(self, prof: Profile, busy_s: float, recomputed: int, new: int, stored: int) -> Profile:
        """The profile with recompute_s and stored_s refitted to this load and the earlier ones."""
        if stored <= 0:
            return prof
        y = max(0.0, busy_s - new * prof.layer_s)
        d = self.decay
        r, s = float(recomputed), float(stored)
        self.rr, self.rs, self.ss = d * self.rr + r * r, d * self.rs + r * s, d * self.ss + s * s
        self.ry, self.sy = d * self.ry + r * y, d * self.sy + s * y
        det = self.rr * self.ss - self.rs * self.rs
        if det > 1e-3 * self.rr * self.ss and self.rr > 0:  # splits varied enough: fit both
            rec = (self.ry * self.ss - self.sy * self.rs) / det
            sto = (self.sy * self.rr - self.ry * self.rs) / det
            if rec > 0 and sto >= 0:
                return Profile(prof.read_bytes_per_s, rec, prof.layer_s, sto)
        sto = max(0.0, (self.sy - prof.recompute_s * self.rs) / self.ss)
        return Profile(prof.read_bytes_per_s, prof.recompute_s, prof.layer_s, sto)


def page_compute_s(prof: Profile, layers: int, page_size: int) -> float:
    """Seconds to prefill one page of a stored span from its token ids (every layer; the attention over what came
    before it is in `stored_s`, small next to the projections and the MLP at these lengths)."""
    return layers * page_size * (prof.layer_s + prof.stored_s)


# `auto` takes the two-sided loader only where reading the span takes longer than computing this many pages: below,
# compute could take a page at most, and our path's fixed costs (the span's KV copied into the pool, the new tokens'
# attention over it in our engine) outweigh it -- on this machine's own disk a 4096-token span loaded two-sided was
# 1.23x SGLang's load (benchmarks/meet.py)
MEET_MIN_PAGES = 2


def meet_pays(pages: int, page_bytes: int, prof: Profile, page_s: float) -> bool:
    """`auto`: take a stored span with the two-sided loader (compute the front, load the back: engine/meet.py)
    rather than SGLang's whole load only if reading the whole span takes longer than computing MEET_MIN_PAGES of
    its pages -- otherwise the loader alone finishes about as soon as compute could start, and SGLang's own load is
    as fast."""
    return pages * page_bytes / prof.read_bytes_per_s > MEET_MIN_PAGES * page_s

