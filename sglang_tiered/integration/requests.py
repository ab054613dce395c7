"""Bad requests get a 400 that says what is wrong, before they reach a scheduler (where an exception kills every
process of the server).

Seam (listed in plugin.py): `TokenizerManager._validate_one_request` (BEFORE, launcher process), which SGLang calls
for every request -- text or `input_ids`, single or batch, `/generate`, `/v1/completions`, `/v1/chat/completions`
-- after tokenization and before it is sent to a scheduler. A ValueError raised there becomes HTTP 400 with its
message. Checked, only for servers started with `--kv-backend tiered`:

* the prompt has at least one token (an empty text, or one made only of chunk separators, tokenizes to none);
* every input id is an integer in [0, vocab size) of the served model;
* chunk lengths in `custom_params["tiered_chunks"]` (set by the separator split in blend_prompt.py, or sent by a
  client that splits its own `input_ids`) are positive integers that add up to the prompt's length, at most
  `MAX_PARTS` of them;
* `custom_params["tiered_importance"]`, if given, is one of "gated", "off", "full";
* `custom_params["tiered_importance_gate"]`, if given, is "jaccard" or "mass";
* `custom_params["tiered_kvpr"]`, if given, is "off", "auto", "force" or a number of tokens >= 0 (the meet point);
* `custom_params["tiered_retain"]`, if given, is a number of seconds in [0, `--tiered-max-retain`] (retention
  off -- `--tiered-max-retain 0` -- admits only 0).

The same parse gives the scheduler side its `RequestOptions`: `options(req)` parses a request's custom_params once
and keeps the frozen result beside it (`req.tiered_options`); every handler reads that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from sglang_tiered.engine.blend_plan import MAX_PARTS, PromptError, check_parts
from sglang_tiered.policy.importance import GATES

CHUNKS_PARAM = "tiered_chunks"  # custom_params key of a marked prompt's part lengths (blending)
SPARSE_PARAM = "tiered_importance"  # custom_params key of a request's gated sparse loading mode (sparse.py)
SPARSE_MODES = ("gated", "off", "full")
GATE_PARAM = "tiered_importance_gate"  # custom_params key of a request's gate, overriding --tiered-importance-gate
RATIO_PARAM = "tiered_importance_ratio"  # custom_params key of a gated load's ratio, overriding
#                                          --tiered-importance-ratio
KVPR_PARAM = "tiered_kvpr"  # custom_params key of a request's compute-or-load mode (integration/kvpr.py)
KVPR_MODES = ("off", "auto", "force")  # or a number of tokens computed from token ids
RETAIN_PARAM = "tiered_retain"  # custom_params key: seconds to keep the prompt's pages (door.py)


@dataclass(frozen=True)
class RequestOptions:
    """A request's `custom_params`, parsed and checked once. None: not given (the server's flag decides)."""

    chunks: Optional[tuple[int, ...]] = None  # a marked prompt's part lengths (blending)
    sparse: Optional[str] = None  # SPARSE_MODES
    gate: Optional[str] = None  # policy/importance.GATES
    ratio: Optional[float] = None  # gated load's ratio in (0, 1]
    kvpr: Optional[Union[str, int]] = None  # KVPR_MODES or a meet point in tokens
    retain: Optional[float] = None  # seconds to keep the prompt's pages


def parse_options(custom: Any, tokens: int, max_retain: float) -> RequestOptions:
    """`custom` (a request's custom_params) as RequestOptions for a prompt of `tokens` tokens. Raises ValueError
    with the message a client gets as a 400."""
    if not isinstance(custom, dict):
        return RequestOptions()
    check_choice(custom, SPARSE_PARAM, SPARSE_MODES)
    check_choice(custom, GATE_PARAM, GATES)
    chunks = custom.get(CHUNKS_PARAM)
    if chunks is not None:
        check_chunk_lengths(chunks, tokens)
    ratio = custom.get(RATIO_PARAM)
    if ratio is not None:
        check_ratio(ratio)
    if KVPR_PARAM in custom:
        check_kvpr_mode(custom[KVPR_PARAM])
    retain = custom.get(RETAIN_PARAM)
    if retain is not None:
        check_retain(retain, max_retain)
    return RequestOptions(tuple(chunks) if chunks is not None else None, custom.get(SPARSE_PARAM),
                          custom.get(GATE_PARAM), ratio, custom.get(KVPR_PARAM),
                          float(retain) if retain is not None else None)


def options(req) -> RequestOptions:
    """A scheduler request's RequestOptions, parsed at the first call and kept on it (the launcher checked them:
    a value it would refuse reads as not given)."""
    opts = getattr(req, "tiered_options", None)
    if opts is None:
        try:
            opts = parse_options(request_params(req), len(req.origin_input_ids), float("inf"))
        except ValueError:
            opts = RequestOptions()
        req.tiered_options = opts
    return opts


def request_params(req) -> dict:
    """A scheduler request's `sampling_params.custom_params` ({} when it has none)."""
    return getattr(getattr(req, "sampling_params", None), "custom_params", None) or {}


