#!/usr/bin/env bash
# The PySpark version matrix, after scripts/setup.sh made .venv (PySpark 4.3):
#  - PySpark 4.0 (the oldest supported): a second environment that shares .venv's
#    packages (a .pth file) but has its own PySpark, running a bounded subset of
#    the Spark tests (the sink, crash and type matrix tests; see SUBSET below);
#  - PySpark 3.5 (no Python data source API): `pip install` of this package
#    keeps PySpark 3.5, `import pyspark_txn` works, and `register` raises a
#    SparkFeatureError that names the missing API.
# Environments live in .matrix/ (ignored by git) and are reused between runs.
# Usage: bash scripts/spark_matrix.sh [40|35]...   (default: both)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
PYSPARK_40=${PYSPARK_40:-4.0.5}
PYSPARK_35=${PYSPARK_35:-3.5.7}
SUBSET=(tests/spark/test_sink.py tests/spark/test_crash.py tests/spark/test_types.py
  tests/spark/test_delta_to_delta.py
  "tests/notebooks/test_notebooks.py::test_notebook_runs[01_quickstart]"
  "tests/notebooks/test_notebooks.py::test_notebook_runs[03_crash_and_recover]")
MAIN_PURELIB=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
export SPARK_LOCAL_IP=127.0.0.1
mkdir -p .matrix
status=0

venv_with() {  # venv_with DIR: a venv in DIR (Debian's python3-venv is installed by setup.sh)
  [ -x "$1/bin/python" ] || "$PY" -m venv "$1" || return 1
}

pyspark_is() {  # pyspark_is PYTHON VERSION
  [ "$("$1" -c 'import pyspark; print(pyspark.__version__)' 2>/dev/null)" = "$2" ]
}

matrix_40() {
  local env=.matrix/pyspark40 py
  venv_with "$env" || return 1
  py=$env/bin/python
  local purelib
  purelib=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # everything but PySpark (and py4j) from .venv, behind this environment's own packages;
  # the checkout itself too, for the Python workers Spark starts
  printf '%s\n%s\n' "$ROOT" "$MAIN_PURELIB" >"$purelib/zz_pyspark_txn_main_venv.pth"
  if ! pyspark_is "$py" "$PYSPARK_40"; then
    "$py" -m pip install -q "pyspark==$PYSPARK_40" 2>&1 | grep -v "WARNING: Location" || true
  fi
  pyspark_is "$py" "$PYSPARK_40" || { echo "matrix: PySpark $PYSPARK_40 did not install" >&2; return 1; }
  echo "matrix: PySpark $PYSPARK_40: ${SUBSET[*]} -m 'not slow'" >&2
  PYSPARK_PYTHON="$ROOT/$py" PYSPARK_DRIVER_PYTHON="$ROOT/$py" \
    "$py" -m pytest -p no:cacheprovider -q "${SUBSET[@]}" -m "not slow"
}

matrix_35() {
  local env=.matrix/pyspark35 py
  venv_with "$env" || return 1
  py=$env/bin/python
  if ! pyspark_is "$py" "$PYSPARK_35"; then
    "$py" -m pip install -q "pyspark==$PYSPARK_35" 2>&1 | grep -v "WARNING: Location" || true
  fi
  pyspark_is "$py" "$PYSPARK_35" || { echo "matrix: PySpark $PYSPARK_35 did not install" >&2; return 1; }
  # a plain install, as a user would: no extras, dependencies resolved by pip
  "$py" -m pip install -q "$ROOT" 2>&1 \
    | grep -v "WARNING: Location" || true
  pyspark_is "$py" "$PYSPARK_35" \
    || { echo "matrix: installing pyspark-txn replaced PySpark $PYSPARK_35" >&2; return 1; }
  echo "matrix: PySpark $PYSPARK_35: installed alongside, checking the error" >&2
  (cd .matrix && "../$py" - <<'EOF'
import pyspark

import pyspark_txn
from pyspark_txn.spark.features import missing_features

assert pyspark.__version__.startswith("3.5"), pyspark.__version__
names = [f.name for f in missing_features() if f.required]
assert "the Python data source API" in names, names
try:
    pyspark_txn.register(object())
except pyspark_txn.SparkFeatureError as e:
    msg = str(e)
    assert "the Python data source API" in msg and pyspark.__version__ in msg, msg
    print(f"matrix: PySpark {pyspark.__version__}: SparkFeatureError: {msg}")
else:
    raise SystemExit("register() did not refuse PySpark 3.5")
EOF
  )
}

for which in "${@:-40 35}"; do
  for v in $which; do
    "matrix_$v" || { echo "matrix: PySpark $v FAILED" >&2; status=1; }
  done
done
exit "$status"
