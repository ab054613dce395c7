#!/usr/bin/env bash
# Main job: install, then serve the default model with --kv-backend tiered and show device / host / SSD / restart hits.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/sglang-tiered demo --workdir demo-run "$@"
