"""Compute-or-load: which way a stored span comes in (Cake, arXiv 2410.03065; KVPR's activations as one case).
Pure arithmetic: no torch, no SGLang.

A span of stored pages is filled by two workers that meet where they meet (engine/meet.py): compute prefills pages
from the front, from their token ids; the loader reads pages from the back -- as KV, or, where a page's activations
are stored and that is cheaper (MHA models), as its attention inputs X, from which it recomputes K and V. The meet
point needs no plan. What is decided per request is only whether to start the meet at all:

* `LOAD`: reads are fast next to compute (compute would take fewer than MIN_PAGES pages): SGLang's own load brings
  the span in -- unless the loader would read activations, which SGLang's load cannot: then `MEET`;
* `COMPUTE`: reads are slow next to compute (the loader would bring in less than one page): SGLang's forward
  computes the span from its token ids;
* `MEET`: the two-sided load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

LOAD, COMPUTE, MEET = "load", "compute", "meet"

MEET_CHUNK_PAGES = 4  # the most pages compute prefills at once (wider chunks run wider matrix products)
MIN_PAGES = 2  # compute must be expected to take at least this many pages for the meet to be worth starting


@dataclass(frozen=True)
class Shape:
    """Bytes per token per layer of the two stored representations, and the model's layers."""

    layers: int
    x_bytes: int  # hidden * itemsize: the attention input
    kv_bytes: int  # 2 * kv_heads * head_dim * itemsize


@dataclass(frozen=True)
class Profile:
    """The served model's compute on this machine (engine/kvpr_profile.py), in seconds."""

    page_s: float  # one page of a span computed from its token ids, as part of a chunk of MEET_CHUNK_PAGES pages
    recompute_s: float  # K and V of one token-layer recomputed from its activations


@dataclass(frozen=True)
class Decision:
    way: str  # LOAD, COMPUTE or MEET
    activations: bool  # the loader reads pages as activations where stored
    read_s: float  # the loader's expected seconds per page (the engine's estimate until its first read is in)
    page_s: float  # compute's expected seconds per page


def gate(shape: Shape) -> Optional[str]:
    """None where activations can pay on this model (X smaller than the KV it replaces), else why not."""
    if shape.x_bytes >= shape.kv_bytes:
        return (f"activations are {shape.x_bytes / shape.kv_bytes:.2f}x the size of the KV they would replace "
                "(hidden size >= 2 x kv_heads x head_dim): a GQA model, nothing to save")
    return None


def page_read_s(shape: Shape, page_size: int, read_bps: float, recompute_s: float, activations: bool) -> float:
    """Seconds for the loader to bring one page in: its KV read, or its activations read and K, V recomputed."""
    token_layers = shape.layers * page_size
    if activations:
        return token_layers * (shape.x_bytes / read_bps + recompute_s)
    return token_layers * shape.kv_bytes / read_bps


def decide(pages: int, page_size: int, shape: Shape, read_bps: float, profile: Profile, *,
           stored_activations: bool) -> Decision:
    """The way a span of `pages` stored pages comes in, at `read_bps` bytes per second of reads. With both workers at
    their rates (c seconds a computed page, r a read one) compute takes about pages x r / (r + c) pages."""
    if pages < 1 or read_bps <= 0:
        raise ValueError(f"{pages} pages at {read_bps} bytes/s")
    kv = page_read_s(shape, page_size, read_bps, profile.recompute_s, False)
    x = page_read_s(shape, page_size, read_bps, profile.recompute_s, True)
    activations = stored_activations and gate(shape) is None and x < kv
    r, c = (x if activations else kv), profile.page_s
    computed = pages * r / (r + c)
    if pages - computed < 1:
        way = COMPUTE
    elif computed < MIN_PAGES:
        way = MEET if activations else LOAD
    else:
        way = MEET
    return Decision(way, activations, r, c)
