"""A Spark session and txn-postgres pipelines on the throwaway PostgreSQL server."""

import pytest
from pg_pipeline import PgPipeline

import pyspark_txn


@pytest.fixture(scope="session")
def spark():
    session = pyspark_txn.local_session("pyspark-txn-postgres-tests")
    yield session
    session.stop()


@pytest.fixture
def pipeline(spark, tmp_path, pg):
    server, schema = pg
    return PgPipeline(spark, tmp_path, server, schema)
