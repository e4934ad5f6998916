"""Contract of EventLog backends and the safe-write semantics of RecordStore."""

import multiprocessing as mp
import threading

import pytest
from support import allocated_event as ev

from pyspark_txn.errors import CommitConflict, FencedError, IndeterminateCommitError
from pyspark_txn.state import (
    AppendRejected,
    DeltaEventLog,
    MemoryEventLog,
    RecordStore,
    allocate,
    check_epoch,
    fold_sink,
    take_over,
)


def test_read_of_unknown_stream_is_empty(backend):
    assert backend.read("nothing") == []


def test_appends_read_back_in_order(backend):
    events = [ev(i) for i in range(6)]  # crosses the Delta backend's compaction point
    for e in events:
        backend.append(e)
    backend.append(ev(0, stream="other"))
    assert backend.read("s") == events
    assert backend.streams() == ["other", "s"]


def test_taken_seq_is_rejected(backend):
    backend.append(ev(0))
    with pytest.raises(AppendRejected):
        backend.append(ev(0))
    assert len(backend.read("s")) == 1


def test_gap_is_rejected(backend):
    backend.append(ev(0))
    with pytest.raises(AppendRejected):
        backend.append(ev(2))
    assert [e.seq for e in backend.read("s")] == [0]


def test_safe_append_lost_response_lands_once(faulty):
    store = RecordStore(faulty, backoff_s=0)
    faulty.plan = ["lose_response"]
    e = ev(0)
    assert store.safe_append(e) == e
    assert faulty.inner.read("s") == [e]


def test_safe_append_retries_a_failed_write(faulty):
    store = RecordStore(faulty, backoff_s=0)
    faulty.plan = ["fail_before", "fail_before"]
    store.safe_append(ev(0))
    assert [x.seq for x in faulty.inner.read("s")] == [0]
    assert faulty.appends == 3


def test_lost_response_then_retry_does_not_duplicate(faulty):
    store = RecordStore(faulty, backoff_s=0)
    faulty.plan = ["lose_response"]
    faulty.read_failures = 1  # the first re-read fails too: the write is retried
    e = ev(0)
    store.safe_append(e)
    assert faulty.inner.read("s") == [e]


def test_unknown_outcome_stays_unknown_raises_indeterminate(faulty):
    store = RecordStore(faulty, max_attempts=3, backoff_s=0)
    faulty.plan = ["lose_response"]
    faulty.read_failures = 10  # the outcome can never be read back
    with pytest.raises(IndeterminateCommitError, match="s#0"):
        store.safe_append(ev(0))


def test_write_that_never_lands_is_indeterminate_not_success(faulty):
    store = RecordStore(faulty, max_attempts=3, backoff_s=0)
    faulty.plan = ["fail_before"] * 3
    with pytest.raises(IndeterminateCommitError):
        store.safe_append(ev(0))
    assert faulty.inner.read("s") == []


def test_seq_taken_by_another_writer_is_a_conflict(backend):
    store = RecordStore(backend, backoff_s=0)
    backend.append(ev(0, query_id="other"))
    with pytest.raises(CommitConflict, match="another writer"):
        store.safe_append(ev(0))


def test_update_refolds_after_a_lost_race(backend):
    """A concurrent epoch between fold and append: the retry sees it and fences."""
    store = RecordStore(backend, backoff_s=0)
    store.update("s", fold_sink, lambda s: take_over(s, "a", None, "q"))
    intruder = take_over(fold_sink("s", backend.read("s")), "b", None, "q")

    def transition(state):
        if backend.read("s")[-1].seq == 0:  # first try: someone takes the sink now
            backend.append(intruder)
        check_epoch(state, 1)  # a transition only the epoch-1 run may make
        return allocate(state)

    with pytest.raises(FencedError):
        store.update("s", fold_sink, transition)


