"""The two-phase commit protocol of one sink, independent of Spark and of the target.

``begin_run`` and ``allocate`` run on the driver before any task stages data;
``commit`` and ``abort`` run where Spark calls the writer's commit/abort. All
IO goes through a :class:`RecordStore` and a :class:`Target`, so the same code
is driven by Spark in production and by plain tests with in-memory parts.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from ..errors import CheckpointMismatchError, TxnError
from ..faults import NO_FAULTS, FaultPlan
from ..state import (
    Replay,
    SinkState,
    SnapshotKind,
    SnapshotRecord,
    TxnHandle,
    allocate,
    begin_epoch,
    decide,
    fold_sink,
    mark_committed,
    orphan_snapshot_ids,
    pending_phase2,
    record_snapshot,
)
from ..state.store import RecordStore

log = logging.getLogger(__name__)

T = TypeVar("T")


class Target(ABC):
    """Where phase 2 makes staged data visible. Every method must be idempotent."""

    @abstractmethod
    def committed_batch(self, sink_id: str) -> int | None:
        """Highest batch id this sink has committed into the target, or None."""

    @abstractmethod
    def commit(self, record: SnapshotRecord) -> int | None:
        """Make ``record``'s staged txns visible at most once; return the target version."""

    @abstractmethod
    def verify_staged(self, snapshot_id: int, txns: Sequence[TxnHandle]) -> None:
        """Raise ``CorruptSnapshotError`` naming every staged txn that is missing or wrong."""

    @abstractmethod
    def discard(self, snapshot_id: int, keep: Iterable[str] = ()) -> None:
        """Roll back the staged txns of ``snapshot_id``, except handles in ``keep``."""

    @abstractmethod
    def staged_snapshot_ids(self) -> set[int]:
        """Snapshot ids that have staged artifacts right now."""


def _retry(what: str, fn: Callable[[], T], attempts: int, backoff_s: float) -> T:
    """Retry an idempotent step; the last error propagates (recovery redoes it)."""
    for attempt in range(attempts):
        try:
            return fn()
        except TxnError:
            raise
        except Exception as e:
            if attempt == attempts - 1:
                raise
            log.warning("%s failed (attempt %d/%d): %r", what, attempt + 1, attempts, e)
            time.sleep(backoff_s * 2**attempt)
    raise AssertionError("unreachable")


