"""Stands in for SGLang 0.5.23's `sglang/kernels/ops/gemm/cutedsl_dual_gemm.py` on a GPU machine without
nvidia-cutlass-dsl (not carried: scripts/gpu-serve.sh installs this file only where `import cutlass` fails). SGLang's
Llama MLP imports that module on every CUDA device to ask `can_use_dual_gemm`, whose kernel is SM100-only: on any
other GPU it answers False, as this one does everywhere."""

from enum import IntEnum

MAX_DUAL_GEMM_DECODE_TOKENS = 16


class DualGemmQuantMode(IntEnum):
    STATIC_PER_TENSOR = 0
    STATIC_PER_TOKEN = 1
    DYNAMIC_PER_TENSOR = 2
    DYNAMIC_PER_TOKEN = 3
    UNQUANT = 4

    @property
    def is_quantized(self) -> bool:
        return self is not self.UNQUANT

    @property
    def is_dynamic(self) -> bool:
        return self in (self.DYNAMIC_PER_TENSOR, self.DYNAMIC_PER_TOKEN)

    @property
    def is_per_token(self) -> bool:
        return self in (self.STATIC_PER_TOKEN, self.DYNAMIC_PER_TOKEN)


def can_use_dual_gemm(num_tokens: int, hidden_size: int, intermediate_size: int, quant_mode: int) -> bool:
    return False
