"""What a blended prefill reuses: prompts split into chunks, and spans of stored KV tiling the tokens of a forward.

A user marks chunk boundaries in a text prompt with a separator. `split_prompt` tokenizes each part on its own (so a
chunk's tokens never depend on its neighbours) and `check_parts` refuses part lists a blend cannot serve. Every
part but the last is a reusable chunk; the last part (the question) is always computed.

`plan_spans` maps the parts onto the tokens one forward prefills -- the whole prompt after its cached prefix, or one
piece of a chunked prefill -- as a list of `Span`s (stored or fresh) and, for each stored span, the chunk it reads
from (`ChunkRef`: key over all of the chunk's tokens, where the chunk starts). Pure functions, no SGLang.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

from sglang_tiered.storage.chunk_store import chunk_key

MAX_PARTS = 512  # chunks + question in one prompt; more is refused (each new chunk costs its own prefill)


class PromptError(ValueError):
    """A marked prompt that cannot be served; the message says what is wrong (the server answers 400)."""


@dataclass(frozen=True)
class Span:
    """Tokens [start, end) of the prompt; `stored` says whether stored KV of these tokens is available: tokens
    offset .. offset + length - 1 of a chunk whose KV was computed at positions 0 .. (so the span's keys are re-rotated
    by start - offset). A chunk cut by a cached prefix or by a prefill piece boundary is a span with offset > 0 or
    a shorter length: causal attention makes the first k tokens' stored KV independent of the rest."""

    start: int
    end: int
    stored: bool
    offset: int = 0

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ChunkRef:
    """A reusable chunk of the prompt: its store key (hash of all its tokens) and where it lies in the prompt."""

    key: str
    start: int  # the chunk's first token (prompt position)
    length: int  # all of the chunk's tokens, also those outside the piece being prefilled


def split_prompt(text: str, separator: str, encode: Callable[[str, bool], list[int]]) -> tuple[list[int], list[int]]:
    """(ids, part lengths) of `text` split at `separator`, each part encoded on its own by `encode(part,
    add_special_tokens)`; only the first part gets the tokenizer's special prefix tokens (BOS). Raises PromptError
    (see `check_parts`)."""
    parts = text.split(separator)
    if len(parts) > MAX_PARTS:
        raise PromptError(f"the prompt has {len(parts) - 1} chunk separators; at most {MAX_PARTS - 1} are served")
    ids: list[int] = []
    lengths: list[int] = []
    for i, part in enumerate(parts):
        toks = encode(part, i == 0)
        ids += toks
        lengths.append(len(toks))
    check_parts(lengths, separator)
    return ids, lengths


def check_parts(lengths: Sequence[int], separator: Optional[str] = None) -> None:
    """Raise PromptError unless every part has tokens: an empty chunk (two separators in a row, or one at the very
    start) reuses nothing, and an empty last part leaves no question to compute. `separator` (the text, if the
    parts came from one) makes the messages name it."""
    sep = repr(separator) if separator else "separator"
    if len(lengths) < 2:
        raise PromptError("a marked prompt needs at least two parts (chunks, then the question)")
    if len(lengths) > MAX_PARTS:
        raise PromptError(f"the prompt has {len(lengths) - 1} chunks; at most {MAX_PARTS - 1} are served")
    empty = [i for i, n in enumerate(lengths) if n <= 0]
    if not empty:
        return
    if len(empty) == len(lengths):
        raise PromptError(f"the prompt is empty: it holds only {sep} separators" if separator else
                          "the prompt is empty: every part has zero tokens")
    i = empty[0]
    if i == len(lengths) - 1:
        raise PromptError(f"nothing follows the last {sep}: the text after it (the question) is empty")
    where = f"the prompt starts with {sep}" if i == 0 else f"two {sep} in a row after part {i}"
    raise PromptError(f"chunk {i + 1} of {len(lengths) - 1} is empty ({where})")


def plan_spans(lengths: Sequence[int], prefix: int, end: int, ids: Sequence[int], seed: Optional[str] = None,
               fresh_from: Optional[int] = None) -> tuple[list[Span], list[Optional[ChunkRef]]]:
    """Spans tiling [prefix, end) -- the tokens this forward prefills -- and each span's chunk (None for fresh
    spans). Every part but the last is a reusable chunk: its tokens inside [prefix, end) are a stored span (`offset` =
    its tokens before `prefix`). The last part (the question) is fresh, and so is the forward's last token (its hidden
    state gives the logits), and every token from `fresh_from` on (the prompt's last partial page, which a repeat's
    prefix match stops short of: computed fresh in both asks, a repeat answers as the first ask did). Chunk keys are
    seeded with the request's tenant `seed` (`chunk_store.chunk_key`)."""
    spans: list[Span] = []
    refs: list[Optional[ChunkRef]] = []
    pos = 0
    for i, n in enumerate(lengths):
        lo, hi = max(pos, prefix), min(pos + n, end)
        if hi > lo and i < len(lengths) - 1:
            ref = ChunkRef(chunk_key(ids[pos : pos + n], seed), pos, n)
            cut = hi - 1 if hi == end else hi
            if fresh_from is not None:
                cut = max(lo, min(cut, fresh_from))
            if cut > lo:
                spans.append(Span(lo, cut, True, lo - pos))
                refs.append(ref)
            if cut < hi:
                spans.append(Span(cut, hi, False))
                refs.append(None)
        elif hi > lo:
            spans.append(Span(lo, hi, False))
            refs.append(None)
        pos += n
    return spans, refs


def check_spans(spans: Sequence[Span], tokens: int, start: int = 0) -> None:
    """Raise ValueError unless `spans` tile [start, tokens) in order without gaps."""
    pos = start
    for s in spans:
        if s.start != pos or s.end <= s.start:
            raise ValueError(f"spans must tile the prompt in order without gaps: {s} after position {pos}")
        pos = s.end
    if pos != tokens:
        raise ValueError(f"spans cover {pos} tokens, the prompt has {tokens}")
