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
from typing import TYPE_CHECKING, Optional

from sglang_tiered.engine.blend_plan import split_prompt
from sglang_tiered.integration.requests import CHUNKS_PARAM

if TYPE_CHECKING:
    from sglang_tiered.integration.runtime import Runtime

_CHAT_MEMORY = 256  # chat prompts whose chunk lengths wait for their request (one per request in flight)


def _mark(obj, lengths: list[int]) -> None:
    params = dict(obj.sampling_params or {})
    custom = dict(params.get("custom_params") or {})
    custom[CHUNKS_PARAM] = lengths
    params["custom_params"] = custom
    obj.sampling_params = params


class ChatChunks:
    """The launcher's prompt splitting (see the module docstring), with the part lengths of rendered chat prompts
    remembered by token ids until their request is tokenized."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self._lengths: OrderedDict[tuple, list[int]] = OrderedDict()
        self._lock = threading.Lock()

    def separator(self) -> Optional[str]:
        """The chunk separator if blending is on in this server, else None."""
        current = self.rt.settings
        return current.config.blend_separator if current is not None and current.blend_on else None

    def before_tokenize(self, manager, obj, *args, **kwargs):
        separator = self.separator()
        if separator is None:
            return None
        text = getattr(obj, "text", None)
        if obj.input_ids is not None:  # a chat prompt split by `around_chat_encode`?
            if not isinstance(obj.input_ids, list) or not obj.input_ids or not isinstance(obj.input_ids[0], int):
                return None
            with self._lock:  # the same ids always split the same way: kept (LRU), not popped
                lengths = self._lengths.get(tuple(obj.input_ids))
            if lengths is None:
                return None
            _mark(obj, lengths)
            return (manager, obj, *args), kwargs
        if not isinstance(text, str) or separator not in text:
            return None
        ids, lengths = split_prompt(text, separator, lambda part, first: manager.tokenizer.encode(
            part, add_special_tokens=first))
        obj.input_ids, obj.text = ids, None
        _mark(obj, lengths)
        return (manager, obj, *args), kwargs

    def around_chat_encode(self, original, tokenizer, text, encode_kwargs=None):
        """Split a rendered chat prompt at the separator like a /generate text, and remember the part lengths for
        the request these ids will arrive in."""
        separator = self.separator()
        if separator is None or not isinstance(text, str) or separator not in text:
            return original(tokenizer, text, encode_kwargs)
        first = dict(encode_kwargs or {})

        def encode(part: str, add_special_tokens: bool) -> list[int]:
            return tokenizer.encode(part, **(first if add_special_tokens else {"add_special_tokens": False}))

        ids, lengths = split_prompt(text, separator, encode)
        with self._lock:
            self._lengths[tuple(ids)] = lengths
            while len(self._lengths) > _CHAT_MEMORY:
                self._lengths.popitem(last=False)
        return ids


def register_hooks(rt: Runtime) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    chat = ChatChunks(rt)
    HookRegistry.register("sglang.srt.managers.tokenizer_manager.TokenizerManager._tokenize_one_request",
                          chat.before_tokenize, HookType.BEFORE)
    HookRegistry.register("sglang.srt.entrypoints.openai.serving_chat.parallel_prompt_encode",
                          chat.around_chat_encode, HookType.AROUND)
