"""The pure core of the protocol: records, the fold, transitions and invariants.

No IO and no Spark here. Every function takes a state (a fold over one
stream's events) and either returns the next event to append or raises the
error that says why the transition is not allowed. The IO shell appends the
event safely and folds it in; a crash anywhere loses only in-memory state,
which the fold rebuilds from the record table.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from enum import Enum
from types import MappingProxyType
from typing import Any, TypeVar

from ..errors import (
    CheckpointMismatchError,
    FencedError,
    ProtocolViolation,
)
from .events import Event, EventKind

NO_SNAPSHOT = -1

S = TypeVar("S")


class SnapshotKind(str, Enum):
    AUTOMATIC = "automatic"  # one per committed micro-batch
    TERMINAL = "terminal"  # the last one before a deliberate stop
    NAMED = "named"  # kept under a name (later: exported)
    EXPORT_ONLY = "export-only"  # state only: never commits or rolls back anything


class Invariant(str, Enum):
    """The invariants of DESIGN.md §3 that a record stream can violate."""

    SEQ_GAP_FREE = "event sequence numbers are gap-free and start at 0"
    EPOCHS_INCREASE = "epochs strictly increase"
    IDS_STRICTLY_INCREASE = "snapshot ids strictly increase and are never reused"
    RECORD_WAS_ALLOCATED = "a snapshot record names an id allocated by the same epoch"
    ONE_IN_PROGRESS = "at most one snapshot is in progress per sink"
    ONE_RECORD_PER_BATCH = "record batch ids strictly increase (one decision per batch)"
    COMMIT_AFTER_SAFE_RECORD = "phase 2 happens only for a snapshot whose record is safe"
    LAST_GOOD_NEVER_REVERTS = "the last good snapshot never reverts to an older one"


def _violation(invariant: Invariant, detail: str) -> ProtocolViolation:
    return ProtocolViolation(f"invariant broken: {invariant.value}: {detail}")


@dataclass(frozen=True)
class TxnHandle:
    """One partition's staged transaction, as returned by phase 1."""

    partition: int
    handle: str  # target-specific id: a staged file path, a prepared-xact gid, ...
    rows: int
    bytes: int
    checksum: str
    meta: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "partition": self.partition,
            "handle": self.handle,
            "rows": self.rows,
            "bytes": self.bytes,
            "checksum": self.checksum,
            "meta": dict(self.meta),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> TxnHandle:
        return cls(
            partition=d["partition"],
            handle=d["handle"],
            rows=d["rows"],
            bytes=d["bytes"],
            checksum=d["checksum"],
            meta=d.get("meta", {}),
        )


@dataclass(frozen=True)
class SnapshotRecord:
    """The verification record: the commit decision and everything phase 2 needs."""

    sink_id: str
    snapshot_id: int
    batch_id: int
    epoch: int
    kind: SnapshotKind
    txns: tuple[TxnHandle, ...]
    source_offsets: tuple[Any, ...] = ()
    query_id: str | None = None
    target: Mapping[str, Any] = field(default_factory=dict)
    created_at: datetime | None = None

    @property
    def rows(self) -> int:
        return sum(t.rows for t in self.txns)

    def to_event(self, seq: int) -> Event:
        return Event(
            stream=self.sink_id,
            seq=seq,
            kind=EventKind.SNAPSHOT,
            epoch=self.epoch,
            snapshot_id=self.snapshot_id,
            batch_id=self.batch_id,
            query_id=self.query_id,
            payload={
                "kind": self.kind.value,
                "rows": self.rows,
                "txns": [t.to_json() for t in self.txns],
                "source_offsets": list(self.source_offsets),
                "target": dict(self.target),
            },
        )

    @classmethod
    def from_event(cls, e: Event) -> SnapshotRecord:
        p = e.payload
        return cls(
            sink_id=e.stream,
            snapshot_id=e.snapshot_id,
            batch_id=e.batch_id,
            epoch=e.epoch,
            kind=SnapshotKind(p["kind"]),
            txns=tuple(TxnHandle.from_json(t) for t in p["txns"]),
            source_offsets=tuple(p.get("source_offsets", ())),
            query_id=e.query_id,
            target=p.get("target", {}),
            created_at=e.created_at,
        )


@dataclass(frozen=True)
class ExecutionRecord:
    """What a sink is doing: the view the protocol and users reason about."""

    sink_id: str
    epoch: int
    snapshot_id: int  # last good (safe record); NO_SNAPSHOT if none
    ongoing_snapshot_id: int  # last allocated; may be abandoned
    last_committed_batch_id: int | None
    query_id: str | None