def check_choice(custom: Any, param: str, choices: tuple) -> None:
    """Raise ValueError if `custom` (a request's custom_params) gives `param` a value outside `choices`."""
    value = custom.get(param) if isinstance(custom, dict) else None
    if value is not None and value not in choices:
        raise ValueError(f"custom_params.{param} must be one of {choices}, got {value!r}")


def check_kvpr_mode(mode: Any) -> None:
    """Raise ValueError unless `mode` is one of KVPR_MODES or a non-negative integer (tokens)."""
    if mode in KVPR_MODES or (isinstance(mode, int) and not isinstance(mode, bool) and mode >= 0):
        return
    raise ValueError(f"custom_params.{KVPR_PARAM} must be one of {KVPR_MODES} or a number of tokens >= 0, got "
                     f"{mode!r}")


def check_ratio(value: Any) -> None:
    """Raise ValueError unless `value` (custom_params.tiered_importance_ratio) is a number in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"custom_params.{RATIO_PARAM} must be a number in (0, 1], got {value!r}")


def check_retain(seconds: Any, max_seconds: float) -> None:
    """Raise ValueError unless `seconds` is a number in [0, max_seconds]."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= max_seconds \
            or seconds != seconds:
        off = " (retention is off on this server: --tiered-max-retain 0)" if max_seconds <= 0 else ""
        raise ValueError(f"custom_params.{RETAIN_PARAM} must be a number of seconds in [0, {max_seconds:g}], got "
                         f"{seconds!r}{off}")


def check_input_ids(input_ids: Any, vocab_size: int) -> None:
    """Raise ValueError unless `input_ids` is a non-empty list of ints in [0, vocab_size) (0 = unknown size)."""
    if input_ids is None or len(input_ids) == 0:
        raise ValueError("the prompt is empty: send a text or input_ids with at least one token")
    for i, t in enumerate(input_ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise ValueError(f"input_ids[{i}] is {t!r}: token ids must be integers")
        if t < 0 or (vocab_size and t >= vocab_size):
            bound = f"[0, {vocab_size})" if vocab_size else "non-negative"
            raise ValueError(f"input_ids[{i}] = {t} is outside the model's vocabulary {bound}")


def check_chunk_lengths(lengths: Any, tokens: int) -> None:
    """Raise ValueError unless `lengths` (custom_params["tiered_chunks"]) splits `tokens` prompt tokens."""
    if not isinstance(lengths, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in lengths):
        raise ValueError(f"custom_params.{CHUNKS_PARAM} must be a list of integers (chunk lengths), got {lengths!r}")
    if len(lengths) > MAX_PARTS:
        raise ValueError(f"custom_params.{CHUNKS_PARAM} has {len(lengths)} parts; at most {MAX_PARTS} are served")
    try:
        check_parts(lengths)
    except PromptError as exc:
        raise ValueError(str(exc)) from None
    if sum(lengths) != tokens:
        raise ValueError(f"custom_params.{CHUNKS_PARAM} adds up to {sum(lengths)} tokens; the prompt has {tokens}")


class RequestCheck:
    """The validation hook of one launcher process (its settings from the `Runtime`)."""

    def __init__(self, rt) -> None:
        self.rt = rt

    def before_validate(self, manager, obj, input_ids, *args, **kwargs):
        current = self.rt.settings
        if current is None or getattr(obj, "input_embeds", None) is not None:
            return None
        check_input_ids(input_ids, current.vocab_size)
        params = getattr(obj, "sampling_params", None)
        custom = params.get("custom_params") if isinstance(params, dict) else None
        parse_options(custom, len(input_ids), current.config.max_retain)
        return None


def register_hooks(rt) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
                          RequestCheck(rt).before_validate, HookType.BEFORE)
