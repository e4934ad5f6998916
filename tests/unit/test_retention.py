"""Bounded history: summaries restate the fold, older events go, invariants hold."""

from dataclasses import replace

import pytest
from support import MemoryTarget

from pyspark_txn.errors import FencedError, ProtocolViolation, TxnError
from pyspark_txn.faults import InjectedFault
from pyspark_txn.sinks import twophase
from pyspark_txn.sinks.twophase import LEASE_IDS, TwoPhaseCommitter
from pyspark_txn.state import (
    EventKind,
    MemoryEventLog,
    RecordStore,
    TxnHandle,
    bookkeeping_floor,
    fold_sink,
    summarize,
)

SINK = "sink"


def run_batches(committer, target, batches, start=0, run_id="run-1"):
    for batch in range(start, start + batches):
        attempt = committer.allocate()
        if batch % 5 == 2:  # an aborted attempt now and then
            committer.abort(*attempt)
            attempt = committer.allocate()
        target.stage(*attempt, f"f-{batch}", [batch])
        committer.commit(
            batch,
            *attempt,
            [TxnHandle(0, f"f-{batch}", 1, 1, "c")],
            run_id=run_id,
            query_id="q",
            source_offsets=[batch],
        )


@pytest.fixture
def sink():
    store = RecordStore(MemoryEventLog(), backoff_s=0)
    target = MemoryTarget()
    committer = TwoPhaseCommitter(
        store, target, SINK, backoff_s=0, retain_snapshots=3, summary_window_ids=4
    )
    return store, target, committer


def test_history_stays_bounded_and_the_table_complete(sink):
    store, target, committer = sink
    sizes = []
    for block in range(6):
        run_batches(committer, target, 50, start=block * 50)
        state = store.load_sink(SINK)
        sizes.append((len(store.events(SINK)), len(state.records), len(state.allocations)))
    assert target.rows == list(range(300))
    # events since the last summary, and what a summary keeps: never more than a bound
    # (a batch appends one event, its record: the planner takes its id from a lease of
    # LEASE_IDS ids reserved by one event, and the reserved ids are kept allocations)
    assert max(n for n, _, _ in sizes) <= 2 * 3 + 4 + 4
    assert max(r for _, r, _ in sizes) <= 2 * 3 + 4 + 4
    assert max(a for _, _, a in sizes) <= 2 * 3 + 4 + 4 + LEASE_IDS
    assert store.events(SINK)[0].seq > 0  # older events were deleted


def test_each_summary_prunes_the_targets_bookkeeping_below_the_oldest_kept_record(sink):
    store, target, committer = sink
    run_batches(committer, target, 120)
    state = store.load_sink(SINK)
    assert len(target.pruned) > 1 and target.pruned == sorted(target.pruned)
    # no summary since the last prune: the records then are the records now
    assert (
        target.pruned[-1]
        == bookkeeping_floor(state)
        == min(r.snapshot_id for r in state.records.values())
    )
    assert target.rows == list(range(120))


def test_a_fold_from_the_summary_equals_the_fold_through_it(sink):
    store, target, committer = sink
    run_batches(committer, target, 12)
    state = store.load_sink(SINK)
    summary = summarize(state, 3, 4)
    through = state.apply(summary)
    fresh = fold_sink(SINK, [summary])
    for name in (
        "next_seq",
        "epoch",
        "epoch_owner",
        "epoch_floor",
        "owners",
        "query_id",
        "ongoing_snapshot_id",
        "allocations",
        "records",
        "last_record",
        "high_water",
        "abandoned",
        "committed",
        "summary_seq",
    ):
        assert getattr(through, name) == getattr(fresh, name), name
    assert summary.format_version == 2  # readers that predate summaries refuse them


