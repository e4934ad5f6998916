"""Property-based tests: random runs, crashes, lost responses and zombies against
the two-phase protocol, with every invariant checked after every step.

The parts are the real protocol code (TwoPhaseCommitter, RecordStore, the fold)
over the in-memory event log and an in-memory target; the Delta and Spark
versions are proven by the contract and crash suites.
"""

import uuid

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from support import FaultyLog, MemoryTarget

from pyspark_txn.errors import (
    FencedError,
    IndeterminateCommitError,
    SnapshotWithdrawnError,
)
from pyspark_txn.faults import FaultPlan, FaultRule, InjectedFault
from pyspark_txn.sinks.twophase import TwoPhaseCommitter
from pyspark_txn.state import (
    MemoryEventLog,
    RecordStore,
    TxnHandle,
    allocate,
    check_invariants,
    fold_sink,
)
from pyspark_txn.state.core import NamedSnapshot, delete_named, register_named

SINK = "sink"
ROWS_PER_BATCH = 4
CRASH_POINTS = ["before_record", "after_record", "after_phase2", "after_commit"]


def batch_rows(b):
    return list(range(b * ROWS_PER_BATCH, (b + 1) * ROWS_PER_BATCH))


class ProtocolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.log = FaultyLog(MemoryEventLog())
        self.store = RecordStore(self.log, max_attempts=2, backoff_s=0)
        self.target = MemoryTarget()
        self.spark_committed = -1  # Spark's commit log: the last batch it knows is done
        self.run_id = None  # None: the next batch starts a new run
        self.safe_handles: set[str] = set()
        self.recorded: dict[int, int] = {}  # snapshot id -> batch of every record seen
        self.exports: list[int] = []  # ids reserved by exports still copying
        self.names: list[str] = []

    def committer(self, faults=FaultPlan()):
        # Tiny retention: history is summarized and deleted every few batches.
        return TwoPhaseCommitter(
            self.store,
            self.target,
            SINK,
            faults=faults,
            backoff_s=0,
            retain_snapshots=1,
            summary_window_ids=2,
        )

    def start_attempt(self, committer):
        if self.run_id is None:
            self.run_id = uuid.uuid4().hex
        return committer.allocate()

    def stage(self, attempt, batch, partitions):
        rows = batch_rows(batch)
        txns = []
        for p in range(partitions):
            part = rows[p::partitions]
            handle = f"s{attempt[0]}-p{p}-{uuid.uuid4().hex[:6]}"
            self.target.stage(*attempt, handle, part)
            txns.append(TxnHandle(p, handle, len(part), 1, "crc32:0"))
        return txns

    def commit(self, committer, batch, attempt, txns, run_id):
        committer.commit(
            batch, *attempt, txns, run_id=run_id, query_id="query", source_offsets=[batch]
        )

    @rule(
        partitions=st.integers(1, 3),
        crash=st.sampled_from([None] * 4 + CRASH_POINTS),
        storage=st.sampled_from([None, None, "lose_response", "fail_before", "indeterminate"]),
    )
    def run_batch(self, partitions, crash, storage):
        """Spark runs its next batch (a replay if the last attempt failed)."""
        batch = self.spark_committed + 1
        faults = FaultPlan((FaultRule(crash, "raise", batch=batch),)) if crash else FaultPlan()
        committer = self.committer(faults)
        try:
            attempt = self.start_attempt(committer)
            txns = self.stage(attempt, batch, partitions)
            if storage:
                self.log.plan = [storage]
            self.commit(committer, batch, attempt, txns, self.run_id)
        except (InjectedFault, IndeterminateCommitError, OSError):
            self.run_id = None  # the query fails; Spark does not log the batch
            return
        finally:
            self.log.plan, self.log.read_failures = [], 0
        self.spark_committed = batch

    @rule(partitions=st.integers(1, 2))
    def abort_batch(self, partitions):
        """A task fails: Spark aborts; a zombie task may still stage a file afterwards."""
        committer = self.committer()
        attempt = self.start_attempt(committer)
        self.stage(attempt, self.spark_committed + 1, partitions)
        committer.abort(*attempt)
        self.target.stage(*attempt, f"zombie-{attempt[0]}", [10**6])
        self.run_id = None

    @rule()
    def crash_driver(self):
        self.run_id = None

    @precondition(lambda self: self.run_id is not None)
    @rule()
    def second_run_takes_over(self):
        """A newer run commits a batch; the old run's next commit must be fenced."""
        old, self.run_id = self.run_id, None
        self.run_batch.hypothesis_stateful_rule.function(self, 1, None, None)
        if self.run_id is None:
            return
        committer = self.committer()
        attempt = committer.allocate()
        batch = self.spark_committed + 1
        txns = self.stage(attempt, batch, 1)
        try:
            self.commit(committer, batch, attempt, txns, old)
        except FencedError:
            committer.abort(*attempt)  # Spark aborts a batch whose commit failed
        else:
            raise AssertionError("an older run committed after a newer run took over")

    # --- exports running beside the query and the operator's commands -----------

    @rule()
    def export_starts(self):
        """An export (another process) reserves its own snapshot id, then copies."""
        event, _ = self.store.update(SINK, fold_sink, allocate)
        self.exports.append(event.snapshot_id)

    @precondition(lambda self: self.exports)
    @rule(i=st.integers(0, 3))
    def export_registers(self, i):
        """The export's copy is done: it registers its name last. An id withdrawn while
        it copied is refused; anything else lands."""
        sid = self.exports.pop(i % len(self.exports))
        name = f"n{sid}"
        state = self.store.load_sink(SINK)
        entry = NamedSnapshot(name, sid, state.snapshot_id, 0, f"/x/{name}", None)
        try:
            _, state = self.store.update(SINK, fold_sink, lambda s: register_named(s, entry))
        except SnapshotWithdrawnError:
            assert sid in state.abandoned
            return
        assert state.named[name].snapshot_id == sid
        self.names.append(name)

    @rule()
    def settle_sink(self):
        """``settle`` / ``stop_and_export``: the query is stopped, the sink settled while
        exports may still be copying."""
        self.run_id = None
        self.committer().settle("settled")

    @precondition(lambda self: self.exports)
    @rule(i=st.integers(0, 3))
    def operator_abandons_export_id(self, i):
        """``pyspark-txn abandon`` of an id an export still copies under."""
        sid = self.exports[i % len(self.exports)]
        if sid not in self.store.load_sink(SINK).allocations:
            return  # retention summarized its allocation away: nothing to name it by
        self.run_id = None
        self.committer().abandon(sid, "operator")

    @precondition(lambda self: self.names)
    @rule(i=st.integers(0, 3))
    def delete_snapshot(self, i):
        name = self.names.pop(i % len(self.names))
        self.store.update(SINK, fold_sink, lambda s: delete_named(s, name))

    @invariant()
    def record_log_is_valid(self):
        state = check_invariants(SINK, self.log.inner.read(SINK))
        for rec in state.records.values():
            self.safe_handles |= {t.handle for t in rec.txns}
            self.recorded[rec.snapshot_id] = rec.batch_id
        # no txn of a safe record is ever rolled back
        assert not (self.safe_handles & self.target.rolled_back)
        # no committed txn exists for a snapshot whose record is not safe
        assert self.target.committed_handles <= self.safe_handles
        assert set(self.target.batches) <= set(self.recorded.values())
        # never a row twice, and every batch Spark considers done is in the target
        rows = self.target.rows
        assert len(rows) == len(set(rows))
        assert set(range(self.spark_committed + 1)) <= set(self.target.batches)

    def teardown(self):
        # Recovery: a clean restart runs the pipeline to the end.
        self.run_id = None
        for _ in range(3):
            self.run_batch.hypothesis_stateful_rule.function(self, 2, None, None)
        target_batches = self.spark_committed + 1
        assert sorted(self.target.rows) == [r for b in range(target_batches) for r in batch_rows(b)]
        self.record_log_is_valid()
        staged = {sid for sid, _ in self.target.staged_attempts()}
        assert staged <= set(self.recorded)


ProtocolMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestProtocol = ProtocolMachine.TestCase
