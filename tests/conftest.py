import os
import sys
import uuid

import pytest

# Spark's Python workers must run this interpreter and stay on loopback.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


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
    """The server, a fresh schema name for this test, and no prepared transaction left over."""
    schema = "t_" + uuid.uuid4().hex[:10]
    yield postgres_server, schema
    with postgres_server.connect() as conn:
        for (gid,) in conn.execute("SELECT gid FROM pg_prepared_xacts").fetchall():
            conn.execute(f"ROLLBACK PREPARED '{gid}'")
