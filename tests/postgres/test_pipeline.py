"""txn-postgres end to end: Spark, the two-phase protocol and a real PostgreSQL."""

import pytest

pytestmark = pytest.mark.spark


def test_a_stream_lands_exactly_once_and_nothing_stays_prepared(pipeline):
    assert pipeline.run(width=2) is None
    pipeline.assert_exactly_once(width=2)
    pipeline.assert_nothing_prepared()
    pipeline.assert_records_consistent()
    # a second run of the same query finds nothing new and writes nothing twice
    assert pipeline.run(width=2) is None
    pipeline.assert_exactly_once(width=2)
