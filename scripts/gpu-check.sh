#!/usr/bin/env bash
# The GPU checks of the engine (component level, no SGLang), in the order that matters if time runs out:
#   bash scripts/gpu-check.sh OUT_DIR
# 1. tests/gpu: the two-sided loader on CUDA gives a full prefill's KV and logits at every meet point (fp32), and
#    blend and gated sparse loading match a full prefill where exact and the CPU reference where approximate, and at
#    the served 7B MHA / 8B GQA shapes (fp32, stored KV in host memory) are exact where exact, the approximation
#    measured; a layer fetched on the loader's thread is complete before a caller on another stream reads it;
# 2. benchmarks/meet_gpu.py, pages from pinned host memory: 7B MHA, then 8B GQA shapes, 4k-32k tokens (bf16);
# 3. the same with pages read from files on this machine's disk (page cache evicted before every run), 4k and 8k.
# Each step has its own time limit; the JSON is saved after every point, so a step cut short keeps what it measured.
# Logs, JSON and plots land in OUT_DIR. Needs python3 with torch, pytest and matplotlib; not SGLang, nor zlib-ng (the
# engine's page sources raise engine/span_miss.SpanMiss, which needs nothing of the store: tests/unit/test_meet.py).
set -uo pipefail
out=${1:?usage: gpu-check.sh OUT_DIR}
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
mkdir -p "$out"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $py -c 'import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda)'
  nproc; free -g | head -2; df -h /tmp | tail -1; } 2>&1 | tee "$out/env.txt"
step() {  # step SECONDS LOG COMMAND...: run with a time limit, output to the console and OUT_DIR/LOG
    local limit=$1 log=$2; shift 2
    echo "== $* (limit ${limit}s)"
    timeout --signal=INT --kill-after=20 "$limit" "$@" 2>&1 | tee "$out/$log"
    echo "== exit ${PIPESTATUS[0]}"
}
step 180 pytest.txt $py -m pytest -q -p no:cacheprovider tests/gpu
step 190 meet_gpu_mha.txt $py benchmarks/meet_gpu.py --models 7b-mha --name meet_gpu
step 150 meet_gpu_gqa.txt $py benchmarks/meet_gpu.py --models 8b-gqa --name meet_gpu --merge
step 120 meet_gpu_disk.txt $py benchmarks/meet_gpu.py --source disk --lengths 4096 8192 --repeats 2 \
    --name meet_gpu_disk
cp benchmarks/results/meet_gpu.json benchmarks/results/meet_gpu.png benchmarks/results/meet_gpu_disk.json \
    benchmarks/results/meet_gpu_disk.png "$out/" 2>/dev/null
ls -la "$out"
