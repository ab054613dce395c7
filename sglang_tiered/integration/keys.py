"""The one key scheme: every object the store keeps for a request is keyed with SGLang's own tenant seed.

SGLang 0.5.23 seeds its page-key hash chain with `storage_namespace_seed(extra_key, cache_salt)`
(`mem_cache/utils.py`): `extra_key` carries the LoRA adapter and any extra isolation key, `cache_salt` the client's
salt. KV pages, their activation pages, repacked groups, importance records and remote objects are all named by
those page keys; chunk KV (blending) hashes its tokens with the same seed (`storage.chunk_store.chunk_key`). So
nothing one tenant or adapter stored is ever found under another's request, and requests without either share as
SGLang's own radix cache does.
"""

from __future__ import annotations

import re
import time
from array import array
from typing import Optional

_BUILD_ERROR = re.compile(r"error:|cannot find|not found|No such file")
_BUILD_NOISE = ("Error building", "[", "FAILED:", "ninja:")  # torch's and ninja's own lines (" -c ": the command)


def tenant_seed(req) -> Optional[str]:
    """SGLang's seed of `req`'s storage keys (None: no extra_key, no cache_salt)."""
    from sglang.srt.mem_cache.utils import storage_namespace_seed

    return storage_namespace_seed(getattr(req, "extra_key", None), getattr(req, "cache_salt", None))


def page_keys(req, tokens: int, page_size: int) -> list[str]:
    """Storage keys of the first `tokens // page_size` pages of `req`'s prompt (SGLang's hash chain, seeded)."""
    return prompt_page_keys(req.origin_input_ids, req.extra_key, req.cache_salt, tokens, page_size)


def prompt_page_keys(ids, extra_key: Optional[str], cache_salt: Optional[str], tokens: int,
                     page_size: int) -> list[str]:
    """`page_keys` of a prompt of token `ids` whose scheduler request will carry `extra_key` (LoRA adapter id
    appended, as SGLang's `Req` does) and `cache_salt`."""
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    n = tokens // page_size * page_size
    if n == 0:
        return []
    key = RadixKey(array("q", ids[:n]), extra_key, cache_salt=cache_salt or None)
    return list(get_storage_hash_str(key, None, page_size=page_size))


def load_page_hash() -> float:
    """Load SGLang's page-key hash; the seconds it took. SGLang 0.5.23 hashes storage keys with a C++ extension that
    torch builds on its first use in an environment (under `TORCH_EXTENSIONS_DIR`, by default
    `~/.cache/torch_extensions`): 10-16 s on 2 cores, which the first request would otherwise wait for with its
    scheduler serving nothing else. Raises RuntimeError with the build's own reason if it cannot be built."""
    from sglang.srt.mem_cache.utils import get_hash_str

    t0 = time.perf_counter()
    try:
        get_hash_str([0])
    except Exception as exc:  # noqa: BLE001 -- SGLang wraps whatever the build raised
        reason = build_error(exc.__cause__ or exc)
        raise RuntimeError(f"SGLang's page-key hash (a C++ extension torch builds once per environment) cannot be "
                           f"built: {reason}; the build needs a C++ compiler, ninja, Python's and OpenSSL's headers "
                           "(Debian: g++ python3-dev libssl-dev) and a writable TORCH_EXTENSIONS_DIR (default "
                           "~/.cache/torch_extensions)") from exc
    return time.perf_counter() - t0


def build_error(exc: BaseException) -> str:
    """The line of a failed extension build that says why (the compiler's or linker's), else its last line."""
    lines = [ln for ln in map(str.strip, str(exc).splitlines())
             if ln and not ln.startswith(_BUILD_NOISE) and " -c " not in ln] or [str(exc)]
    return next((ln for ln in lines if _BUILD_ERROR.search(ln)), lines[-1])[:300]
