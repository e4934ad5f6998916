#!/usr/bin/env bash
# Set up, then run the main demo on embedded defaults (local Delta tables in ./demo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/pyspark-txn demo --dir "${DEMO_DIR:-./demo}" "$@"
