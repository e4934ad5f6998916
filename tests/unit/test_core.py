"""The pure core: fold, transitions, and every named invariant."""

import pytest

from pyspark_txn.errors import (
    CheckpointMismatchError,
    FencedError,
    ProtocolViolation,
    TxnError,
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
    abandon,
    allocate,
    bookkeeping_floor,
    check_invariants,
    dead_snapshots,
    decide,
    fold_sink,
    mark_committed,
    pending_phase2,
    record_snapshot,
    summarize,
    take_over,
)
from pyspark_txn.state.events import FORMAT_VERSION

SINK = "s1"


def txn(p=0, rows=3):
    return TxnHandle(partition=p, handle=f"f{p}", rows=rows, bytes=10, checksum="crc32:0")


def record(state, batch_id, snapshot_id=None, epoch=None, offsets=()):
    sid = state.ongoing_snapshot_id if snapshot_id is None else snapshot_id
    return SnapshotRecord(
        token=state.allocations.get(sid, ""),
        source_offsets=offsets,
        sink_id=SINK,
        snapshot_id=sid,
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
    step(events, lambda s: take_over(s, "run-a", None, "q1"))
    for b in range(n):
        step(events, allocate)
        step(events, lambda s, b=b: record_snapshot(s, record(s, b, offsets=({"end": b},))))
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
    step(events, allocate)  # attempt abandoned
    s = step(events, allocate)
    assert s.ongoing_snapshot_id == 2
    s = step(events, lambda s: record_snapshot(s, record(s, 1)))
    assert s.snapshot_id == 2 and s.last_record.batch_id == 1


def test_allocations_carry_unique_tokens():
    events = committed_batches(0)
    step(events, allocate)
    s = step(events, allocate)
    assert len(set(s.allocations.values())) == 2 and all(s.allocations.values())


def test_a_new_run_takes_over_and_fences_the_old_one():
    events = committed_batches(1)
    s = step(events, allocate)
    assert take_over(s, "run-a", s.ongoing_snapshot_id, "q1") is None  # holds it already
    s = step(events, lambda s: take_over(s, "run-b", s.ongoing_snapshot_id, "q1"))
    assert (s.epoch, s.epoch_owner, s.epoch_floor) == (2, "run-b", 1)
    with pytest.raises(FencedError, match="run-a"):
        take_over(s, "run-a", 5, "q1")  # a run that held an epoch never gets it back
    with pytest.raises(FencedError):
        decide(s, 1, 1, 1)  # and its commits are fenced


def test_an_unseen_run_with_an_older_allocation_is_a_zombie():
    """Ids are allocated in time order: an attempt allocated before the owner took over
    belongs to a run that started before it, even if that run never wrote anything."""
    events = committed_batches(1)
    step(events, allocate)  # 1: the zombie's attempt, allocated before run-b existed
    s = step(events, allocate)  # 2
    s = step(events, lambda s: take_over(s, "run-b", 2, "q1"))
    with pytest.raises(FencedError, match="allocated before"):
        take_over(s, "run-z", 1, "q1")
    assert take_over(s, "run-c", 3, "q1").epoch == 3  # a newer run still may


def test_replaced_checkpoint_is_refused():
    events = committed_batches(1)
    _, s = run(events)
    with pytest.raises(CheckpointMismatchError, match="q1"):
        take_over(s, "run-b", 1, "another-query")


def test_decided_batch_is_a_replay():
    events = committed_batches(2)
    s = step(events, allocate)
    d = decide(s, 1, s.ongoing_snapshot_id, 1)
    assert isinstance(d, Replay) and d.record.snapshot_id == 1
    assert isinstance(decide(s, 2, s.ongoing_snapshot_id, 1), Decide)
    with pytest.raises(ProtocolViolation):
        record_snapshot(s, record(s, 1))


def test_a_replay_with_other_offsets_is_refused():
    events = committed_batches(2)
    s = step(events, allocate)
    assert isinstance(decide(s, 1, 2, 1, source_offsets=[{"end": 1}]), Replay)
    with pytest.raises(CheckpointMismatchError, match="reset or replaced") as e:
        decide(s, 1, 2, 1, source_offsets=[{"end": 7}])
    assert "{'end': 1}" in str(e.value) and "{'end': 7}" in str(e.value)


def test_batch_older_than_last_record_without_record_is_refused():
    events = committed_batches(1)
    step(events, allocate)
    step(events, lambda s: record_snapshot(s, record(s, 5)))
    s = step(events, allocate)
    with pytest.raises(CheckpointMismatchError, match="batch 3"):
        decide(s, 3, s.ongoing_snapshot_id, 1)


def test_any_open_allocation_above_the_last_record_may_be_recorded():
    """Allocation is a reservation: a zombie planner allocating after us does not
    stop our record; once ours is recorded, the zombie's lower ids never can be."""
    events = committed_batches(1)
    step(events, allocate)  # 1: ours
    s = step(events, allocate)  # 2: a zombie planner's
    s = step(events, lambda s: record_snapshot(s, record(s, 1, snapshot_id=1)))
    assert s.snapshot_id == 1
    s = step(events, lambda s: record_snapshot(s, record(s, 2, snapshot_id=2)))
    assert s.snapshot_id == 2
    step(events, allocate)  # 3
    s = step(events, allocate)  # 4
    s = step(events, lambda s: record_snapshot(s, record(s, 3, snapshot_id=4)))
    with pytest.raises(ProtocolViolation, match="newer attempt won"):
        decide(s, 4, 3, 1)


def test_dead_snapshots_need_proof_and_are_safe_on_a_stale_state():
    events = committed_batches(1)  # snapshot 0 recorded
    for _ in range(4):
        step(events, allocate)  # 1..4
    s = fold_sink(SINK, events)
    tok = dict(s.allocations)
    staged = {(i, tok[i]) for i in range(5)} | {(3, "someone-else"), (9, "x")}
    # nothing above the last record is provably dead yet (it may still be recorded)
    assert dead_snapshots(s, staged) == set()
    stale = s
    s = step(events, lambda s: record_snapshot(s, record(s, 1, snapshot_id=3)))
    assert dead_snapshots(s, staged) == {(1, tok[1]), (2, tok[2])}
    # the stale state (read before the record) deletes nothing that became live
    assert dead_snapshots(stale, staged) == set()
    s = step(events, lambda s: abandon(s, 4, "aborted"))
    assert dead_snapshots(s, staged) == {(1, tok[1]), (2, tok[2]), (4, tok[4])}


def test_abandon_withdraws_only_undecided_snapshots():
    events = committed_batches(2)
    _, s = run(events)
    with pytest.raises(TxnError, match="committed"):
        abandon(s, 1, "x")
    step(events, allocate)
    s = step(events, lambda s: record_snapshot(s, record(s, 2)))
    assert [r.snapshot_id for r in pending_phase2(s)] == [2]
    s = step(events, lambda s: abandon(s, 2, "target dropped"))
    assert 2 not in {r.snapshot_id for r in s.records.values()} and s.snapshot_id == 1
    assert abandon(s, 2, "again") is None
    with pytest.raises(ProtocolViolation):
        record_snapshot(s, record(s, 2, snapshot_id=2))  # never recorded again
    s = step(events, allocate)
    s = step(events, lambda s: record_snapshot(s, record(s, 2)))  # batch 2 decided anew
    assert s.last_record.snapshot_id == 3 and s.last_record.batch_id == 2


def test_pending_phase2_lists_safe_uncommitted_records():
    events = committed_batches(1)
    step(events, allocate)
    s = step(events, lambda s: record_snapshot(s, record(s, 1)))
    assert [r.snapshot_id for r in pending_phase2(s)] == [1]


def test_the_bookkeeping_floor_stops_at_a_pending_record_and_only_rises():
    """What a target may prune (below the floor) is what retention dropped: never a
    record whose phase 2 is pending, and a stale state's floor is never higher."""
    events = committed_batches(6)
    for batch in (6, 7):  # two safe records whose phase 2 is not confirmed
        step(events, allocate)
        stale = step(events, lambda s, b=batch: record_snapshot(s, record(s, b)))
    assert [r.snapshot_id for r in pending_phase2(stale)] == [6, 7]
    assert bookkeeping_floor(stale) == 0  # nothing summarized yet: the first record
    events.append(summarize(stale, retain_snapshots=1, window_ids=0))
    after = check_invariants(SINK, events)
    assert bookkeeping_floor(after) == 6  # retain=1 alone would keep only 7
    assert bookkeeping_floor(stale) <= bookkeeping_floor(after)
    assert bookkeeping_floor(fold_sink(SINK, [])) is None


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


def test_invariant_record_was_allocated():
    events = committed_batches(1)
    s = fold_sink(SINK, events)
    events.append(record(s, 1, snapshot_id=5).to_event(len(events)))
    _bad(events, Invariant.RECORD_WAS_ALLOCATED)


def test_invariant_abandoned_is_never_recorded():
    events = committed_batches(1)
    events.append(_ev(len(events), EventKind.ALLOCATED, epoch=1, snapshot_id=1))
    events.append(_ev(len(events), EventKind.ABANDONED, epoch=1, snapshot_id=1))
    s = fold_sink(SINK, events)
    events.append(record(s, 1, snapshot_id=1).to_event(len(events)))
    _bad(events, Invariant.RECORD_WAS_ALLOCATED)


def test_invariant_one_writer():
    events = committed_batches(1)
    events.append(_ev(len(events), EventKind.ALLOCATED, epoch=1, snapshot_id=1))
    events.append(_ev(len(events), EventKind.EPOCH, epoch=2, payload={"owner": "b"}))
    s = fold_sink(SINK, events)
    events.append(record(s, 1, snapshot_id=1, epoch=1).to_event(len(events)))
    _bad(events, Invariant.ONE_WRITER)


def test_invariant_abandon_only_undecided():
    events = committed_batches(1)
    events.append(_ev(len(events), EventKind.ABANDONED, epoch=1, snapshot_id=0))
    _bad(events, Invariant.ABANDON_ONLY_UNDECIDED)


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
    bad_state = replace(s, high_water=0)
    e = record(bad_state, 9, snapshot_id=0).to_event(bad_state.next_seq)
    with pytest.raises(ProtocolViolation, match=Invariant.LAST_GOOD_NEVER_REVERTS.value):
        bad_state.apply(e)
