"""The pure core of the protocol: records, the fold, transitions and invariants.

No IO and no Spark here. Every function takes a state (a fold over one
stream's events) and either returns the next event to append or raises the
error that says why the transition is not allowed. The IO shell appends the
event safely and folds it in; a crash anywhere loses only in-memory state,
which the fold rebuilds from the record table.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from enum import Enum
from types import MappingProxyType
from typing import Any, Protocol, TypeVar

from ..errors import (
    CheckpointMismatchError,
    FencedError,
    ProtocolViolation,
    SnapshotWithdrawnError,
    TxnError,
)
from .events import Event, EventKind

NO_SNAPSHOT = -1

_T = TypeVar("_T", bound="Foldable")


class Foldable(Protocol):
    """A state that events fold into (a sink's, an offset log's)."""

    def apply(self: _T, e: Event) -> _T: ...


S = TypeVar("S", bound=Foldable)


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
    RECORD_WAS_ALLOCATED = "a snapshot record names an allocated id that was never abandoned"
    ONE_WRITER = "only the run holding the current epoch writes snapshot records"
    ONE_RECORD_PER_BATCH = "record batch ids strictly increase (one decision per batch)"
    COMMIT_AFTER_SAFE_RECORD = "phase 2 happens only for a snapshot whose record is safe"
    LAST_GOOD_NEVER_REVERTS = (
        "snapshot records strictly increase; only an explicit abandon withdraws one"
    )
    ABANDON_ONLY_UNDECIDED = "only an allocation or an uncommitted last record can be abandoned"
    SUMMARY_RESTATES = "a summary restates the fold of the events before it"
    NAME_UNIQUE = "a snapshot name is registered at most once while it exists"
    NAMED_ID_OWN = "a named snapshot has its own allocated id, used by nothing else"


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


def new_token() -> str:
    """A random tag that makes one allocation's staged artifacts unique.

    Two sinks that share a sink id (two record tables, a copied checkpoint)
    allocate the same snapshot ids; the token keeps their staged artifacts
    apart, so one's cleanup can never touch the other's.
    """
    return uuid.uuid4().hex[:10]


#: The token of an export's allocation starts so: status tells an export's id (no
#: batch, nothing staged) from a batch's, and never advises abandoning it as a batch.
EXPORT_TOKEN_PREFIX = "export-"


def is_export_token(token: str) -> bool:
    return token.startswith(EXPORT_TOKEN_PREFIX)


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
    token: str = ""  # the allocation's token: names the staged artifacts
    run_id: str | None = None  # the Spark query run that decided it
    # Unique per record: phase 2 stamps it on the target's commit, so "the
    # target already has it" is checked against this record, not a batch number.
    record_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Phase 2 of earlier records, done before this one was decided: snapshot id ->
    # target version. Saves a ``committed`` write per batch.
    confirms: Mapping[int, int | None] = field(default_factory=dict)

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
                "token": self.token,
                "run_id": self.run_id,
                "record_id": self.record_id,
                **(
                    {"confirms": {str(k): v for k, v in self.confirms.items()}}
                    if self.confirms
                    else {}
                ),
            },
        )

    @classmethod
    def from_event(cls, e: Event) -> SnapshotRecord:
        p = e.payload
        return cls(
            sink_id=e.stream,
            snapshot_id=_id(e),
            batch_id=_batch(e),
            epoch=e.epoch,
            kind=SnapshotKind(p["kind"]),
            txns=tuple(TxnHandle.from_json(t) for t in p["txns"]),
            source_offsets=tuple(p.get("source_offsets", ())),
            query_id=e.query_id,
            target=p.get("target", {}),
            created_at=e.created_at,
            token=p.get("token", ""),
            run_id=p.get("run_id"),
            record_id=p.get("record_id") or e.event_id,
            confirms=_confirms(e),
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
    run_id: str | None = None  # the run holding the epoch


@dataclass(frozen=True)
class NamedSnapshot:
    """A registry entry: an exported snapshot, kept under a name until deleted.

    ``snapshot_id`` is its own id (allocated for the export, never reused);
    ``of_snapshot_id`` / ``batch_id`` / ``target_version`` say which committed
    state of the sink it holds; ``details`` is what verify compares against
    (rows, files with sizes and CRC32s, Spark's offsets, where it lives).
    """

    name: str
    snapshot_id: int
    of_snapshot_id: int
    batch_id: int
    location: str
    target_version: int | None
    details: Mapping[str, Any] = field(default_factory=dict)
    created_at: datetime | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "snapshot_id": self.snapshot_id,
            "of_snapshot_id": self.of_snapshot_id,
            "batch_id": self.batch_id,
            "location": self.location,
            "target_version": self.target_version,
            "details": dict(self.details),
            "created_at": self.created_at.isoformat() if self.created_at else None,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> NamedSnapshot:
        created = d.get("created_at")
        return cls(
            name=d["name"],
            snapshot_id=d["snapshot_id"],
            of_snapshot_id=d["of_snapshot_id"],
            batch_id=d["batch_id"],
            location=d["location"],
            target_version=d.get("target_version"),
            details=d.get("details") or {},
            created_at=datetime.fromisoformat(created) if created else None,
        )


@dataclass(frozen=True)
class ExportRequest:
    """An export the sink makes at its next commit, so the cut is that committed batch."""

    name: str
    location: str
    requested_seq: int
    requested_at: datetime | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "location": self.location,
            "requested_seq": self.requested_seq,
            "requested_at": self.requested_at.isoformat() if self.requested_at else None,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ExportRequest:
        at = d.get("requested_at")
        return cls(
            name=d["name"],
            location=d["location"],
            requested_seq=d["requested_seq"],
            requested_at=datetime.fromisoformat(at) if at else None,
        )


#: What may name a folder, a Delta app transaction and be typed in a shell: sink
#: ids and snapshot names alike.
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")
MAX_NAME_LENGTH = 128


def check_snapshot_name(name: str) -> str:
    """Raise ``ConfigError`` unless ``name`` can name a snapshot."""
    from ..errors import ConfigError

    if not isinstance(name, str) or not name:
        raise ConfigError("snapshot name: must not be empty")
    if len(name) > MAX_NAME_LENGTH:
        raise ConfigError(
            f"snapshot name {name[:20]!r}...: {len(name)} characters, at most {MAX_NAME_LENGTH}"
        )
    bad = sorted(set(name) - NAME_CHARS)
    if bad or name.startswith(".") or ".." in name:
        raise ConfigError(
            f"snapshot name {name!r}: use letters, digits, '-', '_' and '.' only, not starting "
            "with '.' and without '..'" + (f" (found {''.join(bad)!r})" if bad else "")
        )
    return name


def _id(e: Event) -> int:
    """The snapshot id an event of this kind must carry."""
    if e.snapshot_id is None:
        raise ProtocolViolation(f"{e.stream}: {e.kind.value} event #{e.seq} has no snapshot id")
    return e.snapshot_id


def _batch(e: Event) -> int:
    if e.batch_id is None:
        raise ProtocolViolation(f"{e.stream}: {e.kind.value} event #{e.seq} has no batch id")
    return e.batch_id


def _frozen(d: Mapping) -> Mapping:
    return MappingProxyType(dict(d))


@dataclass(frozen=True)
class SinkState:
    """A fold over one sink's events. Build it with :func:`fold_sink`.

    ``high_water`` is the highest snapshot id ever recorded or abandoned. It
    only grows, and no id at or below it can ever be recorded again: that is
    what makes a staged snapshot *provably dead* (see :func:`dead_snapshots`).
    """

    sink_id: str
    next_seq: int = 0
    epoch: int = 0
    epoch_owner: str | None = None
    epoch_floor: int = NO_SNAPSHOT  # the snapshot id the current owner took over with
    owners: tuple[str, ...] = ()  # the runs that held an epoch, oldest first (bounded)
    query_id: str | None = None
    ongoing_snapshot_id: int = NO_SNAPSHOT
    allocations: Mapping[int, str] = field(default_factory=lambda: MappingProxyType({}))
    records: Mapping[int, SnapshotRecord] = field(default_factory=lambda: MappingProxyType({}))
    last_record: SnapshotRecord | None = None
    high_water: int = NO_SNAPSHOT
    abandoned: frozenset[int] = frozenset()
    committed: Mapping[int, int | None] = field(default_factory=lambda: MappingProxyType({}))
    summary_seq: int = 0  # seq of the last summary: the history before it may be gone
    named: Mapping[str, NamedSnapshot] = field(default_factory=lambda: MappingProxyType({}))
    # exports waiting for the next commit, and the last failure of each name
    export_requests: Mapping[str, ExportRequest] = field(
        default_factory=lambda: MappingProxyType({})
    )
    export_failures: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

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
            run_id=self.epoch_owner,
        )

    def record_for_snapshot(self, snapshot_id: int) -> SnapshotRecord | None:
        last = self.last_record
        if last is not None and last.snapshot_id == snapshot_id:
            return last
        for r in self.records.values():
            if r.snapshot_id == snapshot_id:
                return r
        return None

    def apply(self, e: Event) -> SinkState:
        """Fold one event in, refusing any event that breaks an invariant."""
        if e.seq != self.next_seq and not (self.next_seq == 0 and e.kind is EventKind.SUMMARY):
            # (a read may start at a summary: the events before it were deleted)
            raise _violation(
                Invariant.SEQ_GAP_FREE, f"{self.sink_id}: expected seq {self.next_seq}, got {e.seq}"
            )
        s = replace(self, next_seq=e.seq + 1)
        if e.kind is EventKind.EPOCH:
            if e.epoch <= self.epoch:
                raise _violation(Invariant.EPOCHS_INCREASE, f"epoch {e.epoch} after {self.epoch}")
            owner = e.payload.get("owner")
            floor = e.payload.get("from_snapshot")
            return replace(
                s,
                epoch=e.epoch,
                epoch_owner=owner,
                epoch_floor=self.epoch_floor if floor is None else floor,
                owners=(*self.owners, owner) if owner else self.owners,
                query_id=e.query_id,
            )
        if e.kind is EventKind.ALLOCATED:
            sid = _id(e)
            if sid <= self.ongoing_snapshot_id:
                raise _violation(
                    Invariant.IDS_STRICTLY_INCREASE,
                    f"allocated {sid} after {self.ongoing_snapshot_id}",
                )
            allocations = dict(self.allocations)
            allocations[sid] = e.payload.get("token", "")
            return replace(s, ongoing_snapshot_id=sid, allocations=MappingProxyType(allocations))
        if e.kind is EventKind.SNAPSHOT:
            rec = SnapshotRecord.from_event(e)
            if rec.snapshot_id not in self.allocations or rec.snapshot_id in self.abandoned:
                raise _violation(
                    Invariant.RECORD_WAS_ALLOCATED,
                    f"record for snapshot {rec.snapshot_id}, which was "
                    + ("abandoned" if rec.snapshot_id in self.abandoned else "never allocated"),
                )
            if rec.epoch != self.epoch:
                raise _violation(
                    Invariant.ONE_WRITER,
                    f"snapshot {rec.snapshot_id} recorded by epoch {rec.epoch} while epoch "
                    f"{self.epoch} holds the sink",
                )
            if rec.snapshot_id <= self.high_water:
                raise _violation(
                    Invariant.LAST_GOOD_NEVER_REVERTS,
                    f"record {rec.snapshot_id} after snapshot {self.high_water}",
                )
            if self.last_record is not None and rec.batch_id <= self.last_record.batch_id:
                raise _violation(
                    Invariant.ONE_RECORD_PER_BATCH,
                    f"batch {rec.batch_id} recorded after batch {self.last_record.batch_id}",
                )
            confirmed = _confirms(e)
            for sid in confirmed:
                prior = self.record_for_snapshot(sid)
                if prior is None or prior.snapshot_id >= rec.snapshot_id:
                    raise _violation(
                        Invariant.COMMIT_AFTER_SAFE_RECORD,
                        f"record {rec.snapshot_id} confirms phase 2 of snapshot {sid}, "
                        "which has no earlier safe record",
                    )
            records = dict(self.records)
            records[rec.batch_id] = rec
            committed = self.committed
            if confirmed:
                committed = _frozen({**self.committed, **confirmed})
            return replace(
                s,
                records=_frozen(records),
                last_record=rec,
                high_water=rec.snapshot_id,
                committed=committed,
            )
        if e.kind is EventKind.COMMITTED:
            sid = _id(e)
            if self.record_for_snapshot(sid) is None:
                raise _violation(
                    Invariant.COMMIT_AFTER_SAFE_RECORD,
                    f"snapshot {sid} committed without a safe record",
                )
            return replace(
                s, committed=_frozen({**self.committed, sid: e.payload.get("target_version")})
            )
        if e.kind is EventKind.ABANDONED:
            sid = _id(e)
            if sid not in self.allocations or sid in self.abandoned or sid in self.committed:
                raise _violation(
                    Invariant.ABANDON_ONLY_UNDECIDED,
                    f"snapshot {sid} is not an open allocation or uncommitted record",
                )
            withdrawn = self.record_for_snapshot(sid)
            if withdrawn is None:
                return replace(s, abandoned=self.abandoned | {sid})
            if withdrawn is not self.last_record:
                raise _violation(
                    Invariant.ABANDON_ONLY_UNDECIDED, f"snapshot {sid} is not the last record"
                )
            records = {b: r for b, r in self.records.items() if r.snapshot_id != sid}
            last = max(records.values(), key=lambda r: r.snapshot_id) if records else None
            return replace(
                s,
                records=_frozen(records),
                last_record=last,
                abandoned=self.abandoned | {sid},
                high_water=max(self.high_water, sid),
            )
        if e.kind is EventKind.SUMMARY:
            return _from_summary(s, e, continuing=self.next_seq == e.seq)
        if e.kind is EventKind.NAMED:
            entry = NamedSnapshot.from_json({**e.payload, "created_at": None})
            entry = replace(entry, created_at=e.created_at)
            if entry.name in self.named:
                raise _violation(Invariant.NAME_UNIQUE, f"{entry.name!r} is already registered")
            sid = entry.snapshot_id
            if named_id_problem(self, sid) is not None:
                raise _violation(
                    Invariant.NAMED_ID_OWN,
                    f"{entry.name!r} names snapshot id {sid}, which was not allocated for it",
                )
            return replace(
                s,
                named=_frozen({**self.named, entry.name: entry}),
                export_requests=_without(self.export_requests, entry.name),
                export_failures=_without(self.export_failures, entry.name),
            )
        if e.kind is EventKind.EXPORT_REQUESTED:
            name = e.payload["name"]
            if name in self.named or name in self.export_requests:
                raise _violation(Invariant.NAME_UNIQUE, f"{name!r} requested while taken")
            request = ExportRequest(name, e.payload["location"], e.seq, e.created_at)
            return replace(
                s,
                export_requests=_frozen({**self.export_requests, name: request}),
                export_failures=_without(self.export_failures, name),
            )
        if e.kind is EventKind.EXPORT_FAILED:
            name = e.payload["name"]
            if name not in self.export_requests:
                raise _violation(Invariant.NAME_UNIQUE, f"{name!r} failed but not requested")
            return replace(
                s,
                export_requests=_without(self.export_requests, name),
                export_failures=_frozen({**self.export_failures, name: e.payload["error"]}),
            )
        if e.kind is EventKind.NAME_DELETED:
            name = e.payload.get("name")
            if name not in self.named:
                raise _violation(Invariant.NAME_UNIQUE, f"{name!r} deleted but not registered")
            return replace(s, named=_frozen({k: v for k, v in self.named.items() if k != name}))
        raise ProtocolViolation(f"{self.sink_id}: event kind {e.kind.value} is not a sink event")


def _without(d: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    return d if key not in d else _frozen({k: v for k, v in d.items() if k != key})


def _confirms(e: Event) -> dict[int, int | None]:
    """Phase 2 confirmations a snapshot record carries for earlier records."""
    return {int(sid): v for sid, v in (e.payload.get("confirms") or {}).items()}


def _record_to_json(rec: SnapshotRecord) -> dict[str, Any]:
    e = rec.to_event(0)
    return {
        "snapshot_id": rec.snapshot_id,
        "batch_id": rec.batch_id,
        "epoch": rec.epoch,
        "query_id": rec.query_id,
        "created_at": rec.created_at.isoformat() if rec.created_at else None,
        "payload": e.payload,
    }


def _record_from_json(sink_id: str, d: Mapping[str, Any]) -> SnapshotRecord:
    created = d.get("created_at")
    event = Event(
        stream=sink_id,
        seq=0,
        kind=EventKind.SNAPSHOT,
        epoch=d["epoch"],
        snapshot_id=d["snapshot_id"],
        batch_id=d["batch_id"],
        query_id=d.get("query_id"),
        payload=d["payload"],
    )
    if created:
        event = replace(event, created_at=datetime.fromisoformat(created))
    return SnapshotRecord.from_event(event)


#: Runs a summary keeps for fencing: a run older than these is also fenced by
#: the snapshot ids it holds (they are below the current owner's floor).
SUMMARY_OWNERS = 1000


def _from_summary(s: SinkState, e: Event, continuing: bool) -> SinkState:
    """The state a summary restates. Continuing a fold, it must agree with the events
    before it (then it bounds the in-memory state too); a read may also start at it."""
    p = e.payload
    if continuing:
        restated = (e.epoch, p["high_water"], p["ongoing_snapshot_id"])
        mine = (s.epoch, s.high_water, s.ongoing_snapshot_id)
        if restated != mine:
            raise _violation(
                Invariant.SUMMARY_RESTATES,
                f"summary #{e.seq} says (epoch, high water, ongoing) = {restated}, "
                f"the events before it say {mine}",
            )
    records = [_record_from_json(s.sink_id, r) for r in p["records"]]
    by_batch = {r.batch_id: r for r in records}
    return replace(
        s,
        next_seq=e.seq + 1,
        epoch=e.epoch,
        epoch_owner=p.get("epoch_owner"),
        epoch_floor=p["epoch_floor"],
        owners=tuple(p.get("owners") or ()),
        query_id=e.query_id,
        ongoing_snapshot_id=p["ongoing_snapshot_id"],
        allocations=_frozen({int(k): v for k, v in p["allocations"].items()}),
        records=_frozen(by_batch),
        last_record=max(records, key=lambda r: r.snapshot_id) if records else None,
        high_water=p["high_water"],
        abandoned=frozenset(p["abandoned"]),
        committed=_frozen({int(k): v for k, v in p["committed"].items()}),
        summary_seq=e.seq,
        named=_frozen({d["name"]: NamedSnapshot.from_json(d) for d in p.get("named", ())}),
        export_requests=_frozen(
            {d["name"]: ExportRequest.from_json(d) for d in p.get("export_requests", ())}
        ),
        export_failures=_frozen(p.get("export_failures") or {}),
    )


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


def check_query(state: SinkState, query_id: str | None) -> None:
    """The checkpoint must belong to the query that wrote this sink's history."""
    if state.query_id is not None and query_id is not None and state.query_id != query_id:
        raise CheckpointMismatchError(
            f"sink {state.sink_id!r} was written by streaming query {state.query_id} but the "
            f"checkpoint now belongs to query {query_id}: the checkpoint was deleted or replaced. "
            "Restarting would skip or duplicate data. Restore the original checkpoint, or give "
            "the new query its own sink (option sinkId) and target."
        )


def take_over(
    state: SinkState,
    run_id: str,
    snapshot_id: int | None,
    query_id: str | None,
    query_name: str | None = None,
) -> Event | None:
    """Fence every older run if ``run_id`` is a run this sink has not seen yet.

    A run is one start of a Spark query (Spark's ``runId``). Runs are ordered
    by the snapshot id they take over with: ids are allocated in time order,
    so a run whose attempt was allocated before the current owner took over
    started before it and is a zombie. Returns the ``epoch`` event to append,
    or None when ``run_id`` already holds the epoch.
    """
    check_query(state, query_id)
    if run_id == state.epoch_owner:
        return None
    if run_id in state.owners:
        raise _fenced(state, f"run {run_id}")
    if snapshot_id is not None and snapshot_id < state.epoch_floor:
        raise _fenced(
            state,
            f"run {run_id} (its snapshot {snapshot_id} was allocated before run "
            f"{state.epoch_owner} took over with snapshot {state.epoch_floor})",
        )
    return Event(
        stream=state.sink_id,
        seq=state.next_seq,
        kind=EventKind.EPOCH,
        epoch=state.epoch + 1,
        query_id=query_id if query_id is not None else state.query_id,
        payload={"owner": run_id, "query_name": query_name, "from_snapshot": snapshot_id},
    )


def _fenced(state: SinkState, who: str) -> FencedError:
    return FencedError(
        f"sink {state.sink_id!r}: {who} was fenced: epoch {state.epoch} was taken by a newer "
        f"run ({state.epoch_owner}); two runs must never write as the same sink. Stop the "
        "other query, or give each its own checkpoint (and sinkId)."
    )


def check_epoch(state: SinkState, epoch: int) -> None:
    if epoch != state.epoch:
        raise _fenced(state, f"the run holding epoch {epoch}")


def allocate(state: SinkState, token: str | None = None) -> Event:
    """Reserve the next snapshot id; it is never reused, even if the attempt fails.

    Allocation is not fenced: Spark plans a batch in a pooled Python worker
    that cannot tell which run it plans for. An allocation is only a
    reservation; the run that records it is fenced (:func:`take_over`).
    """
    return Event(
        stream=state.sink_id,
        seq=state.next_seq,
        kind=EventKind.ALLOCATED,
        epoch=state.epoch,
        snapshot_id=state.ongoing_snapshot_id + 1,
        query_id=state.query_id,
        payload={"token": token if token is not None else new_token()},
    )


@dataclass(frozen=True)
class Replay:
    """The batch was decided before: redo phase 2 of ``record``, discard the new attempt."""

    record: SnapshotRecord


@dataclass(frozen=True)
class Decide:
    """A new decision: make the record safe, then run phase 2."""


def _same_offsets(a: Sequence[Any], b: Sequence[Any]) -> bool:
    canon = lambda v: json.dumps(list(v), sort_keys=True, default=str)  # noqa: E731
    return canon(a) == canon(b)


def decide(
    state: SinkState,
    batch_id: int,
    snapshot_id: int,
    epoch: int,
    query_id: str | None = None,
    source_offsets: Sequence[Any] | None = None,
) -> Replay | Decide:
    """Whether ``batch_id`` is a replay of a decided batch or needs a new decision.

    A replay must carry the offsets the batch was decided with: Spark's offset
    log and the record table disagreeing means the checkpoint was reset or
    replaced, and trusting the record would skip the new offsets' data.
    """
    check_query(state, query_id)
    check_epoch(state, epoch)
    done = state.records.get(batch_id)
    if done is not None:
        if (
            source_offsets is not None
            and done.source_offsets
            and not _same_offsets(done.source_offsets, source_offsets)
        ):
            raise CheckpointMismatchError(
                f"sink {state.sink_id!r}: batch {batch_id} was decided as snapshot "
                f"{done.snapshot_id} with source offsets {list(done.source_offsets)}, but "
                f"Spark's checkpoint now has {list(source_offsets)} for it: the checkpoint's "
                "offsets were reset or replaced. Treating it as a replay would skip data. "
                "Restore the original checkpoint, or start a new query with its own "
                "checkpoint and sink."
            )
        return Replay(done)
    last = state.last_record
    if last is not None and batch_id < last.batch_id:
        raise CheckpointMismatchError(
            f"sink {state.sink_id!r}: Spark asks to commit batch {batch_id}, but batch "
            f"{last.batch_id} is already recorded and batch {batch_id} never was: Spark's "
            "checkpoint is older than the record table (restored or replaced). Refusing to "
            "guess; restore the matching checkpoint."
        )
    if snapshot_id not in state.allocations or snapshot_id in state.abandoned:
        how = (
            "abandoned (by Spark's abort or `pyspark-txn abandon`)"
            if snapshot_id in state.abandoned
            else "never allocated"
        )
        raise _violation(
            Invariant.RECORD_WAS_ALLOCATED,
            f"sink {state.sink_id!r} cannot record snapshot {snapshot_id}: it was {how}",
        )
    if snapshot_id <= state.high_water:
        raise _violation(
            Invariant.LAST_GOOD_NEVER_REVERTS,
            f"sink {state.sink_id!r} cannot record snapshot {snapshot_id}: snapshot "
            f"{state.high_water} was decided after it was allocated (a newer attempt won)",
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


def abandon(state: SinkState, snapshot_id: int, reason: str) -> Event | None:
    """Withdraw an allocation, or a safe record whose phase 2 can never succeed.

    Returns None when there is nothing to withdraw (already abandoned). A
    committed record can never be abandoned, nor any record but the last.
    """
    if snapshot_id in state.abandoned:
        return None
    rec = state.record_for_snapshot(snapshot_id)
    if snapshot_id not in state.allocations:
        raise TxnError(f"sink {state.sink_id!r}: snapshot {snapshot_id} was never allocated")
    if snapshot_id in state.committed:
        raise TxnError(
            f"sink {state.sink_id!r}: snapshot {snapshot_id} is committed (batch "
            f"{rec.batch_id if rec else '?'}); a committed snapshot can never be abandoned"
        )
    if rec is not None and rec is not state.last_record:
        raise TxnError(
            f"sink {state.sink_id!r}: snapshot {snapshot_id} is not the last record; only "
            f"the last one (snapshot {state.snapshot_id}) can be abandoned"
        )
    for entry in state.named.values():
        if entry.snapshot_id == snapshot_id:
            raise TxnError(
                f"sink {state.sink_id!r}: snapshot id {snapshot_id} belongs to the named "
                f"snapshot {entry.name!r}; delete the snapshot instead"
            )
    return Event(
        stream=state.sink_id,
        seq=state.next_seq,
        kind=EventKind.ABANDONED,
        epoch=state.epoch,
        snapshot_id=snapshot_id,
        batch_id=rec.batch_id if rec else None,
        query_id=state.query_id,
        payload={"reason": reason, "was_recorded": rec is not None},
    )


def dead_snapshots(state: SinkState, staged: Iterable[tuple[int, str]]) -> set[tuple[int, str]]:
    """Staged ``(snapshot id, token)`` attempts that can never be committed: safe to delete.

    Dead means: allocated by this stream with this token, not named by a safe
    record, and either abandoned or below ``high_water`` (ids only get
    recorded above it). Every one of these facts, once true, stays true, so
    the answer is safe on a *stale* state too: a zombie that read the log long
    ago can never delete what a newer run recorded or is still staging.
    Attempts of other streams (unknown token) and ids newer than the state
    are never returned.
    """
    live = {r.snapshot_id for r in state.records.values()}
    return {
        (sid, token)
        for sid, token in staged
        if state.allocations.get(sid) == token
        and sid not in live
        and (sid in state.abandoned or sid < state.high_water)
    }


#: Snapshot ids allocated after an attempt before no task of it can still be writing.
SETTLE_IDS = 32


def settled(state: SinkState, snapshot_id: int) -> bool:
    """Whether ``snapshot_id``'s tasks are certainly over: many batches were decided since
    (Spark runs one batch at a time, and a late or speculative task of a batch ends long
    before dozens of later batches have been planned, run and committed)."""
    return snapshot_id + SETTLE_IDS <= state.high_water


def pending_phase2(state: SinkState) -> list[SnapshotRecord]:
    """Safe records whose phase 2 was never confirmed: recovery redoes them."""
    return sorted(
        (r for r in state.records.values() if r.snapshot_id not in state.committed),
        key=lambda r: r.snapshot_id,
    )


# --- retention -------------------------------------------------------------

#: Snapshot records a sink keeps by default; older history is summarized away.
DEFAULT_RETAIN_SNAPSHOTS = 100


def summary_due(state: SinkState, retain_snapshots: int, window_ids: int = 2 * SETTLE_IDS) -> bool:
    """Whether enough events piled up since the last summary to write a new one."""
    return state.next_seq - state.summary_seq >= 2 * retain_snapshots + window_ids


def summarize(state: SinkState, retain_snapshots: int, window_ids: int = 2 * SETTLE_IDS) -> Event:
    """The fold so far, bounded: after it lands, every older event may be deleted.

    Kept: every record from a floor on, the floor being the oldest of the last
    ``retain_snapshots`` records and of those whose phase 2 is unconfirmed, or
    ``window_ids`` ids below the high-water mark if that is lower (what sweeps
    ask about); allocations, abandons and commits from the floor on; the
    allocation high-water mark, epoch and recent owners, so ids are never
    reused and old runs stay fenced.

    An allocation is never kept without its record: :func:`dead_snapshots`
    would take a committed attempt whose record is gone for a dead one.
    Attempts below the floor are unknown afterwards, and never deleted.
    """
    if retain_snapshots < 1:
        raise TxnError(f"retain_snapshots={retain_snapshots}: keep at least the last record")
    by_id = sorted(state.records.values(), key=lambda r: r.snapshot_id)
    newest = [r.snapshot_id for r in by_id[-retain_snapshots:]]
    floor = min([*newest, *(r.snapshot_id for r in pending_phase2(state))], default=0)
    floor = min(floor, state.high_water - window_ids)
    kept = {r.snapshot_id: r for r in by_id if r.snapshot_id >= floor}
    return Event(
        stream=state.sink_id,
        seq=state.next_seq,
        kind=EventKind.SUMMARY,
        epoch=state.epoch,
        query_id=state.query_id,
        payload={
            "epoch_owner": state.epoch_owner,
            "epoch_floor": state.epoch_floor,
            "owners": list(state.owners[-SUMMARY_OWNERS:]),
            "ongoing_snapshot_id": state.ongoing_snapshot_id,
            "high_water": state.high_water,
            "allocations": {str(k): v for k, v in state.allocations.items() if k >= floor},
            "abandoned": sorted(k for k in state.abandoned if k >= floor),
            "committed": {str(k): v for k, v in state.committed.items() if k in kept},
            "records": [_record_to_json(kept[k]) for k in sorted(kept)],
            "named": [n.to_json() for n in state.named.values()],
            "export_requests": [r.to_json() for r in state.export_requests.values()],
            "export_failures": dict(state.export_failures),
            "summarized_events": state.next_seq - state.summary_seq,
        },
    )


def bookkeeping_floor(state: SinkState) -> int | None:
    """The oldest snapshot id the record table still holds a record of; None if none.

    A target's bookkeeping of older ids (PostgreSQL's marker and batch rows) serves
    nobody: :func:`summarize` drops a record only after its phase 2 is confirmed and
    never a pending one, so no older id is committed, verified or listed again. The
    floor never falls, so a stale state (a zombie run) yields a lower one: it prunes
    less, never more.
    """
    return min((r.snapshot_id for r in state.records.values()), default=None)


# --- named snapshots ---------------------------------------------------------


def named_id_problem(state: SinkState, snapshot_id: int) -> str | None:
    """Why a registry entry may not use ``snapshot_id`` now, else None.

    The fold refuses exactly these entries, so :func:`register_named` checks the same
    on the state it appends to: an id withdrawn meanwhile (``settle``, ``abandon``)
    must never reach the log, or every later load fails.
    """
    # (its allocation may be summarized away while a long export runs: an id at or
    # below the allocation high-water mark was allocated exactly once)
    if snapshot_id > state.ongoing_snapshot_id:
        return "it was never allocated"
    if snapshot_id in state.abandoned:
        return "it was withdrawn (by `settle`, `stop_and_export` or `abandon`) while the export ran"
    if state.record_for_snapshot(snapshot_id) is not None:
        return "a snapshot record of the sink uses it"
    for other in state.named.values():
        if other.snapshot_id == snapshot_id:
            return f"snapshot {other.name!r} uses it"
    return None


def register_named(state: SinkState, entry: NamedSnapshot) -> Event:
    """The registry entry of an export, written last: only a complete export has one.

    Checked against ``state``, which the store appends to conditionally: a
    concurrent withdrawal of the export's id makes the append lose its race and
    this check run again on the fresh state, so it refuses instead of landing.
    """
    check_snapshot_name(entry.name)
    if entry.name in state.named:
        raise TxnError(
            f"sink {state.sink_id!r}: a snapshot named {entry.name!r} exists (snapshot "
            f"{state.named[entry.name].snapshot_id}); delete it first or choose another name"
        )
    problem = named_id_problem(state, entry.snapshot_id)
    if problem is not None:
        error = SnapshotWithdrawnError if entry.snapshot_id in state.abandoned else TxnError
        raise error(
            f"sink {state.sink_id!r}: snapshot {entry.name!r} cannot be registered on "
            f"snapshot id {entry.snapshot_id}: {problem}. Nothing was registered; "
            "export it again"
        )
    payload = entry.to_json()
    payload.pop("created_at")
    return Event(
        stream=state.sink_id,
        seq=state.next_seq,
        kind=EventKind.NAMED,
        epoch=state.epoch,
        snapshot_id=entry.snapshot_id,
        batch_id=entry.batch_id,
        query_id=state.query_id,
        payload=payload,
    )


def delete_named(state: SinkState, name: str) -> Event:
    if name not in state.named:
        raise TxnError(f"sink {state.sink_id!r} has no snapshot named {name!r}")
    entry = state.named[name]
    return Event(
        stream=state.sink_id,
        seq=state.next_seq,
        kind=EventKind.NAME_DELETED,
        epoch=state.epoch,
        snapshot_id=entry.snapshot_id,
        query_id=state.query_id,
        payload={"name": name, "location": entry.location},
    )


def request_export(state: SinkState, name: str, location: str) -> Event:
    """Ask the sink to export its next committed batch under ``name`` to ``location``."""
    check_snapshot_name(name)
    if name in state.named:
        raise TxnError(
            f"sink {state.sink_id!r}: a snapshot named {name!r} exists (snapshot "
            f"{state.named[name].snapshot_id}); delete it first or choose another name"
        )
    if name in state.export_requests:
        raise TxnError(
            f"sink {state.sink_id!r}: an export named {name!r} is already requested (to "
            f"{state.export_requests[name].location}); it runs at the next commit"
        )
    return Event(
        stream=state.sink_id,
        seq=state.next_seq,
        kind=EventKind.EXPORT_REQUESTED,
        epoch=state.epoch,
        query_id=state.query_id,
        payload={"name": name, "location": location},
    )


def fail_export(state: SinkState, name: str, error: str) -> Event | None:
    """End a requested export that failed (None if it is no longer pending)."""
    if name not in state.export_requests:
        return None
    return Event(
        stream=state.sink_id,
        seq=state.next_seq,
        kind=EventKind.EXPORT_FAILED,
        epoch=state.epoch,
        query_id=state.query_id,
        payload={"name": name, "error": error[:4000]},
    )
