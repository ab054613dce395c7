#!/usr/bin/env bash
# On the GPU machine, one run of at most 8 minutes: install the wheels scripts/gpu-wheels.sh fetched (carry
# gpu-wheels), then scripts/gpu_serve.py's serving checks of `--kv-backend tiered` on a dummy 7B-shaped Llama;
# everything lands in OUT (serve.json, the server logs, env.txt, install.txt):
#   bash scripts/gpu-serve.sh OUT [gpu_serve.py arguments, e.g. --shape 8b-gqa --lengths 4096]
# The wheels go into the machine's own Python environment (it is thrown away after the run); nothing the image has is
# replaced but by what gpu-requirements.txt names. PYTHON picks another interpreter (scripts/gpu-rehearse.sh).
set -uo pipefail
out=${1:?usage: gpu-serve.sh OUT [gpu_serve.py arguments]}
shift
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
py=${PYTHON:-python3}
mkdir -p "$out"
tag=$($py -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
  $py -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)'
  nproc; free -g | head -2; df -h /tmp | tail -1; } > "$out/env.txt" 2>&1
cat "$out/env.txt"
if ! $py -m pip install --no-index --no-deps --no-compile --force-reinstall --disable-pip-version-check gpu-wheels/$tag/*.whl \
        > "$out/install.txt" 2>&1; then
    echo "[gpu-serve] installing gpu-wheels/$tag failed:"; tail -20 "$out/install.txt"; exit 1
fi
if ! $py -c "import cutlass" > /dev/null 2>&1; then  # SGLang's SM100-only dual GEMM needs it: a stand-in
    gemm=$($py -c "import importlib.util as u, os; print(os.path.dirname(u.find_spec('sglang').origin))")/kernels/ops/gemm
    cp scripts/gpu_dual_gemm_stub.py "$gemm/cutedsl_dual_gemm.py" && echo "[gpu-serve] no cutlass: $gemm/cutedsl_dual_gemm.py replaced by scripts/gpu_dual_gemm_stub.py"
fi
$py -c "import sglang, sglang_tiered.integration.plugin; print('[gpu-serve] SGLang', sglang.__version__)" 2>&1 \
    | tee -a "$out/install.txt" | tail -3
$py -c "import sgl_kernel; print('[gpu-serve] sgl_kernel', sgl_kernel.__version__, sgl_kernel.__file__)" 2>&1 \
    | tee -a "$out/install.txt" | tail -3
timeout --signal=INT --kill-after=20 "${GPU_SERVE_LIMIT_S:-420}" \
    $py scripts/gpu_serve.py "$out" --tokenizer gpu-wheels/tokenizer "$@" 2>&1 | tee "$out/serve.txt"
exit "${PIPESTATUS[0]}"
