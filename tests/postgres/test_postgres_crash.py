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
def test_crash_then_restart_is_exactly_once(pipeline, fired_faults, fault):
    failure = pipeline.run(fault)
    assert failure is not None, "the injected fault must fail the query"
    fired_faults.assert_fired(fault)  # this fault failed it, not another failure
    if ":raise" in fault:
        assert f"injected fault at {fault.partition(':')[0]}" in str(failure), str(failure)[:3000]
    assert pipeline.run() is None
    pipeline.assert_exactly_once()
    pipeline.assert_nothing_prepared()
    pipeline.assert_records_consistent()


def test_prepared_transactions_left_by_a_crash_survive_a_server_restart(pipeline, fired_faults):
    """Batch 1 is recorded but not committed when the query dies; PostgreSQL then
    restarts. Its two prepared transactions survive and recovery commits them (the
    unrecorded case after a restart: test_postgres_target.py)."""
    assert pipeline.run("after_record:raise@batch=1") is not None
    fired_faults.assert_fired("after_record:raise@batch=1")
    prepared = pipeline.query("SELECT gid FROM pg_prepared_xacts ORDER BY gid")
    assert len(prepared) == 2, "the recorded batch's two transactions must still be prepared"
    pipeline.server.restart()
    assert pipeline.query("SELECT gid FROM pg_prepared_xacts ORDER BY gid") == prepared
    assert pipeline.run() is None
    pipeline.assert_exactly_once()
    pipeline.assert_nothing_prepared()
    pipeline.assert_records_consistent()


@pytest.mark.slow
def test_a_crash_at_every_step_in_one_pipeline(pipeline, fired_faults):
    pipeline.total, pipeline.per_batch = 7000, 1000
    for fault in [
        "after_record:exit@batch=0",
        "mid_phase2:raise@batch=1",
        "phase1:exit@partition=0",  # the next batch, whatever its snapshot id
        "before_record:raise@batch=3",
        "after_phase2:exit@batch=4",
        "after_commit:exit@batch=5",
    ]:
        assert pipeline.run(fault) is not None, fault
        fired_faults.assert_fired(fault)
    assert pipeline.run() is None
    pipeline.assert_exactly_once()
    pipeline.assert_nothing_prepared()
    pipeline.assert_records_consistent()


def test_a_replayed_batch_is_not_staged_again_into_a_table_with_a_primary_key(
    pipeline, fired_faults
):
    """Crashes after the record and after phase 2: Spark replays those batches, whose
    rows the table has (or gets from the record). The planner sees the replay and the
    tasks stage nothing, so the primary key never meets a row twice."""
    with pipeline.server.connect() as conn:
        conn.execute(f"CREATE SCHEMA {pipeline.schema}")
        conn.execute(f"CREATE TABLE {pipeline.table} (id bigint PRIMARY KEY, value bigint)")
    for fault in ("after_record:exit@batch=1", "after_commit:raise@batch=3"):
        assert pipeline.run(fault) is not None, fault
        fired_faults.assert_fired(fault)
    assert pipeline.run() is None
    pipeline.assert_exactly_once()
    pipeline.assert_nothing_prepared()
    pipeline.assert_records_consistent()