def test_ids_are_never_reused_and_old_runs_stay_fenced_after_retention(sink, monkeypatch):
    store, target, committer = sink
    run_batches(committer, target, 20, run_id="old-run")
    run_batches(committer, target, 20, start=20, run_id="new-run")
    state = store.load_sink(SINK)
    assert store.events(SINK)[0].kind is EventKind.SUMMARY
    highest = state.ongoing_snapshot_id
    monkeypatch.setattr(twophase, "_LEASES", {})  # a new process: no ids reserved ahead
    sid, token = committer.allocate()
    assert sid == highest + 1
    target.stage(sid, token, "zombie", [999])
    with pytest.raises(FencedError):
        committer.commit(
            40, sid, token, [TxnHandle(0, "zombie", 1, 1, "c")], run_id="old-run", query_id="q"
        )


def test_a_summary_that_misstates_the_fold_is_refused(sink):
    store, target, committer = sink
    run_batches(committer, target, 6)
    state = store.load_sink(SINK)
    summary = summarize(state, 3, 4)
    wrong = replace(summary, payload={**summary.payload, "high_water": state.high_water - 1})
    with pytest.raises(ProtocolViolation, match="summary"):
        state.apply(wrong)


def test_a_replay_of_the_last_batch_after_retention_is_still_a_replay(sink):
    store, target, committer = sink
    run_batches(committer, target, 30)
    before = len(target.rows)
    attempt = committer.allocate()
    target.stage(*attempt, "again", [29])
    rec = committer.commit(
        29,
        *attempt,
        [TxnHandle(0, "again", 1, 1, "c")],
        run_id="run-1",
        query_id="q",
        source_offsets=[29],
    )
    assert rec.batch_id == 29 and rec.snapshot_id != attempt[0]
    assert len(target.rows) == before and "again" in target.rolled_back


def _named(state, name, sid):
    from pyspark_txn.state.core import NamedSnapshot

    return NamedSnapshot(name, sid, state.snapshot_id, 0, f"/exports/{name}", 0, {"rows": 1})


def test_named_snapshots_are_unique_own_ids_and_survive_summaries(sink):
    from pyspark_txn.state import allocate
    from pyspark_txn.state.core import delete_named, register_named

    store, target, committer = sink
    run_batches(committer, target, 3)
    event, state = store.update(SINK, fold_sink, allocate)
    sid = event.snapshot_id
    _, state = store.update(SINK, fold_sink, lambda s: register_named(s, _named(s, "n", sid)))
    assert state.named["n"].snapshot_id == sid
    with pytest.raises(Exception, match="exists"):
        register_named(state, _named(state, "n", sid))
    # the event itself is refused by the fold: unique names, an id of its own
    duplicate = register_named(replace(state, named={}), _named(state, "n", sid))
    with pytest.raises(ProtocolViolation, match="already registered"):
        state.apply(duplicate)
    recorded = state.last_record.snapshot_id
    with pytest.raises(TxnError, match="a snapshot record of the sink uses it"):
        register_named(state, _named(state, "m", recorded))  # the transition refuses it
    stolen = replace(duplicate, snapshot_id=recorded, payload={**duplicate.payload, "name": "m"})
    stolen = replace(stolen, payload={**stolen.payload, "snapshot_id": recorded})
    with pytest.raises(ProtocolViolation, match="not allocated for it"):
        state.apply(stolen)  # and so does the fold
    # summaries keep the registry; deleting frees the name
    run_batches(committer, target, 30, start=3)
    state = store.load_sink(SINK)
    assert store.events(SINK)[0].kind is EventKind.SUMMARY and "n" in state.named
    _, state = store.update(SINK, fold_sink, lambda s: delete_named(s, "n"))
    assert state.named == {} and fold_sink(SINK, store.events(SINK)).named == {}


