"""The protocol's records: handles, snapshot and execution records, named snapshots,
export requests, the invariants and the rules for names. Pure data, no IO."""

from __future__ import annotations

import functools
import hashlib
import secrets
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum
from typing import Any, Protocol, TypeVar

from ..errors import ProtocolViolation
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


#: The tokens of the ids one allocation reserves ahead, after the one it takes at once
#: (:func:`state.core.allocate` with ``count`` > 1), start so (no hex digit does): status
#: tells an id reserved but never used from a batch left unfinished.
LEASE_TOKEN_PREFIX = "r"
#: What a reserved id's token reads as in a record table other than the one that
#: reserved it (a copied checkpoint): it matches no staged attempt (not alphanumeric).
FOREIGN_LEASE_TOKEN = LEASE_TOKEN_PREFIX + "-elsewhere"
_B36 = "0123456789abcdefghijklmnopqrstuvwxyz"


@functools.lru_cache(maxsize=4096)  # every fold checks every reserved id's token again
def _lease_mac(table: str, snapshot_id: int, nonce: str) -> str:
    digest = hashlib.blake2b(f"{table}\n{snapshot_id}\n{nonce}".encode(), digest_size=8)
    n = int.from_bytes(digest.digest(), "big")
    return "".join(_B36[(n // 36**i) % 36] for i in range(6))


def new_lease_token(table: str, snapshot_id: int) -> str:
    """A reserved id's token, bound to the record table that reserves it: a copy of that
    table (a copied checkpoint) holds the same tokens, but at its own location they do
    not verify, so the copy never takes the original's attempts for its own."""
    nonce = "".join(secrets.choice(_B36) for _ in range(3))
    return LEASE_TOKEN_PREFIX + nonce + _lease_mac(table, snapshot_id, nonce)


def lease_token_binds(token: str, table: str, snapshot_id: int) -> bool:
    """Whether ``token`` was reserved for ``snapshot_id`` by the record table ``table``."""
    return (
        len(token) == 10
        and token.startswith(LEASE_TOKEN_PREFIX)
        and token[4:] == _lease_mac(table, snapshot_id, token[1:4])
    )


def is_lease_token(token: str) -> bool:
    return token.startswith(LEASE_TOKEN_PREFIX)


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


def _confirms(e: Event) -> dict[int, int | None]:
    """Phase 2 confirmations a snapshot record carries for earlier records."""
    return {int(sid): v for sid, v in (e.payload.get("confirms") or {}).items()}
