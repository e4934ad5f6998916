"""The fold: :class:`SinkState`, what one sink's events add up to, checking the
invariants as it goes (summaries included). Pure, no IO."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from types import MappingProxyType
from typing import Any

from ..errors import ProtocolViolation
from .events import Event, EventKind
from .records import (
    FOREIGN_LEASE_TOKEN,
    NO_SNAPSHOT,
    ExecutionRecord,
    ExportRequest,
    Invariant,
    NamedSnapshot,
    S,
    SnapshotRecord,
    _confirms,
    _id,
    _violation,
    is_lease_token,
    lease_token_binds,
)


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
            ids = allocated_ids(e)
            allocations = dict(self.allocations)
            allocations.update(ids)
            return replace(
                s, ongoing_snapshot_id=ids[-1][0], allocations=MappingProxyType(allocations)
            )
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
            # its id is done with: no longer an open allocation (status would show a
            # deleted export's id as one still running or killed)
            gone = self.named[str(name)].snapshot_id
            return replace(
                s,
                named=_frozen({k: v for k, v in self.named.items() if k != name}),
                allocations=_frozen({k: v for k, v in self.allocations.items() if k != gone}),
            )
        raise ProtocolViolation(f"{self.sink_id}: event kind {e.kind.value} is not a sink event")


def _without(d: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    return d if key not in d else _frozen({k: v for k, v in d.items() if k != key})


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


def allocated_ids(event: Event) -> list[tuple[int, str]]:
    """``(snapshot id, token)`` of every id an ``allocated`` event reserves, in order: one,
    or a planner's lease of several with a token each (``state.core.allocate``)."""
    assert event.kind is EventKind.ALLOCATED and event.snapshot_id is not None
    tokens = event.payload.get("tokens") or [event.payload.get("token", "")]
    return [(event.snapshot_id + i, str(t)) for i, t in enumerate(tokens)]


def bind_leases(state: SinkState, table: str) -> SinkState:
    """``state`` as the record table ``table`` sees it: the ids another table reserved
    ahead (its tokens copied here with a copied checkpoint) get a token that matches no
    staged attempt, so no sweep, withdrawal or status here acts on that table's batches."""
    foreign = {
        sid: FOREIGN_LEASE_TOKEN
        for sid, token in state.allocations.items()
        if is_lease_token(token)
        and token != FOREIGN_LEASE_TOKEN
        and not lease_token_binds(token, table, sid)
    }
    if not foreign:
        return state
    return replace(state, allocations=_frozen({**state.allocations, **foreign}))


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
