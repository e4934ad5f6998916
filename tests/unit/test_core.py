"""The pure core: fold, transitions, and every named invariant."""

import pytest

from pyspark_txn.errors import (
    CheckpointMismatchError,
    FencedError,
    ProtocolViolation,
    UnsupportedFormatVersion,
)
from pyspark_txn.state import (
    NO_SNAPSHOT,
    Decide,
    Event,
    EventKind,
    Invariant,
    Replay,
    SnapshotKind,
    SnapshotRecord,
    TxnHandle,
    allocate,
    begin_epoch,
    check_invariants,
    decide,
    fold_sink,
    mark_committed,
    orphan_snapshot_ids,
    pending_phase2,
    record_snapshot,
)
from pyspark_txn.state.events import FORMAT_VERSION

SINK = "s1"


def txn(p=0, rows=3):
    return TxnHandle(partition=p, handle=f"f{p}", rows=rows, bytes=10, checksum="crc32:0")


def record(state, batch_id, snapshot_id=None, epoch=None):
    return SnapshotRecord(
        sink_id=SINK,
        snapshot_id=state.ongoing_snapshot_id if snapshot_id is None else snapshot_id,
        batch_id=batch_id,
        epoch=state.epoch if epoch is None else epoch,
        kind=SnapshotKind.AUTOMATIC,
        txns=(txn(0), txn(1, 4)),
    )


def run(events=None):
    """Fold ``events`` (or a fresh log) and return (events, state)."""
    events = list(events or [])
    return events, fold_sink(SINK, events)


def step(events, transition):
    state = fold_sink(SINK, events)
    e = transition(state)
    events.append(e)
    return fold_sink(SINK, events)


def committed_batches(n):
    events, _ = run()
    step(events, lambda s: begin_epoch(s, "owner-a", "q1"))
    for b in range(n):
        step(events, lambda s: allocate(s, s.epoch))
        step(events, lambda s, b=b: record_snapshot(s, record(s, b)))
        step(events, lambda s, b=b: mark_committed(s, s.snapshot_id, b + 10))
    return events


def test_empty_state_has_no_snapshot():
    _, s = run()
    rec = s.execution_record
    assert (rec.epoch, rec.snapshot_id, rec.ongoing_snapshot_id) == (0, NO_SNAPSHOT, NO_SNAPSHOT)
    assert rec.last_committed_batch_id is None


def test_happy_path_builds_execution_record():
    events = committed_batches(3)
    s = check_invariants(SINK, events)
    rec = s.execution_record
    assert rec.epoch == 1 and rec.snapshot_id == 2 and rec.ongoing_snapshot_id == 2
    assert rec.last_committed_batch_id == 2 and rec.query_id == "q1"
    assert s.records[1].rows == 7
    assert s.committed == {0: 10, 1: 11, 2: 12}
    assert pending_phase2(s) == []


def test_ids_never_reused_after_failed_attempts():
    events = committed_batches(1)
    s = step(events, lambda s: allocate(s, 1))  # attempt abandoned
    s = step(events, lambda s: allocate(s, 1))
    assert s.ongoing_snapshot_id == 2
    s = step(events, lambda s: record_snapshot(s, record(s, 1)))
    assert s.snapshot_id == 2 and s.last_record.batch_id == 1


def test_new_epoch_fences_old_run():
    events = committed_batches(1)
    step(events, lambda s: begin_epoch(s, "owner-b", "q1"))
    _, s = run(events)
    with pytest.raises(FencedError, match="epoch 2"):
        allocate(s, 1)
    with pytest.raises(FencedError):
        decide(s, 1, 0, 1)


def test_replaced_checkpoint_is_refused():
    events = committed_batches(1)
    _, s = run(events)
    with pytest.raises(CheckpointMismatchError, match="q1"):
        begin_epoch(s, "owner-b", "another-query")


def test_decided_batch_is_a_replay():
    events = committed_batches(2)
    s = step(events, lambda s: allocate(s, 1))
    d = decide(s, 1, s.ongoing_snapshot_id, 1)
    assert isinstance(d, Replay) and d.record.snapshot_id == 1
    assert isinstance(decide(s, 2, s.ongoing_snapshot_id, 1), Decide)
    with pytest.raises(ProtocolViolation):
        record_snapshot(s, record(s, 1))


def test_batch_older_than_last_record_without_record_is_refused():
    events = committed_batches(1)
    step(events, lambda s: allocate(s, 1))
    step(events, lambda s: record_snapshot(s, record(s, 5)))
    s = step(events, lambda s: allocate(s, 1))
    with pytest.raises(CheckpointMismatchError, match="batch 3"):
        decide(s, 3, s.ongoing_snapshot_id, 1)


