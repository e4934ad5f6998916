"""Planner leases: one ``allocated`` event reserves LEASE_IDS ids, and the next batches of
a query take theirs from the process's lease without writing (docs/protocol.md, "Leases").

A lease is only used while the state read just before says it is still the newest
allocation and the id is above every record and not withdrawn; anything else makes a
new allocation. The parts are the real protocol code over the in-memory event log and
target; ``_LEASES`` is swapped to stand for another process's memory.
"""

import pytest
from support import MemoryTarget

from pyspark_txn.errors import CheckpointMismatchError, FencedError
from pyspark_txn.faults import FaultPlan, InjectedFault
from pyspark_txn.sinks import twophase
from pyspark_txn.sinks.twophase import TwoPhaseCommitter
from pyspark_txn.state import (
    DeltaEventLog,
    Event,
    EventKind,
    MemoryEventLog,
    RecordStore,
    TxnHandle,
    allocate,
    allocated_ids,
    dead_snapshots,
    fold_sink,
    settled,
)
from pyspark_txn.state.core import SETTLE_IDS
from pyspark_txn.state.events import FORMAT_VERSION, LEASE_FORMAT
from pyspark_txn.state.records import (
    FOREIGN_LEASE_TOKEN,
    is_lease_token,
    lease_token_binds,
    new_lease_token,
)

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
    for batch in range(40):
        attempt = committer.allocate()
        attempts.append(attempt)
        commit(committer, target, batch, attempt)
    assert [sid for sid, _ in attempts] == list(range(40))
    assert len({token for _, token in attempts}) == len(attempts)  # a token per id
    events = allocations(store)
    # leases double while they are used up, to LEASE_IDS
    assert [len(allocated_ids(e)) for e in events] == [2, 4, 8, 16, 16]
    firsts = {e.snapshot_id for e in events}
    # the first id of a lease is taken at once; the others were reserved ahead
    assert [is_lease_token(t) for s, t in attempts] == [s not in firsts for s, _ in attempts]
    assert all(e.format_version == LEASE_FORMAT <= FORMAT_VERSION for e in events)
    assert target.rows == list(range(40))


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
        if e.kind is EventKind.ALLOCATED:  # as many ids, other tokens
            tokens = ["0000000000"] + [f"r{i:09d}" for i in range(1, len(allocated_ids(e)))]
            payload = {"token": tokens[0], "tokens": tokens}
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
    key = (store.log.location(), SINK)
    assert twophase._take_leased(key, state) is None
    assert not twophase._LEASES[key].ids  # dropped, not retried


def test_a_lease_event_reserves_each_id_with_its_own_token():
    store, _, _ = parts()
    event, state = store.update(
        SINK, fold_sink, lambda s: allocate(s, count=4, table=store.log.location())
    )
    ids = allocated_ids(event)
    assert [sid for sid, _ in ids] == [0, 1, 2, 3]
    assert state.ongoing_snapshot_id == 3
    assert dict(state.allocations) == dict(ids)
    single, state = store.update(SINK, fold_sink, allocate)
    assert allocated_ids(single) == [(4, single.payload["token"])]
    assert single.format_version < LEASE_FORMAT  # readers of older versions read it
    with pytest.raises(ValueError):
        allocate(state, token="abc", count=2)


# --- found by the session-11 trial (a copied checkpoint, a pool of planner workers) ---


def original_sink(monkeypatch):
    """Two processes' lease memories, a target, and the original sink planned in the first."""
    process_o, process_c = {}, {}
    target = MemoryTarget()
    store_o = RecordStore(MemoryEventLog(), backoff_s=0)
    original = TwoPhaseCommitter(store_o, target, SINK, backoff_s=0)
    monkeypatch.setattr(twophase, "_LEASES", process_o)
    return process_o, process_c, target, store_o, original


def copy_of(store):
    """The record table as a copied checkpoint holds it (cp -r): same events, other place."""
    other = RecordStore(MemoryEventLog(), backoff_s=0)
    for e in store.events(SINK):
        other.log.append(e)
    return other


def test_a_copied_checkpoint_never_withdraws_the_originals_recorded_attempt(monkeypatch):
    """The copy holds the tokens of the ids the original reserved ahead; they are bound to
    the original's location, so the copy's planner (release_staged: PostgreSQL) does not
    roll back an attempt the original recorded and has not committed yet."""
    process_o, process_c, target, store_o, original = original_sink(monkeypatch)
    for batch in range(3):  # leases of 2, then 4 ids
        commit(original, target, batch, original.allocate())
    store_c = copy_of(store_o)  # the checkpoint is copied while the query runs
    reserved = original.allocate()  # the original's next batch: an id reserved ahead
    assert is_lease_token(reserved[1])
    crashing = TwoPhaseCommitter(
        store_o, target, SINK, backoff_s=0, faults=FaultPlan.parse("after_record:raise")
    )
    with pytest.raises(InjectedFault):  # recorded (safe), phase 2 not done yet
        commit(crashing, target, 3, reserved)
    monkeypatch.setattr(twophase, "_LEASES", process_c)
    copy = TwoPhaseCommitter(store_c, target, SINK, backoff_s=0)
    assert copy.load().allocations[reserved[0]] == FOREIGN_LEASE_TOKEN
    copy.release_staged()  # the copy is started on the same target by mistake
    monkeypatch.setattr(twophase, "_LEASES", process_o)
    commit(original, target, 4, original.allocate())
    assert target.rows == [0, 1, 2, 3, 4]


