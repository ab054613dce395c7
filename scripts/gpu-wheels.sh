#!/usr/bin/env bash
# Fetch, on this machine, the wheels that SGLang 0.5.23 and sglang-tiered need on the GPU machine beyond its image,
# into gpu-wheels/cpXY/ (ignored by git), small enough to travel with the working tree in one run (at most 55 MiB):
#   bash scripts/gpu-wheels.sh          Python 3.12 builds, for the GPU machine (scripts/gpu-serve.sh installs them)
#   bash scripts/gpu-wheels.sh 3.11     the same versions as cp311 builds, for the rehearsal here (gpu-rehearse.sh)
# The versions are scripts/gpu-requirements.txt's (those the CPU suite runs with). SGLang's wheel is trimmed of what
# a `--kv-backend tiered` server never loads: its Rust server, gRPC, multimodal and benchmark extensions (18 MB) and
# the diffusion runtime `multimodal_gen`. For Python 3.12 SGLang's CUDA kernels come too: sglang-kernel 0.4.5, its
# Python package and Hopper build of common_ops only (0.4.10, SGLang's pin, needs libtorch symbols that torch 2.11
# lacks: docs/gpu.md). Also: this checkout's own wheel, and the embedded model's tokenizer files (a
# `--load-format dummy` server needs a tokenizer, not the 94 MB checkpoint).
set -euo pipefail
cd "$(dirname "$0")/.."
pyver=${1:-3.12}
tag=cp${pyver/./}
out=gpu-wheels/$tag
py=.venv/bin/python
[ -x $py ] || { echo "gpu-wheels: run scripts/setup.sh first (it builds .venv)" >&2; exit 1; }
rm -rf "$out" && mkdir -p "$out"
fetch=($py -m pip download --quiet --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp
       --abi "$tag" --abi abi3 --abi none -d "$out")
for p in manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 any; do
    fetch+=(--platform "$p")
done
echo "[gpu-wheels] downloading $(grep -cv '^#' scripts/gpu-requirements.txt) wheels for Python $pyver"
"${fetch[@]}" -r scripts/gpu-requirements.txt 2> >(grep -v "is ignored: it is neither" >&2)
$py scripts/trim_wheel.py "$out"/sglang-0.5.23-*.whl sglang/multimodal_gen/ sglang/srt/rust_extensions/_server \
    sglang/srt/rust_extensions/_grpc sglang/srt/rust_extensions/_bench sglang/srt/rust_extensions/_multimodal
if [ "$tag" = cp312 ]; then
    "${fetch[@]}" sglang-kernel==0.4.5 2> >(grep -v "is ignored: it is neither" >&2)
    $py scripts/trim_wheel.py "$out"/sglang_kernel-0.4.5-*.whl sgl_kernel/flash_ops sgl_kernel/sm100/ \
        sgl_kernel/infllm_ops sgl_kernel/flashmla_ops
fi
rm -rf build
$py -m pip wheel --quiet --no-deps -w "$out" . > /dev/null
rm -rf build
mkdir -p gpu-wheels/tokenizer
$py -c "import sys; from sglang_tiered.models import copy_tokenizer, default_model_path as m
copy_tokenizer(m(), sys.argv[1])" gpu-wheels/tokenizer
size=$(du -cm --apparent-size "$out" gpu-wheels/tokenizer | tail -1 | cut -f1)
echo "[gpu-wheels] $(ls "$out" | wc -l) wheels in $out; with the tokenizer ${size} MiB"
if [ "$size" -gt 55 ]; then
    echo "[gpu-wheels] more than 55 MiB: a run carries at most 64 MiB with the project" >&2
    exit 1
fi
