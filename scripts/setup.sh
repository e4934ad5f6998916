#!/usr/bin/env bash
# Set up a development environment on a fresh Debian machine with Python >= 3.10:
# a Java runtime for Spark (from Debian's packages, only where missing), with
# --servers also the servers the tests start, and a virtual environment in .venv
# with pyspark-txn and its extras.
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

apt_install() {
  missing=()
  for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing ${missing[*]} from Debian's packages" >&2
    as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}

if ! command -v java >/dev/null 2>&1; then
  apt_install openjdk-17-jre-headless
fi
# --servers (the test command): the servers the tests start themselves on loopback in
# temp dirs: redis-server (tests/redis/conftest.py) and PostgreSQL's initdb/pg_ctl
# (tests/pg_server.py). The demo needs none of them.
if [ "${1:-}" = "--servers" ]; then
  if ! command -v redis-server >/dev/null 2>&1; then
    apt_install redis-server
  fi
  # javac: tests/spark/test_fast_path_attempts.py compiles a Hadoop committer
  if ! command -v javac >/dev/null 2>&1; then
    apt_install openjdk-17-jdk-headless
  fi
  if ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    apt_install postgresql
  fi
  # Azurite (Azure Blob emulator, tests/objectstore/azurite.py): >= 3.37 (older ones ignore
  # list startFrom and delta-rs fails at the second append); Node >= 18 from Debian.
  AZURITE_DIR=${PYSPARK_TXN_SERVERS:-$HOME/.cache/pyspark-txn-servers}/azurite
  if [ ! -x "$AZURITE_DIR/node_modules/.bin/azurite-blob" ]; then
    command -v npm >/dev/null 2>&1 || apt_install nodejs npm
    mkdir -p "$AZURITE_DIR"
    npm install --prefix "$AZURITE_DIR" --no-audit --no-fund azurite@3.37.0 >/dev/null
  fi
fi

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv || { apt_install python3-venv; "$PYTHON" -m venv .venv; }
fi
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "WARNING: Location" || true
.venv/bin/python -m pip install -q -e '.[spark,connect,dev,redis,postgres]' 2>&1 | grep -v "WARNING: Location" || true
.venv/bin/python -c "import pyspark_txn, pyspark, deltalake, redis, psycopg" \
  || { echo "setup: pyspark-txn did not install" >&2; exit 1; }
