import pytest
from pipeline_checks import PipelineRunner

import pyspark_txn


@pytest.fixture(scope="session")
def spark():
    session = pyspark_txn.local_session("pyspark-txn-tests")
    yield session
    session.stop()


@pytest.fixture
def pipeline(spark, tmp_path):
    return PipelineRunner(spark, tmp_path)