def test_a_copied_checkpoints_sweep_never_deletes_the_originals_staged_files(monkeypatch):
    process_o, process_c, target, store_o, original = original_sink(monkeypatch)
    commit(original, target, 0, original.allocate())
    store_c = copy_of(store_o)
    in_flight = original.allocate()
    target.stage(*in_flight, "original-in-flight", [1])
    monkeypatch.setattr(twophase, "_LEASES", process_c)
    copy = TwoPhaseCommitter(store_c, target, SINK, backoff_s=0, sweep_every=1)
    commit(copy, target, 1, copy.allocate(), run_id="run-c")
    assert "original-in-flight" not in target.rolled_back
    # at its own location the original's tokens verify: its sweeps still find its dead
    assert (in_flight[0], in_flight[1]) in {
        (sid, tok) for sid, tok in original.load().allocations.items()
    }


def test_alternating_planner_workers_do_not_run_the_ids_ahead_of_the_batches(monkeypatch):
    """A lease cut short by another worker's allocation makes its process take one id at
    a time for a while: windows counted in ids (SETTLE_IDS) stay about that many
    batches."""
    store, target, committer = parts()
    workers = [{}, {}]
    ids = []
    for batch in range(40):
        monkeypatch.setattr(twophase, "_LEASES", workers[batch % 2])
        attempt = committer.allocate()
        ids.append(attempt[0])
        commit(committer, target, batch, attempt)
    assert ids == sorted(set(ids)) and ids[-1] < 40 + 8
    assert not settled(committer.load(), ids[-SETTLE_IDS + 4])
    assert target.rows == list(range(40))


def test_a_batch_without_tasks_allocates_one_id_in_the_commit_worker(monkeypatch):
    from pyspark_txn.sinks._spark import batch_attempt

    store, target, committer = parts()
    planner, commit_worker = {}, {}
    monkeypatch.setattr(twophase, "_LEASES", planner)
    committer.allocate()  # the planner plans the batch; no task runs
    monkeypatch.setattr(twophase, "_LEASES", commit_worker)
    sid, token, _ = batch_attempt(committer, [], 0)
    committer.commit(0, sid, token, [], run_id=None, query_id="q", source_offsets=[0])
    assert allocated_ids(allocations(store)[-1]) == [(sid, token)] and not commit_worker
    monkeypatch.setattr(twophase, "_LEASES", planner)
    assert committer.allocate()[0] == sid + 1


def test_settle_withdraws_no_id_that_nothing_was_staged_under():
    store, target, committer = parts()
    for batch in range(3):  # leases of 2 and 4 ids: 3 reserved ahead, unused
        commit(committer, target, batch, committer.allocate())
    staged = committer.allocate()
    target.stage(*staged, "left-behind", [9])
    before = len(store.events(SINK))
    state = committer.settle("stopped")
    withdrawn = [e for e in store.events(SINK)[before:] if e.kind is EventKind.ABANDONED]
    # the attempt that staged, and settle's own id; not the 2 ids reserved after it
    assert [e.snapshot_id for e in withdrawn] == [staged[0], staged[0] + 3]
    assert "left-behind" in target.rolled_back and staged[0] in state.abandoned


def test_the_same_path_in_another_account_or_endpoint_is_another_place():
    """Reserved tokens bind to the record table's place: a checkpoint copied to another
    Azure account or S3 endpoint (same container or bucket and path) reads them as
    foreign; spellings of one place agree."""
    prod = DeltaEventLog("abfss://chk@prodacct.dfs.core.windows.net/q1/pyspark_txn/records")
    dr = DeltaEventLog("abfss://chk@dracct.dfs.core.windows.net/q1/pyspark_txn/records")
    same = DeltaEventLog("az://chk/q1/pyspark_txn/records/", {"account_name": "ProdAcct"})
    token = new_lease_token(prod.location(), 7)
    assert not lease_token_binds(token, dr.location(), 7)
    assert lease_token_binds(token, same.location(), 7)
    a = DeltaEventLog("s3://bkt/q1/records", {"AWS_ENDPOINT_URL": "http://minio-a:9000"})
    b = DeltaEventLog("s3://bkt/q1/records", {"aws_endpoint": "http://minio-b:9000/"})
    also_a = DeltaEventLog("s3a://bkt/q1/records/", {"endpoint_url": "http://MINIO-A:9000/"})
    assert a.location() != b.location() and a.location() == also_a.location()


def test_a_copy_made_while_a_batch_is_in_flight_never_loses_or_doubles_it(monkeypatch):
    """The attempt allocated (unrecorded) at the moment of the copy has its token in both
    tables (docs/protocol.md, "The rule for deletes"): a copy started on the same target
    may delete its staged files and commit that batch first; then the original fails
    loudly at that batch, and the table holds every batch once."""
    process_o, process_c, target, store_o, original = original_sink(monkeypatch)
    commit(original, target, 0, original.allocate())
    commit(original, target, 1, original.allocate())
    in_flight = original.allocate()  # the first id of a new lease: an ordinary token
    assert not is_lease_token(in_flight[1])
    target.stage(*in_flight, "original-2", [2])
    store_c = copy_of(store_o)  # cp -r now
    monkeypatch.setattr(twophase, "_LEASES", process_c)
    copy = TwoPhaseCommitter(store_c, target, SINK, backoff_s=0, sweep_every=1)
    commit(copy, target, 2, copy.allocate(), run_id="run-c")
    monkeypatch.setattr(twophase, "_LEASES", process_o)
    with pytest.raises(CheckpointMismatchError):
        original.commit(
            2,
            *in_flight,
            [TxnHandle(0, "original-2", 1, 1, "c")],
            run_id="run-1",
            query_id="q",
            source_offsets=[2],
        )
    assert target.rows == [0, 1, 2]