class TwoPhaseCommitter:
    def __init__(
        self,
        store: RecordStore,
        target: Target,
        sink_id: str,
        *,
        faults: FaultPlan = NO_FAULTS,
        phase2_attempts: int = 5,
        backoff_s: float = 0.1,
    ) -> None:
        self.store = store
        self.target = target
        self.sink_id = sink_id
        self.faults = faults
        self.phase2_attempts = phase2_attempts
        self.backoff_s = backoff_s

    def load(self) -> SinkState:
        return self.store.load_sink(self.sink_id)

    def _update(self, transition: Callable[[SinkState], Any], state: SinkState | None = None):
        return self.store.update(self.sink_id, fold_sink, transition, state)

    # --- driver, once per run ------------------------------------------------

    def begin_run(self, owner: str, query_id: str | None, query_name: str | None = None) -> int:
        """Take a new epoch (fencing every older run), then recover.

        Recovery: redo phase 2 of safe records whose completion was never
        confirmed, and roll back every staged snapshot no safe record names.
        """
        event, state = self._update(lambda s: begin_epoch(s, owner, query_id, query_name))
        log.info("sink %s: run %s took epoch %d", self.sink_id, owner, event.epoch)
        self._check_target_matches(state)
        for rec in pending_phase2(state):
            state = self._phase2(state, rec)
        self._sweep_orphans(state, in_flight=None)
        return event.epoch

    def _sweep_orphans(self, state: SinkState, in_flight: int | None) -> None:
        staged = self.target.staged_snapshot_ids()
        for sid in sorted(orphan_snapshot_ids(state, staged, in_flight)):
            log.info("sink %s: rolling back orphan staged snapshot %d", self.sink_id, sid)
            self.target.discard(sid)

    def _check_target_matches(self, state: SinkState) -> None:
        committed = self.target.committed_batch(self.sink_id)
        last = state.last_record.batch_id if state.last_record else None
        if committed is not None and (last is None or committed > last):
            raise CheckpointMismatchError(
                f"the target already holds batch {committed} of sink {self.sink_id!r}, but the "
                f"record table's last recorded batch is {last}: the record table was deleted or "
                "replaced. Continuing could skip or duplicate data. Restore the record table, or "
                "give the new query its own sinkId."
            )

    # --- driver, before each batch's phase 1 ----------------------------------

    def allocate(self, epoch: int) -> int:
        """Reserve a snapshot id safely; only then may phase 1 stage anything."""
        self.faults.hit("allocate")
        event, _ = self._update(lambda s: allocate(s, epoch))
        return event.snapshot_id

    # --- driver, Spark's commit -----------------------------------------------

    def commit(
        self,
        batch_id: int,
        snapshot_id: int,
        epoch: int,
        txns: Sequence[TxnHandle],
        *,
        source_offsets: Sequence[Any] = (),
        query_id: str | None = None,
        target_meta: dict[str, Any] | None = None,
        kind: SnapshotKind = SnapshotKind.AUTOMATIC,
    ) -> SnapshotRecord:
        state = self.load()
        decision = decide(state, batch_id, snapshot_id, epoch, query_id)
        if isinstance(decision, Replay):
            # A replayed batch: decided before. Phase 2 again "just in case"
            # (a no-op if it landed) and the new attempt's staged data goes.
            rec = decision.record
            log.info(
                "sink %s: batch %d was decided as snapshot %d; replay is a no-op",
                self.sink_id,
                batch_id,
                rec.snapshot_id,
            )
            if rec.snapshot_id != snapshot_id:
                self.target.discard(snapshot_id)
            self._phase2(state, rec)
            self._sweep_orphans(state, in_flight=None)
            return rec
        if state.snapshot_id + 1 < snapshot_id:
            # Attempts were abandoned since the last good snapshot: roll back
            # everything no safe record names (late zombie files included)
            # before this record, so a safe record never has orphans below it.
            self._sweep_orphans(state, in_flight=snapshot_id)
        committed = self.target.committed_batch(self.sink_id)
        if committed is not None and committed >= batch_id:
            raise CheckpointMismatchError(
                f"sink {self.sink_id!r}: the target already holds batch {committed} but the "
                f"record table has no record of batch {batch_id}: refusing to decide it again"
            )
        self.target.verify_staged(snapshot_id, txns)
        record = SnapshotRecord(
            sink_id=self.sink_id,
            snapshot_id=snapshot_id,
            batch_id=batch_id,
            epoch=epoch,
            kind=kind,
            txns=tuple(sorted(txns, key=lambda t: (t.partition, t.handle))),
            source_offsets=tuple(source_offsets),
            query_id=query_id,
            target=target_meta or {},
        )
        self.faults.hit("before_record", batch_id)
        _, state = self._update(lambda s: record_snapshot(s, record), state)
        self.faults.hit("after_record", batch_id)
        self._phase2(state, record)
        return record

    def _phase2(self, state: SinkState, record: SnapshotRecord) -> SinkState:
        """Commit a safe record's txns. Idempotent; re-runnable from the record alone."""
        version = _retry(
            f"phase 2 of snapshot {record.snapshot_id}",
            lambda: self.target.commit(record),
            self.phase2_attempts,
            self.backoff_s,
        )
        self.target.discard(record.snapshot_id, keep=[t.handle for t in record.txns])
        self.faults.hit("after_phase2", record.batch_id)
        if record.snapshot_id not in state.committed:
            _, state = self._update(lambda s: mark_committed(s, record.snapshot_id, version), state)
        self.faults.hit("after_commit", record.batch_id)
        return state

    # --- driver, Spark's abort -------------------------------------------------

    def abort(self, snapshot_id: int) -> None:
        """Roll back one attempt's staged data, unless a safe record claims it.

        Tasks may still be writing when Spark aborts: whatever lands later is
        an orphan that the next run's recovery rolls back.
        """
        state = self.load()
        if state.record_for_snapshot(snapshot_id) is not None:
            log.warning(
                "sink %s: abort of snapshot %d ignored: its record is safe, phase 2 will finish it",
                self.sink_id,
                snapshot_id,
            )
            return
        self.target.discard(snapshot_id)