def test_only_the_latest_allocation_may_be_recorded():
    events = committed_batches(1)
    step(events, lambda s: allocate(s, 1))
    s = step(events, lambda s: allocate(s, 1))
    with pytest.raises(ProtocolViolation, match="at most one snapshot"):
        record_snapshot(s, record(s, 1, snapshot_id=1))


def test_orphans_exclude_recorded_and_in_flight():
    events = committed_batches(2)
    _, s = run(events)
    assert orphan_snapshot_ids(s, {0, 1, 2, 3, 7}, in_flight=7) == {2, 3}


def test_pending_phase2_lists_safe_uncommitted_records():
    events = committed_batches(1)
    step(events, lambda s: allocate(s, 1))
    s = step(events, lambda s: record_snapshot(s, record(s, 1)))
    assert [r.snapshot_id for r in pending_phase2(s)] == [1]


def test_event_rows_round_trip():
    events = committed_batches(1)
    for e in events:
        assert Event.from_row(e.to_row()) == e


def test_newer_format_version_is_refused():
    row = committed_batches(1)[0].to_row()
    row["format_version"] = FORMAT_VERSION + 1
    with pytest.raises(UnsupportedFormatVersion, match="upgrade"):
        Event.from_row(row)


# --- every invariant is detected when a log breaks it -----------------------


def _bad(events, invariant):
    with pytest.raises(ProtocolViolation) as exc:
        check_invariants(SINK, events)
    assert invariant.value in str(exc.value)


def _ev(seq, kind, **kw):
    return Event(stream=SINK, seq=seq, kind=kind, **kw)


def test_invariant_seq_gap_free():
    events = committed_batches(1)
    del events[2]
    _bad(events, Invariant.SEQ_GAP_FREE)


def test_invariant_epochs_increase():
    events = committed_batches(1)
    events.append(_ev(len(events), EventKind.EPOCH, epoch=1, payload={"owner": "x"}))
    _bad(events, Invariant.EPOCHS_INCREASE)


def test_invariant_ids_strictly_increase():
    events = committed_batches(2)
    events.append(_ev(len(events), EventKind.ALLOCATED, epoch=1, snapshot_id=1))
    _bad(events, Invariant.IDS_STRICTLY_INCREASE)


def test_invariant_record_was_allocated_by_same_epoch():
    events = committed_batches(1)
    events.append(_ev(len(events), EventKind.ALLOCATED, epoch=1, snapshot_id=1))
    events.append(_ev(len(events), EventKind.EPOCH, epoch=2, payload={"owner": "b"}))
    s = fold_sink(SINK, events)
    events.append(record(s, 1, snapshot_id=1, epoch=2).to_event(len(events)))
    _bad(events, Invariant.RECORD_WAS_ALLOCATED)


def test_invariant_one_in_progress():
    events = committed_batches(1)
    events.append(_ev(len(events), EventKind.ALLOCATED, epoch=1, snapshot_id=1))
    events.append(_ev(len(events), EventKind.ALLOCATED, epoch=1, snapshot_id=2))
    s = fold_sink(SINK, events)
    events.append(record(s, 1, snapshot_id=1).to_event(len(events)))
    _bad(events, Invariant.ONE_IN_PROGRESS)


def test_invariant_one_record_per_batch():
    events = committed_batches(2)
    events.append(_ev(len(events), EventKind.ALLOCATED, epoch=1, snapshot_id=2))
    s = fold_sink(SINK, events)
    events.append(record(s, 1, snapshot_id=2).to_event(len(events)))
    _bad(events, Invariant.ONE_RECORD_PER_BATCH)


def test_invariant_commit_after_safe_record():
    events = committed_batches(1)
    events.append(_ev(len(events), EventKind.ALLOCATED, epoch=1, snapshot_id=1))
    events.append(_ev(len(events), EventKind.COMMITTED, epoch=1, snapshot_id=1))
    _bad(events, Invariant.COMMIT_AFTER_SAFE_RECORD)


def test_invariant_last_good_never_reverts():
    # A record whose id is not above the last good one: only reachable by a
    # forged log, since allocation already forbids it.
    from dataclasses import replace

    s = fold_sink(SINK, committed_batches(2))
    bad_state = replace(s, ongoing_snapshot_id=0, ongoing_epoch=1)
    e = record(bad_state, 9, snapshot_id=0).to_event(bad_state.next_seq)
    with pytest.raises(ProtocolViolation, match=Invariant.LAST_GOOD_NEVER_REVERTS.value):
        bad_state.apply(e)
