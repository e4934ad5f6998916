import os
import sys
import tempfile
import uuid

import pytest

# Spark's Python workers must run this interpreter and stay on loopback.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
# Every injected fault that fires appends a line here, in whatever process it fires
# (pyspark_txn.faults): tests prove their fault fired (pipeline_checks.FiredFaults).
# Set before any Spark JVM starts, so that its Python workers and drivers inherit it.
os.environ.setdefault(
    "PYSPARK_TXN_FAULT_LOG",
    os.path.join(tempfile.mkdtemp(prefix="pyspark-txn-faults-"), "fired.log"),
)


@pytest.fixture
def fired_faults():
    """The faults fired from now on (any process), with ``assert_fired(rule)``."""
    from pipeline_checks import FiredFaults

    return FiredFaults()


@pytest.fixture(scope="session")
def postgres_server():
    """A throwaway PostgreSQL cluster (tests/pg_server.py), started on first use only."""
    from pg_server import PostgresServer, pg_bindir

    bindir = pg_bindir()
    if bindir is None:
        pytest.skip(
            "PostgreSQL not found (Debian: apt-get install postgresql; scripts/setup.sh "
            "installs it)"
        )
    pytest.importorskip("psycopg", reason="psycopg missing: pip install 'pyspark-txn[postgres]'")
    server = PostgresServer(bindir)
    yield server
    server.destroy()


@pytest.fixture
def pg(postgres_server):
    """The server and a fresh schema name for this test. A prepared transaction left
    over at the end is a leak: the test fails (after the rollback that keeps the next
    test's server clean), whether or not it called ``assert_nothing_prepared()``."""
    schema = "t_" + uuid.uuid4().hex[:10]
    yield postgres_server, schema
    with postgres_server.connect() as conn:
        leaked = [gid for (gid,) in conn.execute("SELECT gid FROM pg_prepared_xacts").fetchall()]
        for gid in leaked:
            conn.execute(f"ROLLBACK PREPARED '{gid}'")
    if leaked:
        pytest.fail(f"prepared transactions left over by the test: {leaked}", pytrace=False)
