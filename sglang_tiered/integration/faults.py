"""Injected failures, for tests of the failure paths only: `SGLANG_TIERED_TEST_FAULTS=name[,name...]` makes the
named hooks raise `InjectedFault` on every call, in every process that inherits the variable.

Names: `blend_forward`, `runahead_forward` (handlers of the Llama forward hook), `repack_offer` (its observer of
SGLang's own forwards), `admission` (the prefill admission hook), `cpu_attention` (the prefix-aware attention kernel),
`kvpr_probe` (the SSD read-bandwidth probe), `kvpr_chunks` (measuring the compute profile). Each hook's contract says
what a failure does: the forward handlers and the attention kernel fall back to SGLang's own code, the observer drops
that batch's offers (the pages stay plain), the admission hook to SGLang's admission, a failed probe or profile leaves
compute-or-load without its rates (SGLang loads every stored span); none may fail more than the request it serves.
"""

from __future__ import annotations

import os

ENV = "SGLANG_TIERED_TEST_FAULTS"


class InjectedFault(RuntimeError):
    """Raised by a hook named in SGLANG_TIERED_TEST_FAULTS."""


def check(name: str) -> None:
    """Raise InjectedFault if `name` is listed in SGLANG_TIERED_TEST_FAULTS (cheap when it is not set)."""
    raw = os.environ.get(ENV)
    if raw and name in {n.strip() for n in raw.split(",")}:
        raise InjectedFault(f"injected fault in {name} ({ENV})")