def test_update_with_a_stale_state_refolds(backend):
    """A caller's state that missed an event: the append loses, the fresh fold decides."""
    store = RecordStore(backend, backoff_s=0)
    _, stale = store.update("s", fold_sink, lambda s: take_over(s, "a", None, "q"))
    missed, _ = store.update("s", fold_sink, allocate)  # stale lacks it
    event, state = store.update("s", fold_sink, allocate, stale)
    assert (event.seq, event.snapshot_id) == (2, missed.snapshot_id + 1)
    assert [e.snapshot_id for e in backend.read("s")[1:]] == [missed.snapshot_id, event.snapshot_id]
    assert state.ongoing_snapshot_id == event.snapshot_id
    # A newer run took the sink since the state was folded: fenced, nothing written.
    _, old = store.update("s", fold_sink, allocate)
    store.update("s", fold_sink, lambda s: take_over(s, "b", None, "q"))
    with pytest.raises(FencedError):
        store.update("s", fold_sink, lambda s: check_epoch(s, 1) or allocate(s), old)
    assert len(backend.read("s")) == 5


def _race(log_or_uri, barrier, results, who):
    log = DeltaEventLog(log_or_uri) if isinstance(log_or_uri, str) else log_or_uri
    store = RecordStore(log, backoff_s=0.01)
    barrier.wait()
    try:
        store.safe_append(ev(0, query_id=who))
        results.put((who, "won"))
    except CommitConflict:
        results.put((who, "conflict"))
    except Exception as e:  # reported, and the assertion below fails on it
        results.put((who, repr(e)))


@pytest.mark.parametrize("round_", range(3))
def test_two_writers_race_for_one_seq(backend, round_):
    """Two writers (processes for Delta, threads for memory): one wins, one conflicts."""
    if isinstance(backend, MemoryEventLog):
        barrier, results = threading.Barrier(2), __import__("queue").Queue()
        workers = [
            threading.Thread(target=_race, args=(backend, barrier, results, w)) for w in ("a", "b")
        ]
    else:
        ctx = mp.get_context("spawn")
        barrier, results = ctx.Barrier(2), ctx.Queue()
        workers = [
            ctx.Process(target=_race, args=(backend.uri, barrier, results, w)) for w in ("a", "b")
        ]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    outcome = dict(results.get(timeout=5) for _ in workers)
    assert sorted(outcome.values()) == ["conflict", "won"], outcome
    landed = backend.read("s")
    assert len(landed) == 1
    winner = next(w for w, o in outcome.items() if o == "won")
    assert landed[0].query_id == winner


# --- offset log ---------------------------------------------------------------


def test_offset_log_claims_are_durable_and_deduplicated(backend):
    store = RecordStore(backend, backoff_s=0)
    assert store.claim("src", ["m1", "m2"]) == (0, ["m1", "m2"])
    assert store.claim("src", ["m2", "m3", "m3"]) == (1, ["m3"])  # m2 is a redelivery
    state = RecordStore(backend).load_offsets("src")  # a fresh reader sees the same
    assert state.ids_between(-1, 1) == ["m1", "m2", "m3"]
    assert state.ids_between(0, 1) == ["m3"]
    assert state.unacked == [0, 1]


def test_offset_log_ack_is_monotonic_and_idempotent(backend):
    store = RecordStore(backend, backoff_s=0)
    for ids in (["a"], ["b"], ["c"]):
        store.claim("src", ids)
    store.ack("src", 1)
    store.ack("src", 1)  # a repeated ack (Spark calls commit again after restart)
    state = store.load_offsets("src")
    assert state.acked_through == 1 and state.unacked == [2]
    assert len(backend.read("src")) == 4


def test_offset_log_lost_response_does_not_double_claim(faulty):
    store = RecordStore(faulty, backoff_s=0)
    faulty.plan = ["lose_response"]
    assert store.claim("src", ["x"]) == (0, ["x"])
    assert [e.payload["offset"] for e in faulty.inner.read("src")] == [0]
