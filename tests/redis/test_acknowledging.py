"""The generic acknowledging-source logic, without Spark or a server.

``ListBroker`` is a minimal broker with a consumer group's semantics
(deliver once, pending until acked, redeliver on demand); the claim log is the
real state module over ``MemoryEventLog`` (and ``FaultyLog`` for lost
responses).
"""

from __future__ import annotations

import pytest
from support import FaultyLog

from pyspark_txn.errors import SourceError
from pyspark_txn.sources.acknowledging import NO_CLAIM, Broker, ClaimCoordinator
from pyspark_txn.state import EventKind, MemoryEventLog, RecordStore

SOURCE = "test:group"


class ListBroker(Broker):
    """Messages ``q/0 .. q/n-1``; one consumer's pending list; a journal of calls."""

    def __init__(self, n: int = 0) -> None:
        self.messages = [f"q/{i}" for i in range(n)]
        self.next = 0
        self.pending_ids: list[str] = []
        self.acked: list[str] = []
        self.deleted: set[str] = set()
        self.redeliver: list[str] = []
        self.journal: list[tuple[str, tuple[str, ...]]] = []

    def add(self, n: int) -> None:
        start = len(self.messages)
        self.messages += [f"q/{i}" for i in range(start, start + n)]

    def claim(self, max_messages, block_ms):
        got = self.messages[self.next : self.next + max_messages]
        self.next += len(got)
        self.pending_ids += got
        self.journal.append(("claim", tuple(got)))
        return got

    def reclaim(self, max_messages):
        got, self.redeliver = self.redeliver[:max_messages], self.redeliver[max_messages:]
        return got

    def fetch(self, ids, arrow_schema):
        raise NotImplementedError  # executors only

    def ack(self, ids):
        self.journal.append(("ack", tuple(ids)))
        self.acked += ids
        self.pending_ids = [m for m in self.pending_ids if m not in set(ids)]

    def pending(self, consumers=()):
        return list(self.pending_ids)

    def missing(self, ids):
        return {m for m in ids if m in self.deleted}


def coordinator(log, broker) -> ClaimCoordinator:
    return ClaimCoordinator(RecordStore(log, backoff_s=0), SOURCE, broker, "memory")


def claims(log) -> dict[int, tuple[str, ...]]:
    return dict(RecordStore(log).load_offsets(SOURCE).claims)


def test_a_claim_is_safe_in_the_log_before_its_offset_is_returned():
    log, broker = MemoryEventLog(), ListBroker(7)
    c = coordinator(log, broker)
    assert c.initial() == NO_CLAIM
    assert c.latest(NO_CLAIM, cap=3) == 0
    assert claims(log) == {0: ("q/0", "q/1", "q/2")}  # what a fresh reader sees
    assert c.latest(0, cap=3) == 1
    assert c.latest(1, cap=3) == 2
    assert c.latest(2, cap=3) == 2  # nothing new: no claim, no offset
    assert claims(log)[2] == ("q/6",)


def test_a_replayed_range_reads_exactly_the_claimed_ids():
    log, broker = MemoryEventLog(), ListBroker(10)
    c = coordinator(log, broker)
    ends = [c.latest(NO_CLAIM, 4)]
    ends.append(c.latest(ends[-1], 4))
    fresh = coordinator(log, ListBroker())  # another process, nothing delivered to it
    assert fresh.ids(NO_CLAIM, 0) == ["q/0", "q/1", "q/2", "q/3"]
    assert fresh.ids(0, 1) == ["q/4", "q/5", "q/6", "q/7"]
    assert fresh.ids(NO_CLAIM, 1) == [f"q/{i}" for i in range(8)]


def test_a_claim_spark_never_planned_is_the_next_batch_after_a_restart():
    log, broker = MemoryEventLog(), ListBroker(10)
    assert coordinator(log, broker).latest(NO_CLAIM, 4) == 0  # then the driver dies
    restarted = coordinator(log, broker)
    assert restarted.initial() == NO_CLAIM  # Spark wrote no offsets: starts from scratch
    assert restarted.latest(NO_CLAIM, 4) == 0  # the written claim, not a new one
    assert [k for k, _ in broker.journal].count("claim") == 1
    assert restarted.ids(NO_CLAIM, 0) == ["q/0", "q/1", "q/2", "q/3"]


