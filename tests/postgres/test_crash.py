"""Exactly-once under crashes at every protocol step: real Spark, real PostgreSQL.

Each case runs the pipeline with a fault at one step (``exit`` kills the
Python process doing that step; ``raise`` fails it), restarts the query on the
same checkpoint, runs it to the end, then counts every row in the table and
checks that no prepared transaction is left. The cases not in the bounded CI
set are marked slow.
"""

import pytest

pytestmark = pytest.mark.spark

FAST = [
    "phase1:exit@snapshot=1@partition=1",
    "after_record:exit@batch=1",
    "mid_phase2:exit@batch=2",
]
SLOW = [
    "phase1:raise@snapshot=2",
    "before_record:exit@batch=1",
    "after_record:raise@batch=3",
    "mid_phase2:raise@batch=1",
    "after_phase2:exit@batch=1",
    "after_commit:exit@batch=1",
    "after_commit:raise@batch=2",
]


@pytest.mark.parametrize("fault", FAST + [pytest.param(f, marks=pytest.mark.slow) for f in SLOW])
def test_crash_then_restart_is_exactly_once(pipeline, fault):
    failure = pipeline.run(fault)
    assert failure is not None, "the injected fault must fail the query"
    assert pipeline.run() is None
    pipeline.assert_exactly_once()
    pipeline.assert_nothing_prepared()
    pipeline.assert_records_consistent()


def test_prepared_transactions_left_by_a_crash_survive_a_server_restart(pipeline):
    """Batch 1 is recorded, batch 2 only prepared, when the query dies; PostgreSQL then
    restarts. Recovery commits the recorded batch's transactions and rolls back the rest."""
    assert pipeline.run("after_record:raise@batch=1") is not None
    prepared = pipeline.query("SELECT gid FROM pg_prepared_xacts")
    assert prepared, "the recorded batch's transactions must still be prepared"
    pipeline.server.restart()
    assert pipeline.query("SELECT gid FROM pg_prepared_xacts") == prepared
    assert pipeline.run() is None
    pipeline.assert_exactly_once()
    pipeline.assert_nothing_prepared()
    pipeline.assert_records_consistent()


@pytest.mark.slow
def test_a_crash_at_every_step_in_one_pipeline(pipeline):
    pipeline.total, pipeline.per_batch = 7000, 1000
    for fault in [
        "after_record:exit@batch=0",
        "mid_phase2:raise@batch=1",
        "phase1:exit@snapshot=4",
        "before_record:raise@batch=3",
        "after_phase2:exit@batch=4",
        "after_commit:exit@batch=5",
    ]:
        assert pipeline.run(fault) is not None, fault
    assert pipeline.run() is None
    pipeline.assert_exactly_once()
    pipeline.assert_nothing_prepared()
    pipeline.assert_records_consistent()
