"""Launcher side of blending: prompts marked with the chunk separator are split into parts, each part tokenized on
its own, and the part lengths travel with the request to the scheduler (blend.py) in
`sampling_params.custom_params["tiered_chunks"]`.

Seams (listed in plugin.py), registered in every process because plugins load before the flags are parsed; they
act only when the server runs with `--kv-backend tiered` and `--tiered-blend` is not `off`:
* `TokenizerManager._tokenize_one_request` (BEFORE): a text prompt containing the separator is split, the ids
  concatenated into `input_ids`, the part lengths attached. `/generate`, `/v1/completions` and frontend programs
  (all send text). A prompt that cannot be served -- only separators, an empty chunk, nothing after the last
  separator, more than `MAX_PARTS` parts -- gets a 400 naming the problem (`blend_plan.PromptError`).
* `serving_chat.parallel_prompt_encode` (AROUND): `/v1/chat/completions` renders the chat template to text and
  encodes it there; a rendered prompt containing the separator is split the same way, and the part lengths are
  remembered by token ids (LRU of 256) until the tokenizer hook above sees those ids. (Chat templates that SGLang
  encodes without rendering text first -- lossy round trips, Python templates -- are not split.)
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional

from sglang_tiered.engine.blend_plan import split_prompt
from sglang_tiered.integration import settings
from sglang_tiered.integration.requests import PARAM

_CHAT_MEMORY = 256  # chat prompts whose chunk lengths wait for their request (one per request in flight)
_chat_chunks: OrderedDict[tuple, list[int]] = OrderedDict()
_chat_lock = threading.Lock()


def _separator() -> Optional[str]:
    """The chunk separator if blending is on in this server, else None."""
    current = settings.current()
    return current.config.blend_separator if current is not None and current.blend_on else None


def _mark(obj, lengths: list[int]) -> None:
    params = dict(obj.sampling_params or {})
    custom = dict(params.get("custom_params") or {})
    custom[PARAM] = lengths
    params["custom_params"] = custom
    obj.sampling_params = params


def _before_tokenize(self, obj, *args, **kwargs):
    separator = _separator()
    if separator is None:
        return None
    text = getattr(obj, "text", None)
    if obj.input_ids is not None:  # a chat prompt split by `_around_chat_encode`?
        if not isinstance(obj.input_ids, list) or not obj.input_ids or not isinstance(obj.input_ids[0], int):
            return None
        with _chat_lock:  # the same ids always split the same way: kept (LRU), not popped
            lengths = _chat_chunks.get(tuple(obj.input_ids))
        if lengths is None:
            return None
        _mark(obj, lengths)
        return (self, obj, *args), kwargs
    if not isinstance(text, str) or separator not in text:
        return None
    ids, lengths = split_prompt(text, separator, lambda part, first: self.tokenizer.encode(
        part, add_special_tokens=first))
    obj.input_ids, obj.text = ids, None
    _mark(obj, lengths)
    return (self, obj, *args), kwargs


def _around_chat_encode(original, tokenizer, text, encode_kwargs=None):
    """Split a rendered chat prompt at the separator like a /generate text, and remember the part lengths for the
    request these ids will arrive in."""
    separator = _separator()
    if separator is None or not isinstance(text, str) or separator not in text:
        return original(tokenizer, text, encode_kwargs)
    first = dict(encode_kwargs or {})

    def encode(part: str, add_special_tokens: bool) -> list[int]:
        return tokenizer.encode(part, **(first if add_special_tokens else {"add_special_tokens": False}))

    ids, lengths = split_prompt(text, separator, encode)
    with _chat_lock:
        _chat_chunks[tuple(ids)] = lengths
        while len(_chat_chunks) > _CHAT_MEMORY:
            _chat_chunks.popitem(last=False)
    return ids


def register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.managers.tokenizer_manager.TokenizerManager._tokenize_one_request",
                          _before_tokenize, HookType.BEFORE)
    HookRegistry.register("sglang.srt.entrypoints.openai.serving_chat.parallel_prompt_encode", _around_chat_encode,
                          HookType.AROUND)
