"""Stand-in for SGLang's CPU kernel wheel (`sgl_kernel` built for CPU is not on PyPI).

SGLang's CPU engine imports these names at module load; a Llama model with torch-native attention, the radix cache
and the hierarchical cache never calls them. Each raises a clear error if it is ever called. Put on `sys.path` by
`sglang_tiered.integration.cpu_shims` only when CUDA is absent and no real `sgl_kernel` is importable.
"""

_NAMES = (
    "copy_all_layer_kv_cache_cpu",
    "assign_req_to_token_pool_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
)
SGLANG_TIERED_STUB = True


def _missing(name):
    def fail(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is a CPU kernel that is not installed (sglang-tiered's stand-in module). "
            "This feature (speculative decoding or the AMX CPU path) needs a CPU build of sgl_kernel."
        )

    fail.__name__ = name
    return fail


for _name in _NAMES:
    globals()[_name] = _missing(_name)


def __getattr__(name):
    raise ImportError(f"sgl_kernel.{name} is not available on this CPU-only machine (sglang-tiered stand-in)")
