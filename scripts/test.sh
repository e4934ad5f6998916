#!/usr/bin/env bash
# Set up, start the servers the tests need (none yet: every test runs on local
# Delta tables and a local Spark), lint, and run the whole test suite.
# Exit 5 from pytest (no tests collected) is a failure of the project.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
export PYSPARK_PYTHON="$PWD/.venv/bin/python" PYSPARK_DRIVER_PYTHON="$PWD/.venv/bin/python"
export SPARK_LOCAL_IP=127.0.0.1
.venv/bin/ruff check pyspark_txn tests benchmarks || exit 1
.venv/bin/mypy || exit 1  # the package's types (config in pyproject.toml)
.venv/bin/python -m pytest -p no:cacheprovider "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit "$rc"
