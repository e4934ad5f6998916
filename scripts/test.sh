#!/usr/bin/env bash
# Set up, lint, and run the whole test suite; the fixtures start the servers the
# tests need (redis-server, PostgreSQL: Debian's packages, installed by setup.sh)
# on loopback in temp dirs. Then the PySpark version matrix (scripts/spark_matrix.sh).
# Exit 5 from pytest (no tests collected) is a failure of the project.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --servers || exit 1
export PYSPARK_PYTHON="$PWD/.venv/bin/python" PYSPARK_DRIVER_PYTHON="$PWD/.venv/bin/python"
export SPARK_LOCAL_IP=127.0.0.1
.venv/bin/ruff check pyspark_txn tests benchmarks notebooks || exit 1
.venv/bin/ruff format --check pyspark_txn tests benchmarks notebooks || exit 1
.venv/bin/mypy || exit 1  # the package's types (config in pyproject.toml)
# Every test but those marked slow (the long crash matrices and repeated kill -9 soaks,
# ~10 min more): CI runs this bounded set. SLOW=1 runs them too.
bounded=(-m "not slow")
[ "${SLOW:-0}" = 1 ] && bounded=()
# --durations=25: the slowest tests in every CI log, to keep the bounded set in check
.venv/bin/python -m pytest -p no:cacheprovider --durations=25 "${bounded[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests: that is a failure" >&2
  exit 1
fi
# The PySpark version matrix (4.0 subset, 3.5 refused clearly) with the full run only:
# arguments select tests of the default environment. SPARK_MATRIX=0 skips it.
if [ $# -eq 0 ] && [ "${SPARK_MATRIX:-1}" != 0 ]; then
  bash scripts/spark_matrix.sh || { [ "$rc" -ne 0 ] || rc=1; }
fi
exit "$rc"