@dataclass(frozen=True)
class SinkState:
    """A fold over one sink's events. Build it with :func:`fold_sink`."""

    sink_id: str
    next_seq: int = 0
    epoch: int = 0
    epoch_owner: str | None = None
    query_id: str | None = None
    ongoing_snapshot_id: int = NO_SNAPSHOT
    ongoing_epoch: int = 0
    records: Mapping[int, SnapshotRecord] = field(default_factory=lambda: MappingProxyType({}))
    last_record: SnapshotRecord | None = None
    committed: Mapping[int, int] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def snapshot_id(self) -> int:
        return self.last_record.snapshot_id if self.last_record else NO_SNAPSHOT

    @property
    def execution_record(self) -> ExecutionRecord:
        done = [r.batch_id for r in self.records.values() if r.snapshot_id in self.committed]
        return ExecutionRecord(
            sink_id=self.sink_id,
            epoch=self.epoch,
            snapshot_id=self.snapshot_id,
            ongoing_snapshot_id=self.ongoing_snapshot_id,
            last_committed_batch_id=max(done) if done else None,
            query_id=self.query_id,
        )

    def record_for_snapshot(self, snapshot_id: int) -> SnapshotRecord | None:
        for r in self.records.values():
            if r.snapshot_id == snapshot_id:
                return r
        return None

    def apply(self, e: Event) -> SinkState:
        """Fold one event in, refusing any event that breaks an invariant."""
        if e.seq != self.next_seq:
            raise _violation(
                Invariant.SEQ_GAP_FREE, f"{self.sink_id}: expected seq {self.next_seq}, got {e.seq}"
            )
        s = replace(self, next_seq=e.seq + 1)
        if e.kind is EventKind.EPOCH:
            if e.epoch <= self.epoch:
                raise _violation(Invariant.EPOCHS_INCREASE, f"epoch {e.epoch} after {self.epoch}")
            return replace(
                s, epoch=e.epoch, epoch_owner=e.payload.get("owner"), query_id=e.query_id
            )
        if e.kind is EventKind.ALLOCATED:
            if e.snapshot_id <= self.ongoing_snapshot_id:
                raise _violation(
                    Invariant.IDS_STRICTLY_INCREASE,
                    f"allocated {e.snapshot_id} after {self.ongoing_snapshot_id}",
                )
            return replace(s, ongoing_snapshot_id=e.snapshot_id, ongoing_epoch=e.epoch)
        if e.kind is EventKind.SNAPSHOT:
            rec = SnapshotRecord.from_event(e)
            if rec.snapshot_id != self.ongoing_snapshot_id:
                raise _violation(
                    Invariant.ONE_IN_PROGRESS,
                    f"record for snapshot {rec.snapshot_id} while {self.ongoing_snapshot_id} "
                    "is the one in progress",
                )
            if rec.epoch != self.ongoing_epoch:
                raise _violation(
                    Invariant.RECORD_WAS_ALLOCATED,
                    f"snapshot {rec.snapshot_id} allocated by epoch {self.ongoing_epoch}, "
                    f"recorded by epoch {rec.epoch}",
                )
            if rec.snapshot_id <= self.snapshot_id:
                raise _violation(
                    Invariant.LAST_GOOD_NEVER_REVERTS,
                    f"record {rec.snapshot_id} after last good {self.snapshot_id}",
                )
            if self.last_record is not None and rec.batch_id <= self.last_record.batch_id:
                raise _violation(
                    Invariant.ONE_RECORD_PER_BATCH,
                    f"batch {rec.batch_id} recorded after batch {self.last_record.batch_id}",
                )
            records = dict(self.records)
            records[rec.batch_id] = rec
            return replace(s, records=MappingProxyType(records), last_record=rec)
        if e.kind is EventKind.COMMITTED:
            if self.record_for_snapshot(e.snapshot_id) is None:
                raise _violation(
                    Invariant.COMMIT_AFTER_SAFE_RECORD,
                    f"snapshot {e.snapshot_id} committed without a safe record",
                )
            committed = dict(self.committed)
            committed[e.snapshot_id] = e.payload.get("target_version")
            return replace(s, committed=MappingProxyType(committed))
        raise ProtocolViolation(f"{self.sink_id}: event kind {e.kind.value} is not a sink event")


def fold(state: S, events: Iterable[Event]) -> S:
    """Apply ``events`` in order to any state with an ``apply`` method."""
    for e in events:
        state = state.apply(e)
    return state


def fold_sink(sink_id: str, events: Iterable[Event]) -> SinkState:
    return fold(SinkState(sink_id=sink_id), events)


def check_invariants(sink_id: str, events: Iterable[Event]) -> SinkState:
    """Raise ``ProtocolViolation`` naming the first broken invariant, else return the fold."""
    return fold_sink(sink_id, events)


# --- transitions -----------------------------------------------------------


