#!/usr/bin/env bash
# Test command: install, lint, then unit tests (no SGLang) and integration tests (real SGLang servers on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check sglang_tiered tests benchmarks
.venv/bin/python -m pytest -ra -p no:cacheprovider "$@"
