#!/usr/bin/env bash
# Test command: install, lint, then unit tests (no SGLang) and integration tests (real SGLang servers on CPU).
#   bash scripts/test.sh            the full suite (what CI runs)
#   bash scripts/test.sh --quick    unit tests and the fastest server tests (pytest -m "not slow")
# Other arguments go to pytest, e.g. `bash scripts/test.sh tests/unit -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check sglang_tiered tests benchmarks
args=()
for a in "$@"; do
    if [ "$a" = "--quick" ]; then args+=(-m "not slow"); else args+=("$a"); fi
done
exec .venv/bin/python -m pytest -ra -p no:cacheprovider --durations=15 "${args[@]}"