def begin_epoch(
    state: SinkState, owner: str, query_id: str | None, query_name: str | None = None
) -> Event:
    """A new run takes the sink over; every older run is fenced from now on."""
    check_query(state, query_id)
    return Event(
        stream=state.sink_id,
        seq=state.next_seq,
        kind=EventKind.EPOCH,
        epoch=state.epoch + 1,
        query_id=query_id if query_id is not None else state.query_id,
        payload={"owner": owner, "query_name": query_name},
    )


def check_epoch(state: SinkState, epoch: int) -> None:
    if epoch != state.epoch:
        raise FencedError(
            f"sink {state.sink_id!r}: this run holds epoch {epoch} but epoch {state.epoch} "
            f"was taken by a newer run (owner {state.epoch_owner}); two queries must never "
            "write as the same sink. Stop the other query, or give each its own sinkId."
        )


def allocate(state: SinkState, epoch: int) -> Event:
    """Reserve the next snapshot id; it is never reused, even if the attempt fails."""
    check_epoch(state, epoch)
    return Event(
        stream=state.sink_id,
        seq=state.next_seq,
        kind=EventKind.ALLOCATED,
        epoch=epoch,
        snapshot_id=state.ongoing_snapshot_id + 1,
        query_id=state.query_id,
    )


@dataclass(frozen=True)
class Replay:
    """The batch was decided before: redo phase 2 of ``record``, discard the new attempt."""

    record: SnapshotRecord


@dataclass(frozen=True)
class Decide:
    """A new decision: make the record safe, then run phase 2."""


def check_query(state: SinkState, query_id: str | None) -> None:
    """The checkpoint must belong to the query that wrote this sink's history."""
    if state.query_id is not None and query_id is not None and state.query_id != query_id:
        raise CheckpointMismatchError(
            f"sink {state.sink_id!r} was written by streaming query {state.query_id} but the "
            f"checkpoint now belongs to query {query_id}: the checkpoint was deleted or replaced. "
            "Restarting would skip or duplicate data. Restore the original checkpoint, or give "
            "the new query its own sink (option sinkId) and target."
        )


def decide(
    state: SinkState, batch_id: int, snapshot_id: int, epoch: int, query_id: str | None = None
) -> Replay | Decide:
    check_query(state, query_id)
    check_epoch(state, epoch)
    done = state.records.get(batch_id)
    if done is not None:
        return Replay(done)
    last = state.last_record
    if last is not None and batch_id < last.batch_id:
        raise CheckpointMismatchError(
            f"sink {state.sink_id!r}: Spark asks to commit batch {batch_id}, but batch "
            f"{last.batch_id} is already recorded and batch {batch_id} never was: Spark's "
            "checkpoint is older than the record table (restored or replaced). Refusing to "
            "guess; restore the matching checkpoint."
        )
    if snapshot_id != state.ongoing_snapshot_id or state.ongoing_epoch != epoch:
        raise ProtocolViolation(
            f"invariant broken: {Invariant.ONE_IN_PROGRESS.value}: sink {state.sink_id!r} "
            f"cannot record snapshot {snapshot_id} (epoch {epoch}); the snapshot in progress "
            f"is {state.ongoing_snapshot_id} (epoch {state.ongoing_epoch})"
        )
    return Decide()


def record_snapshot(state: SinkState, record: SnapshotRecord) -> Event:
    decision = decide(state, record.batch_id, record.snapshot_id, record.epoch, record.query_id)
    if isinstance(decision, Replay):
        raise ProtocolViolation(
            f"batch {record.batch_id} of sink {state.sink_id!r} is already decided "
            f"(snapshot {decision.record.snapshot_id})"
        )
    return record.to_event(state.next_seq)


def mark_committed(state: SinkState, snapshot_id: int, target_version: int | None) -> Event:
    rec = state.record_for_snapshot(snapshot_id)
    if rec is None:
        raise _violation(Invariant.COMMIT_AFTER_SAFE_RECORD, f"no record for {snapshot_id}")
    return Event(
        stream=state.sink_id,
        seq=state.next_seq,
        kind=EventKind.COMMITTED,
        epoch=state.epoch,
        snapshot_id=snapshot_id,
        batch_id=rec.batch_id,
        query_id=state.query_id,
        payload={"target_version": target_version},
    )


def orphan_snapshot_ids(
    state: SinkState, staged: Iterable[int], in_flight: int | None = None
) -> set[int]:
    """Staged snapshot ids that no safe record references: safe to roll back.

    ``in_flight`` is the attempt being decided right now, never an orphan. A
    snapshot with a safe record is never returned, whatever its phase 2 state.
    """
    recorded = {r.snapshot_id for r in state.records.values()}
    return {s for s in staged if s not in recorded and s != in_flight}


def pending_phase2(state: SinkState) -> list[SnapshotRecord]:
    """Safe records whose phase 2 was never confirmed: recovery redoes them."""
    return sorted(
        (r for r in state.records.values() if r.snapshot_id not in state.committed),
        key=lambda r: r.snapshot_id,
    )
