"""Two runs of one sink interleaved at random: a zombie must never delete what a
newer run recorded, whatever state it read and however long it stalled.

Each run keeps the state it last loaded (its possibly stale view of the log)
and acts on it at random moments: allocate, stage, commit, abort, or sweep
with that stale view. After every step no file named by a safe record may be
gone, and no row may be committed twice. The parts are the real protocol
code over the in-memory event log and target (tests/support.py).
"""

import uuid
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from support import MemoryTarget

from pyspark_txn.errors import (
    CheckpointMismatchError,
    CorruptSnapshotError,
    FencedError,
    ProtocolViolation,
)
from pyspark_txn.sinks.twophase import TwoPhaseCommitter
from pyspark_txn.state import (
    MemoryEventLog,
    RecordStore,
    TxnHandle,
    check_invariants,
    dead_snapshots,
)

SINK = "sink"
ROWS = 3


@dataclass
class Run:
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    view: object = None  # the state this run last loaded
    attempt: tuple[int, str] | None = None
    batch: int | None = None
    txns: list = field(default_factory=list)
    rows: list = field(default_factory=list)


class InterleavedRuns(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.store = RecordStore(MemoryEventLog(), max_attempts=2, backoff_s=0)
        self.target = MemoryTarget()
        self.committer = TwoPhaseCommitter(
            self.store, self.target, SINK, backoff_s=0, sweep_every=3
        )
        self.committer.serve_exports = self.serve_exports
        self.requests = 0
        self.runs = [Run(), Run()]
        self.spark_committed = -1  # both runs share one checkpoint
        self.safe_handles: set[str] = set()

    def restart(self, i):
        self.runs[i] = Run()

    @rule(i=st.integers(0, 1))
    def load(self, i):
        self.runs[i].view = self.store.load_sink(SINK)

    @rule(i=st.integers(0, 1))
    def allocate(self, i):
        run = self.runs[i]
        run.attempt = self.committer.allocate()
        run.batch = self.spark_committed + 1
        run.txns, run.rows = [], []

    @rule(i=st.integers(0, 1), partitions=st.integers(1, 2))
    def stage(self, i, partitions):
        run = self.runs[i]
        if run.attempt is None:
            return
        for p in range(partitions):
            handle = f"{run.run_id}-s{run.attempt[0]}-p{p}-{uuid.uuid4().hex[:4]}"
            rows = [run.batch * ROWS + r for r in range(ROWS)][p::partitions]
            self.target.stage(*run.attempt, handle, rows)
            run.rows += rows
            run.txns.append(TxnHandle(p, handle, len(rows), 1, "crc32:0"))

    @rule(i=st.integers(0, 1))
    def commit(self, i):
        run = self.runs[i]
        if run.attempt is None:
            return
        if sorted(run.rows) != list(range(run.batch * ROWS, (run.batch + 1) * ROWS)):
            return  # Spark commits only when every task of the batch succeeded
        try:
            self.committer.commit(
                run.batch,
                *run.attempt,
                run.txns,
                run_id=run.run_id,
                query_id="q",
                source_offsets=[run.batch],
            )
        except CorruptSnapshotError:
            # its files were swept: only allowed if the attempt was provably dead
            state = self.store.load_sink(SINK)
            assert dead_snapshots(state, [run.attempt]) == {run.attempt}
            self.restart(i)
            return
        except CheckpointMismatchError as e:
            # a stale attempt for a batch whose record was summarized away: nothing left
            # to check its offsets against, so a loud refusal (never a silent replay)
            assert "summarized" in str(e), e
            self.committer.abort(*run.attempt)  # the query fails; Spark aborts
            self.restart(i)
            return
        except (FencedError, ProtocolViolation):
            self.committer.abort(*run.attempt)  # the query fails; Spark aborts
            self.restart(i)
            return
        self.spark_committed = max(self.spark_committed, run.batch)
        run.attempt = None

    @rule(i=st.integers(0, 1))
    def whole_batch(self, i):
        """A batch that runs through without interruption: history piles up faster."""
        self.allocate(i)
        self.stage(i, 1)
        self.commit(i)

    @rule(i=st.integers(0, 1))
    def abort(self, i):
        run = self.runs[i]
        if run.attempt is not None:
            self.committer.abort(*run.attempt)
            self.restart(i)

    @rule(i=st.integers(0, 1))
    def sweep_with_stale_view(self, i):
        """The zombie's case: a sweep decided on a state read long ago."""
        run = self.runs[i]
        if run.view is not None:
            self.committer._sweep(run.view)

    @rule(retain=st.integers(1, 3), window=st.integers(0, 4))
    def summarize_history(self, retain, window):
        """Retention: the history is summarized and the older events deleted, at any
        moment (stale views of the runs may predate it)."""
        self.committer.retain_snapshots = retain
        self.committer.summary_window_ids = window
        self.committer._summarize(self.store.load_sink(SINK))

    @rule()
    def export_named_snapshot(self):
        """An export from another process takes its own id and registers a name while
        the runs go on: it must disturb neither their commits nor the delete rule."""
        from pyspark_txn.state import allocate, fold_sink
        from pyspark_txn.state.core import NamedSnapshot, register_named

        event, _ = self.store.update(SINK, fold_sink, allocate)
        name = f"n{event.snapshot_id}"
        entry = NamedSnapshot(name, event.snapshot_id, -1, -1, f"/x/{name}", None)
        _, state = self.store.update(SINK, fold_sink, lambda s: register_named(s, entry))
        assert state.named[name].snapshot_id == event.snapshot_id

    @rule()
    def request_export(self):
        """An export asked of "the next commit": whichever run commits next serves it."""
        from pyspark_txn.state import fold_sink
        from pyspark_txn.state.core import request_export

        self.requests += 1
        name = f"r{self.requests}"
        self.store.update(SINK, fold_sink, lambda s: request_export(s, name, f"/x/{name}"))

    def serve_exports(self, state, record, version):
        from pyspark_txn.state import allocate, fold_sink
        from pyspark_txn.state.core import NamedSnapshot, register_named

        for name in state.export_requests:
            event, _ = self.store.update(SINK, fold_sink, allocate)
            entry = NamedSnapshot(
                name, event.snapshot_id, record.snapshot_id, record.batch_id, f"/x/{name}", version
            )
            self.store.update(SINK, fold_sink, lambda s, e=entry: register_named(s, e))

    @rule(i=st.integers(0, 1))
    def late_task_file(self, i):
        """A task still writing after its attempt was decided or aborted."""
        run = self.runs[i]
        if run.attempt is not None:
            self.target.stage(*run.attempt, f"late-{uuid.uuid4().hex[:4]}", [10**6])

    @invariant()
    def no_safe_file_is_ever_deleted(self):
        state = check_invariants(SINK, self.store.log.read(SINK))
        for rec in state.records.values():
            self.safe_handles |= {t.handle for t in rec.txns}
        assert not (self.safe_handles & self.target.rolled_back)
        for rec in state.records.values():
            if rec.snapshot_id not in state.committed:
                present = self.target.staged.get((rec.snapshot_id, rec.token), {})
                assert {t.handle for t in rec.txns} <= set(present)
        rows = self.target.rows
        assert len(rows) == len(set(rows))
        assert self.target.committed_handles <= self.safe_handles


InterleavedRuns.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestInterleavedRuns = InterleavedRuns.TestCase


def test_a_stalled_zombie_sweep_keeps_a_newer_runs_batches():
    """The reproduction of the reported bug: the zombie read the log, stalled while a
    newer run committed two batches, then swept with what it had read."""
    store = RecordStore(MemoryEventLog(), backoff_s=0)
    target = MemoryTarget()
    committer = TwoPhaseCommitter(store, target, SINK, backoff_s=0)
    zombie_attempt = committer.allocate()
    target.stage(*zombie_attempt, "zombie-file", [0, 1, 2])
    zombie_view = store.load_sink(SINK)
    for batch in range(2):
        attempt = committer.allocate()
        target.stage(*attempt, f"new-{batch}", [batch])
        committer.commit(
            batch, *attempt, [TxnHandle(0, f"new-{batch}", 1, 1, "c")], run_id="new", query_id="q"
        )
    committer._sweep(zombie_view)
    assert target.rows == [0, 1] and not (target.rolled_back & {"new-0", "new-1"})
    # and the zombie's own attempt is dead for everyone with a fresh view
    committer._sweep(store.load_sink(SINK))
    assert "zombie-file" in target.rolled_back


def test_a_sweep_after_retention_keeps_the_files_of_summarized_records():
    """Retention drops old records from the state; a sweep must not then take their
    committed attempts (still allocated, still staged in place) for dead ones."""
    store = RecordStore(MemoryEventLog(), backoff_s=0)
    target = MemoryTarget()
    committer = TwoPhaseCommitter(
        store, target, SINK, backoff_s=0, retain_snapshots=1, summary_window_ids=4
    )
    for batch in range(4):
        attempt = committer.allocate()
        target.stage(*attempt, f"file-{batch}", [batch])
        committer.commit(
            batch, *attempt, [TxnHandle(0, f"file-{batch}", 1, 1, "c")], run_id="r", query_id="q"
        )
    committer._summarize(store.load_sink(SINK))
    state = store.load_sink(SINK)
    assert len(store.events(SINK)) == 1 and state.summary_seq > 0
    committer._sweep(state)
    assert target.rows == [0, 1, 2, 3] and not target.rolled_back
