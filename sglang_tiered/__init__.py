"""sglang-tiered: a GPU / host DRAM / SSD KV store for SGLang's radix cache.

The SGLang coupling lives in ``sglang_tiered.integration``; every other sub-package is usable without SGLang.
"""

__version__ = "0.1.0"