def test_only_claims_of_committed_batches_are_acked_and_recorded():
    log, broker = MemoryEventLog(), ListBroker(9)
    c = coordinator(log, broker)
    e0 = c.latest(NO_CLAIM, 3)
    assert broker.acked == []
    e1 = c.latest(e0, 3)  # planning batch 1: batch 0 is in Spark's commit log
    assert broker.acked == ["q/0", "q/1", "q/2"]
    assert RecordStore(log).load_offsets(SOURCE).acked_through == e0
    c.commit(e1)
    assert broker.acked == [f"q/{i}" for i in range(6)]
    assert broker.pending_ids == []
    c.commit(e1)  # Spark calls commit again after a restart: harmless
    kinds = [e.kind for e in log.read(SOURCE)]
    assert kinds.count(EventKind.ACKED) == 2


def test_a_restart_acks_committed_claims_before_claiming_new_ones():
    log, broker = MemoryEventLog(), ListBroker(9)
    c = coordinator(log, broker)
    e1 = c.latest(c.latest(NO_CLAIM, 3), 3)  # batch 1 ran; commit(e1) never came
    broker.journal.clear()
    restarted = coordinator(log, broker)
    assert restarted.latest(e1, 3) == 2
    assert broker.journal == [("ack", ("q/3", "q/4", "q/5")), ("claim", ("q/6", "q/7", "q/8"))]
    assert RecordStore(log).load_offsets(SOURCE).acked_through == e1


def test_deliveries_no_claim_holds_are_claimed_first_after_a_crash():
    log, broker = MemoryEventLog(), ListBroker(8)
    c = coordinator(log, broker)
    e0 = c.latest(NO_CLAIM, 3)
    broker.claim(3, 0)  # delivered q/3..q/5, then the driver died before the claim
    restarted = coordinator(log, broker)
    assert restarted.latest(e0, 4) == 1
    assert claims(log)[1] == ("q/3", "q/4", "q/5", "q/6")
    assert broker.acked == ["q/0", "q/1", "q/2"]


def test_pending_messages_that_no_longer_exist_are_acked_not_claimed():
    log, broker = MemoryEventLog(), ListBroker(6)
    broker.claim(2, 0)
    broker.deleted = {"q/0"}
    c = coordinator(log, broker)
    assert c.latest(NO_CLAIM, 10) == 0
    assert claims(log)[0] == ("q/1", "q/2", "q/3", "q/4", "q/5")
    assert "q/0" in broker.acked


def test_redeliveries_of_claimed_messages_are_never_claimed_again():
    log, broker = MemoryEventLog(), ListBroker(6)
    c = coordinator(log, broker)
    e0 = c.latest(NO_CLAIM, 3)
    e1 = c.latest(e0, 2)  # acks claim 0
    broker.redeliver = ["q/1", "q/3", "q/4"]  # an acked one and two in flight come back
    broker.acked.clear()
    assert c.latest(e1, 5) == 2
    assert claims(log)[2] == ("q/5",)
    every = [m for ids in claims(log).values() for m in ids]
    assert len(every) == len(set(every)) == 6
    # claim 1 (q/3, q/4) was acked as committed; q/1's lost ack was repeated
    assert set(broker.acked) == {"q/1", "q/3", "q/4"}


def test_a_checkpoint_ahead_of_the_claim_log_is_refused():
    log, broker = MemoryEventLog(), ListBroker(3)
    c = coordinator(log, broker)
    with pytest.raises(SourceError, match="claim log memory ends at claim -1"):
        c.latest(4, 3)
    with pytest.raises(SourceError, match="names claim 2"):
        c.ids(NO_CLAIM, 2)


