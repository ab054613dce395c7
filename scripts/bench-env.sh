#!/usr/bin/env bash
# Create .venv-bench/: the environment of SGLang's benchmark client (`python -m sglang.benchmark.serving`), which
# needs Hugging Face `datasets` -- a client-side dependency kept out of the server's .venv. It sees the server's
# packages (SGLang's client code, transformers) through a .pth line; its own site-packages come first, so `datasets`
# and any version it pins differently live only here. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "[bench-env] run scripts/setup.sh first (.venv/ is missing)" >&2; exit 1; }
[ -x .venv-bench/bin/python ] || .venv/bin/python -m venv .venv-bench
purelib() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
site="$(purelib .venv-bench/bin/python)"
purelib .venv/bin/python > "$site/_server_env.pth"
# the server's interpreter-start guard for `import torchvision` on a CPU torch (sglang_tiered_boot.py): SGLang's
# client imports it too; .pth files run in name order, so this one sees the server's packages on the path
cp "$(purelib .venv/bin/python)/sglang_tiered_boot.pth" "$site/"
if ! .venv-bench/bin/python -c "import datasets" 2> /dev/null; then
    echo "[bench-env] installing datasets into .venv-bench (pip's output: .venv-bench/install.log)"
    .venv-bench/bin/python -m pip install --disable-pip-version-check --progress-bar off datasets \
        > .venv-bench/install.log 2>&1 || { tail -n 25 .venv-bench/install.log >&2; exit 1; }
fi
.venv-bench/bin/python -c "import datasets, sglang.benchmark.serving" && echo "[bench-env] .venv-bench ready"