def test_export_requests_are_served_at_the_next_commit_and_survive_summaries(sink):
    from pyspark_txn.state import allocate
    from pyspark_txn.state.core import fail_export, register_named, request_export

    store, target, committer = sink
    served = []

    def serve(state, record, version):
        """What the Delta sink does, minus the copy: an own id, then the entry."""
        for name in sorted(state.export_requests):
            served.append((name, record.batch_id))
            if name.startswith("bad"):
                store.update(SINK, fold_sink, lambda s, n=name: fail_export(s, n, "disk full"))
                continue
            event, _ = store.update(SINK, fold_sink, allocate)
            entry = replace(_named(state, name, event.snapshot_id), batch_id=record.batch_id)
            store.update(SINK, fold_sink, lambda s, e=entry: register_named(s, e))

    committer.serve_exports = serve
    run_batches(committer, target, 2)
    _, state = store.update(SINK, fold_sink, lambda s: request_export(s, "next", "/x/next"))
    _, state = store.update(SINK, fold_sink, lambda s: request_export(s, "bad", "/x/bad"))
    assert set(state.export_requests) == {"next", "bad"}
    with pytest.raises(Exception, match="already requested"):
        request_export(state, "next", "/x/other")
    with pytest.raises(ProtocolViolation, match="requested while taken"):
        state.apply(request_export(replace(state, export_requests={}), "next", "/x/next"))
    # a summary between the request and the commit keeps it
    committer._summarize(state)
    assert set(store.load_sink(SINK).export_requests) == {"next", "bad"}
    run_batches(committer, target, 1, start=2)
    state = store.load_sink(SINK)
    assert served == [("bad", 2), ("next", 2)]
    assert state.named["next"].batch_id == 2 and not state.export_requests
    assert state.export_failures == {"bad": "disk full"}
    with pytest.raises(Exception, match="exists"):
        request_export(state, "next", "/x/next")
    # a new request of a failed name starts over; a failing server never fails a batch
    _, state = store.update(SINK, fold_sink, lambda s: request_export(s, "bad", "/x/bad"))
    assert "bad" not in state.export_failures

    def broken(state, record, version):
        raise OSError("exporter crashed")

    committer.serve_exports = broken
    run_batches(committer, target, 30, start=3)
    state = store.load_sink(SINK)
    assert target.rows == list(range(33)) and "bad" in state.export_requests
    assert store.events(SINK)[0].kind is EventKind.SUMMARY
    assert fold_sink(SINK, store.events(SINK)).export_requests.keys() == {"bad"}


def test_settle_takes_the_sink_and_rolls_back_the_stopped_runs_attempts(sink):
    store, target, committer = sink
    run_batches(committer, target, 3)
    # a batch the "stopped" query staged but never recorded, and one recorded but
    # never committed (stopped between its record and phase 2)
    recorded = committer.allocate()
    target.stage(*recorded, "f-3", [3])
    committer.faults = _fail_after_record()
    with pytest.raises(InjectedFault):
        committer.commit(
            3, *recorded, [TxnHandle(0, "f-3", 1, 1, "c")], run_id="run-1", query_id="q"
        )
    committer.faults = _no_faults()
    orphan = committer.allocate()
    target.stage(*orphan, "f-4", [4])
    state = committer.settle("stop_and_export test")
    assert target.rows == [0, 1, 2, 3]  # the safe record was finished
    # nothing staged is left but what records name (committed files live there)
    assert "f-4" in target.rolled_back
    assert {sid for sid, _ in target.staged_attempts()} <= {
        r.snapshot_id for r in state.records.values()
    }
    assert orphan[0] in state.abandoned and state.epoch_owner.startswith("settle-")
    # the stopped run is fenced; a new run takes over and goes on
    with pytest.raises(FencedError):
        committer.commit(4, *orphan, [], run_id="run-1", query_id="q")
    run_batches(committer, target, 2, start=4, run_id="run-2")
    assert target.rows == list(range(6))


def _fail_after_record():
    from pyspark_txn.faults import FaultPlan

    return FaultPlan.parse("after_record:raise")


def _no_faults():
    from pyspark_txn.faults import NO_FAULTS

    return NO_FAULTS
