"""Exactly-once under crashes at every protocol step: real Spark, real Delta tables.

Each case runs the pipeline with a fault at one step (``exit`` kills the
Python process doing that step; ``raise`` fails it), restarts the query on the
same checkpoint, runs it to the end, then compares the target row by row with
the generator's exact output and checks staged files and the record log.
"""

import pytest

pytestmark = pytest.mark.spark

# One case per step in the bounded set; the other action at that step is slow-only here,
# because test_a_crash_at_every_step_in_one_pipeline (bounded) fails each of those
# steps with it: with both, every step is both killed (exit) and failed (raise) in CI.
_SLOW = pytest.mark.slow
CASES = [
    pytest.param("phase1:exit@snapshot=1@partition=1", marks=_SLOW),
    "phase1:raise@snapshot=2",
    "before_record:exit@batch=1",
    pytest.param("before_record:raise@batch=2", marks=_SLOW),
    pytest.param("after_record:exit@batch=1", marks=_SLOW),
    "after_record:raise@batch=3",
    "after_phase2:exit@batch=1",
    pytest.param("after_phase2:raise@batch=2", marks=_SLOW),
    pytest.param("after_commit:exit@batch=1", marks=_SLOW),
    "after_commit:raise@batch=4",
    "allocate:raise",
]


@pytest.mark.parametrize("fault", CASES)
def test_crash_then_restart_is_exactly_once(pipeline, fired_faults, fault):
    failure = pipeline.run(fault)
    assert failure is not None, "the injected fault must fail the query"
    fired_faults.assert_fired(fault)  # this fault failed it, not another failure
    if ":raise" in fault:
        assert f"injected fault at {fault.partition(':')[0]}" in str(failure), str(failure)[:3000]
    assert pipeline.run() is None
    pipeline.assert_exactly_once()
    pipeline.assert_no_orphans()
    pipeline.assert_records_consistent()


def test_a_crash_at_every_step_in_one_pipeline(pipeline, fired_faults):
    pipeline.total, pipeline.per_batch = 6000, 1000
    for fault in [
        "after_record:exit@batch=0",
        "after_phase2:raise@batch=1",
        # snapshot ids depend on timing (leased ids, gaps): aim at the next batch's
        # first partition, whatever its snapshot id, so the fault cannot miss
        "phase1:exit@partition=0",
        "before_record:raise@batch=3",
        "after_commit:exit@batch=4",
    ]:
        assert pipeline.run(fault) is not None, fault
        fired_faults.assert_fired(fault)
    assert pipeline.run() is None
    pipeline.assert_exactly_once()
    pipeline.assert_no_orphans()
    pipeline.assert_records_consistent()
    # five failed attempts left gaps: ids strictly increase but are not dense
    records = pipeline.sink_state().records.values()
    assert max(r.snapshot_id for r in records) > len(records) - 1
