"""``txn-redis`` -> ``txn-delta`` failing at every protocol step, then restarted.

Each run fails the pipeline at one step of the source's claim/ack protocol or of
the sink's two-phase commit, restarts it (with more messages produced in
between), and counts every message: each exactly once in the target, the
group's pending list empty, every claim in the claim log acknowledged, and
the Delta sink's checks (no orphan or staged file, records consistent).
"""

from __future__ import annotations

import pytest
from test_pipeline import RedisPipeline, assert_all_acked, assert_exactly_once, produce

pytestmark = pytest.mark.spark

# (rule, where it fires). Source rules match the claim number (@batch=N), sink
# rules Spark's batch id; 30 messages at 7 per batch make claims/batches 0..4.
FAULTS = [
    ("before_claim:raise@batch=2", "driver: deliveries taken from Redis, claim not written"),
    ("after_claim:raise@batch=2", "driver: claim safe, offset not returned to Spark"),
    ("phase1:raise", "executor: files staged, commit message not returned"),
    ("before_record:raise@batch=2", "sink: staged files verified, record not written"),
    ("after_record:raise@batch=2", "sink: record safe, Delta commit not made"),
    ("after_phase2:raise@batch=2", "sink: Delta commit made, not confirmed"),
    ("after_commit:raise@batch=2", "sink: committed, Spark's commit log not written"),
    ("before_ack:raise@batch=1", "driver: claims of committed batches not acked"),
    ("mid_ack:raise@batch=1", "driver: half of a committed claim's messages XACKed"),
    ("after_ack:raise@batch=1", "driver: XACKed, 'acked' not in the claim log"),
    ("after_record:exit@batch=2", "the commit's Python worker dies after the record"),
    ("after_claim:exit@batch=2", "the reader's Python process dies after a claim"),
]


# after_claim and after_record are both raised and killed (exit) above: the kill runs in
# the bounded set, the raise only with SLOW=1 (same step, same recovery path).
_SLOW_ONLY = {"after_claim:raise@batch=2", "after_record:raise@batch=2"}


@pytest.mark.parametrize(
    "rule",
    [pytest.param(f, id=f, marks=[pytest.mark.slow] if f in _SLOW_ONLY else []) for f, _ in FAULTS],
)
def test_a_failure_at_each_step_loses_and_duplicates_nothing(
    spark, redis_server, redis_db, tmp_path, fired_faults, rule
):
    p = RedisPipeline(spark, redis_server.url, tmp_path, streams=("orders", "refunds"))
    sent = produce(redis_db, "orders", 20) | produce(redis_db, "refunds", 10)
    failure = p.run(faults=rule, faultInjection=rule)  # the sink's and the source's
    assert failure is not None, f"{rule} never fired"
    fired_faults.assert_fired(rule)  # this fault failed the query, not another failure
    point, _, action = rule.partition("@")[0].partition(":")
    if action == "raise":
        assert f"injected fault at {point}" in str(failure), str(failure)[:3000]
    sent |= produce(redis_db, "orders", 5, start=20)
    assert p.run() is None
    assert_exactly_once(p, sent)
    assert_all_acked(p, redis_db)


def test_the_last_batch_is_acked_when_an_available_now_run_ends(
    spark, redis_server, redis_db, tmp_path
):
    """No restart needed: Spark asks the source once more after the last batch (to
    find that nothing is left), and that call acks the batch it just committed."""
    p = RedisPipeline(spark, redis_server.url, tmp_path)
    sent = produce(redis_db, "orders", 16)
    assert p.run() is None
    assert_exactly_once(p, sent)
    assert_all_acked(p, redis_db)
