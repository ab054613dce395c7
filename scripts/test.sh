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
# Two workers (pytest-xdist; tests/conftest.py makes the work units, the longest first) and torch on one thread
# in every process: on 2 cores two servers with torch's two threads each spin against each other (the same requests
# took 225 s on two servers at once, 30 s on one after the other, 20 s at once with one thread each).
# TEST_WORKERS=0: one process.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/python -m pytest -n "${TEST_WORKERS:-2}" --no-loadscope-reorder -ra -p no:cacheprovider \
    --durations=15 "${args[@]}"
