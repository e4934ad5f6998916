"""Planner leases: one ``allocated`` event reserves LEASE_IDS ids, and the next batches of
a query take theirs from the process's lease without writing (docs/protocol.md, "Leases").

A lease is only used while the state read just before says it is still the newest
allocation and the id is above every record and not withdrawn; anything else makes a
new allocation. The parts are the real protocol code over the in-memory event log and
target; ``_LEASES`` is swapped to stand for another process's memory.
"""

import pytest
from support import MemoryTarget

from pyspark_txn.errors import FencedError
from pyspark_txn.sinks import twophase
from pyspark_txn.sinks.twophase import LEASE_IDS, TwoPhaseCommitter
from pyspark_txn.state import (
    Event,
    EventKind,
    MemoryEventLog,
    RecordStore,
    TxnHandle,
    allocate,
    allocated_ids,
    dead_snapshots,
    fold_sink,
)
from pyspark_txn.state.events import FORMAT_VERSION, LEASE_FORMAT
from pyspark_txn.state.records import is_lease_token

SINK = "sink"


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch):
    monkeypatch.setattr(twophase, "_LEASES", {})


def parts():
    store = RecordStore(MemoryEventLog(), backoff_s=0)
    target = MemoryTarget()
    return store, target, TwoPhaseCommitter(store, target, SINK, backoff_s=0)


def commit(committer, target, batch, attempt, run_id="run-1"):
    target.stage(*attempt, f"f-{batch}", [batch])
    return committer.commit(
        batch,
        *attempt,
        [TxnHandle(0, f"f-{batch}", 1, 1, "c")],
        run_id=run_id,
        query_id="q",
        source_offsets=[batch],
    )


def allocations(store):
    return [e for e in store.events(SINK) if e.kind is EventKind.ALLOCATED]


def test_one_event_reserves_the_ids_of_many_batches():
    store, target, committer = parts()
    attempts = []
    for batch in range(LEASE_IDS + 3):
        attempt = committer.allocate()
        attempts.append(attempt)
        commit(committer, target, batch, attempt)
    assert [sid for sid, _ in attempts] == list(range(LEASE_IDS + 3))
    assert len({token for _, token in attempts}) == len(attempts)  # a token per id
    # the first id of a lease is taken at once; the others were reserved ahead
    assert [is_lease_token(t) for _, t in attempts] == [i % LEASE_IDS > 0 for i in range(19)]
    events = allocations(store)
    assert len(events) == 2  # the lease, then the next one when it ran out
    assert [sid for sid, _ in allocated_ids(events[0])] == list(range(LEASE_IDS))
    assert all(e.format_version == LEASE_FORMAT <= FORMAT_VERSION for e in events)
    assert target.rows == list(range(LEASE_IDS + 3))


def test_a_newer_allocation_elsewhere_ends_the_lease():
    """Another process (or an export, or an empty batch's commit) allocated after the
    lease: its ids would no longer be handed out in time order, so a new lease is made."""
    store, target, committer = parts()
    first = committer.allocate()
    commit(committer, target, 0, first)
    other, _ = store.update(SINK, fold_sink, allocate)  # e.g. an export's id
    nxt = committer.allocate()
    assert nxt[0] > other.snapshot_id
    assert len(allocations(store)) == 3
    commit(committer, target, 1, nxt)
    assert target.rows == [0, 1]


def test_two_planner_processes_never_hand_out_an_id_twice(monkeypatch):
    store, target, committer = parts()
    process_a, process_b = {}, {}
    handed = []
    for batch in range(6):
        monkeypatch.setattr(twophase, "_LEASES", process_a if batch % 2 == 0 else process_b)
        attempt = committer.allocate()
        handed.append(attempt[0])
        commit(committer, target, batch, attempt)
    assert handed == sorted(set(handed))  # strictly increasing, never reused
    assert len(allocations(store)) == 6  # alternating processes: a new lease each time
    assert target.rows == list(range(6))


def test_an_aborted_attempt_is_skipped_and_the_lease_goes_on():
    store, target, committer = parts()
    aborted = committer.allocate()
    target.stage(*aborted, "dead", [99])
    committer.abort(*aborted)
    nxt = committer.allocate()
    assert nxt[0] == aborted[0] + 1
    assert len(allocations(store)) == 1
    commit(committer, target, 0, nxt)
    assert target.rows == [0] and "dead" in target.rolled_back


def test_a_leased_id_never_goes_below_a_record(monkeypatch):
    """A process whose lease is older than a record made with an id of another lease
    must not hand out the lower id (the commit would refuse it)."""
    store, target, committer = parts()
    process_a, process_b = {}, {}
    monkeypatch.setattr(twophase, "_LEASES", process_a)
    low = committer.allocate()
    monkeypatch.setattr(twophase, "_LEASES", process_b)
    high = committer.allocate()
    commit(committer, target, 0, high)
    monkeypatch.setattr(twophase, "_LEASES", process_a)
    nxt = committer.allocate()
    assert nxt[0] > high[0] > low[0]
    commit(committer, target, 1, nxt)
    assert target.rows == [0, 1]


def test_a_zombie_with_an_older_leased_id_is_fenced(monkeypatch):
    """Fencing orders runs by the id they take over with: a run holding an id of an old
    lease is fenced once a newer run took over with a newer allocation."""
    store, target, committer = parts()
    old_process, new_process = {}, {}
    monkeypatch.setattr(twophase, "_LEASES", old_process)
    zombie = committer.allocate()  # planned by the old run, which then stalls
    monkeypatch.setattr(twophase, "_LEASES", new_process)
    fresh = committer.allocate()
    commit(committer, target, 0, fresh, run_id="new-run")
    with pytest.raises(FencedError):
        commit(committer, target, 0, zombie, run_id="old-run")
    state = committer.load()
    assert (zombie[0], zombie[1]) in dead_snapshots(state, target.staged_attempts())


def test_a_reserved_id_is_the_record_tables_own():
    """A record table deleted and created again holds other tokens: the lease of the
    old table is never used there."""
    store, target, committer = parts()
    first = committer.allocate()
    commit(committer, target, 0, first)
    # the table's history replaced by one whose ids coincide but whose tokens differ
    other = RecordStore(MemoryEventLog(), backoff_s=0)
    for e in store.events(SINK):
        payload = dict(e.payload)
        if e.kind is EventKind.ALLOCATED:
            payload = {"token": "0000000000"}
        other.log.append(
            Event(
                stream=e.stream,
                seq=e.seq,
                kind=e.kind,
                epoch=e.epoch,
                snapshot_id=e.snapshot_id,
                batch_id=e.batch_id,
                query_id=e.query_id,
                payload=payload if e.kind is EventKind.ALLOCATED else e.payload,
            )
        )
    state = other.load_sink(SINK)
    key = (store.log.memo_key(), SINK)
    assert twophase._take_leased(key, state) is None
    assert key not in twophase._LEASES  # dropped, not retried


def test_a_lease_event_reserves_each_id_with_its_own_token():
    store, _, _ = parts()
    event, state = store.update(SINK, fold_sink, lambda s: allocate(s, count=4))
    ids = allocated_ids(event)
    assert [sid for sid, _ in ids] == [0, 1, 2, 3]
    assert state.ongoing_snapshot_id == 3
    assert dict(state.allocations) == dict(ids)
    single, state = store.update(SINK, fold_sink, allocate)
    assert allocated_ids(single) == [(4, single.payload["token"])]
    assert single.format_version < LEASE_FORMAT  # readers of older versions read it
    with pytest.raises(ValueError):
        allocate(state, token="abc", count=2)