def test_a_new_checkpoint_on_an_old_claim_log_starts_after_the_last_ack():
    log, broker = MemoryEventLog(), ListBroker(6)
    c = coordinator(log, broker)
    e1 = c.latest(c.latest(NO_CLAIM, 2), 2)
    c.commit(e1)
    assert coordinator(log, broker).initial() == e1


def test_an_ack_someone_else_recorded_first_is_not_an_error():
    log, broker = MemoryEventLog(), ListBroker(6)
    c = coordinator(log, broker)
    e0 = c.latest(NO_CLAIM, 3)
    stale = c.state()
    other = coordinator(log, broker)
    other.commit(e0)  # e.g. the sink's ack_committed after phase 2
    from pyspark_txn.sources.acknowledging import _ack_through

    state = _ack_through(c.store, SOURCE, broker, stale, e0)
    assert state.acked_through == e0
    assert [e.kind for e in log.read(SOURCE)].count(EventKind.ACKED) == 1


def test_a_lost_response_does_not_claim_twice():
    faulty = FaultyLog(MemoryEventLog())
    broker = ListBroker(4)
    c = ClaimCoordinator(RecordStore(faulty, backoff_s=0), SOURCE, broker, "memory")
    faulty.plan = ["lose_response"]
    assert c.latest(NO_CLAIM, 4) == 0
    assert [e.payload["offset"] for e in faulty.inner.read(SOURCE)] == [0]


def test_a_concurrent_claimer_is_refused():
    log, broker = MemoryEventLog(), ListBroker(6)
    a, b = coordinator(log, broker), coordinator(log, broker)
    a.latest(NO_CLAIM, 2)
    stale = b.state()
    a.latest(0, 2)
    with pytest.raises(SourceError, match="another reader"):
        b._claim(stale, ["q/5"])


def test_a_reset_group_position_cannot_hide_new_messages_behind_old_ones():
    log, broker = MemoryEventLog(), ListBroker(6)
    c = coordinator(log, broker)
    e1 = c.latest(c.latest(NO_CLAIM, 3), 3)
    broker.add(2)
    broker.next = 0  # the group's position was reset (XGROUP SETID): all comes again
    assert c.latest(e1, 3) == 2  # three rounds of old messages, then the new ones
    assert claims(log)[2] == ("q/6", "q/7")
    assert broker.pending_ids == ["q/6", "q/7"]  # the redeliveries were acked again


class OrderedBroker(ListBroker):
    """ListBroker whose ids grow: new deliveries come in id order (as Redis's '>')."""

    def high_water(self, ids, marks):
        out = dict(marks)
        for m in ids:
            if "q" not in out or int(m[2:]) > int(out["q"][2:]):
                out["q"] = m
        return out

    def covered(self, marks, message_id):
        return "q" in marks and int(message_id[2:]) <= int(marks["q"][2:])


def test_summaries_bound_the_claim_log_and_redeliveries_are_still_dropped():
    from pyspark_txn.state import offset_log

    log, broker = MemoryEventLog(), OrderedBroker(300)
    broker.messages.remove("q/7")  # handed to another consumer of the group, never to us
    c = coordinator(log, broker)
    end = NO_CLAIM
    for _ in range(150):
        end = c.latest(end, 2)
    c.commit(end)
    events = log.read(SOURCE)  # what a start reads: the summary and what followed it
    assert events[0].kind is EventKind.SUMMARY
    assert len(events) <= offset_log.SUMMARY_EVERY_EVENTS + 2
    state = RecordStore(log).load_offsets(SOURCE)
    assert state.first_kept > 100 and set(state.marks) == {"q"}  # older ids: one mark
    # the group's position is reset: old entries come again by '>' and are dropped;
    # q/7, pending at a dead consumer and reclaimed, was never ours: it is claimed
    broker.next, broker.redeliver = 0, ["q/7"]
    broker.messages.append("q/300")
    after = coordinator(log, broker)
    nxt = after.latest(end, 10)
    assert after.ids(end, nxt) == ["q/7", "q/300"]
    with pytest.raises(SourceError, match="summarized away"):
        after.ids(NO_CLAIM, 0)
