#!/usr/bin/env bash
# Rehearse the GPU machine's install and serving checks on this CPU machine before GPU time is spent (a script, not
# part of the test suite; downloads about 3 GB once):
#   bash scripts/gpu-rehearse.sh OUT
# 1. .venv-gpu/: a fresh environment with torch 2.11.0 (the GPU image's version; PyPI's CUDA build, which runs on a
#    CPU: the CPU-only build's index is not reachable from here) and the image's other packages that SGLang imports,
#    at the image's versions where known (transformers 5.17, tokenizers 0.23.2, ...; numpy 2.5 needs Python 3.12);
# 2. the cp311 builds of gpu-wheels.sh's wheels, installed by gpu-serve.sh with --no-index --no-deps as on the GPU;
# 3. gpu-serve.sh's checks on a scaled-down dummy model (small-mha, 1,024-token prompts) on this CPU.
# What had to change for the GPU machine is in docs/gpu.md.
set -euo pipefail
out=${1:?usage: gpu-rehearse.sh OUT}
cd "$(dirname "$0")/.."
[ -d gpu-wheels/cp311 ] || bash scripts/gpu-wheels.sh 3.11
env=.venv-gpu
image=(torch==2.11.0 torchvision==0.26.0 triton==3.6.0 transformers==5.17.0 tokenizers==0.23.2 huggingface-hub==1.33.0 numpy
       safetensors==0.8.0 accelerate==1.15.0 sentencepiece==0.2.2 tiktoken==0.14.0 aiohttp uvloop msgpack einops
       prometheus-client aiofiles psutil requests pillow tqdm regex pyyaml packaging ninja scipy xxhash anyio httpx
       click typer rich filelock jinja2 networkx sympy fsspec python-dateutil)
stamp="$env/.image-$(echo "${image[*]}" | sha256sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
    rm -rf "$env"
    python3.11 -m venv "$env"
    echo "[gpu-rehearse] the image's packages into $env (once; about 3 GB with torch's CUDA libraries)"
    PIP_CONSTRAINT= "$env/bin/python" -m pip install --quiet --disable-pip-version-check "${image[@]}"
    touch "$stamp"
fi
PYTHON=$PWD/$env/bin/python bash scripts/gpu-serve.sh "$out" --shape small-mha --lengths 1024
