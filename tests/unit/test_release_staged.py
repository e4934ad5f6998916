"""``TwoPhaseCommitter.release_staged``: what the planner of a lock-holding target
(PostgreSQL) runs before phase 1, over the in-memory target."""

import pytest
from support import MemoryTarget

from pyspark_txn.faults import FaultPlan, InjectedFault
from pyspark_txn.sinks.twophase import TwoPhaseCommitter
from pyspark_txn.state import MemoryEventLog, RecordStore, TxnHandle

SINK = "s"


def committer_over(store, target, faults=""):
    return TwoPhaseCommitter(
        store, target, SINK, backoff_s=0, faults=FaultPlan.parse(faults), sweep_every=1
    )


def test_release_commits_safe_records_and_withdraws_open_attempts():
    store = RecordStore(MemoryEventLog(), backoff_s=0)
    target = MemoryTarget()
    crashing = committer_over(store, target, "after_record:raise@batch=0")
    recorded = crashing.allocate()
    target.stage(*recorded, "rec", [1, 2])
    with pytest.raises(InjectedFault, match="injected fault at after_record"):
        crashing.commit(0, *recorded, [TxnHandle(0, "rec", 2, 1, "c")], run_id="r1", query_id="q")
    assert 0 in {r.batch_id for r in crashing.load().records.values()}  # recorded, not committed
    assert target.rows == []
    orphan = crashing.allocate()  # the next batch staged, then the driver died
    target.stage(*orphan, "orphan", [99])
    planner = committer_over(store, target)
    planner.release_staged()
    assert target.rows == [1, 2]  # the safe record's phase 2
    assert "orphan" in target.rolled_back and orphan not in target.staged  # withdrawn
    state = planner.load()
    assert orphan[0] in state.abandoned and recorded[0] not in state.abandoned
    # the next batch goes on as usual; a second release changes nothing
    nxt = planner.allocate()
    planner.release_staged()
    target.stage(*nxt, "next", [3])
    planner.commit(1, *nxt, [TxnHandle(0, "next", 1, 1, "c")], run_id="r2", query_id="q")
    assert target.rows == [1, 2, 3]


def test_release_leaves_an_open_attempt_without_staged_data_alone():
    """Only attempts that staged something hold locks; an allocation alone is not touched."""
    store = RecordStore(MemoryEventLog(), backoff_s=0)
    target = MemoryTarget()
    committer = committer_over(store, target)
    sid, _ = committer.allocate()
    committer.release_staged()
    assert sid not in committer.load().abandoned
