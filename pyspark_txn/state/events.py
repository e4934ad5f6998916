"""Events of the record table: the only thing the state module ever writes.

The record table is an append-only log. Each stream (one per sink, one per
acknowledging source) is a gap-free sequence of events numbered by ``seq``;
every piece of protocol state is a fold over one stream's events. Rows are
plain columns plus a JSON ``payload`` so any Delta reader can query history.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from enum import Enum
from typing import TYPE_CHECKING, Any

from ..errors import UnsupportedFormatVersion

if TYPE_CHECKING:  # the pure core imports pyarrow only when it converts
    import pyarrow as pa

#: Bumped when the meaning of a column or payload key changes. Readers refuse
#: newer versions instead of guessing what they mean.
FORMAT_VERSION = 5
#: The format each kind is written with: readers that predate a kind refuse it
#: by version instead of misreading it (version 1 readers know no summaries).
_KIND_FORMAT = {
    "summary": 2,
    "named": 2,
    "name_deleted": 2,
    "export_requested": 3,
    "export_failed": 3,
    "consumer": 4,
}
#: An ``allocated`` event that reserves several ids (a lease, key ``tokens``): a reader
#: that predates leases would take it for one id and refuse the records of the others.
LEASE_FORMAT = 5


class EventKind(str, Enum):
    EPOCH = "epoch"  # a new run took over the sink (fencing token)
    ALLOCATED = "allocated"  # a snapshot id was reserved before phase 1
    SNAPSHOT = "snapshot"  # the snapshot record: the commit decision, made safe
    COMMITTED = "committed"  # phase 2 done; pins the target version
    ABANDONED = "abandoned"  # an allocation or an uncommitted record was withdrawn
    SUMMARY = "summary"  # the fold so far, bounded: the events before it may be deleted
    NAMED = "named"  # a named snapshot was exported and registered (written last)
    NAME_DELETED = "name_deleted"  # a named snapshot was deleted; its name is free again
    EXPORT_REQUESTED = "export_requested"  # the sink exports at its next commit
    EXPORT_FAILED = "export_failed"  # a requested export failed; the request is over
    CLAIM = "claim"  # offset log: message ids claimed for one offset
    ACKED = "acked"  # offset log: claims up to an offset were acknowledged
    CONSUMER = "consumer"  # offset log: a broker consumer name reads for this log


@dataclass(frozen=True)
class Event:
    stream: str
    seq: int
    kind: EventKind
    epoch: int = 0
    snapshot_id: int | None = None
    batch_id: int | None = None
    query_id: str | None = None
    payload: dict[str, Any] = field(default_factory=dict)
    event_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    format_version: int = 0  # 0: the format this kind is written with

    def __post_init__(self) -> None:
        if not self.format_version:
            object.__setattr__(self, "format_version", _KIND_FORMAT.get(self.kind.value, 1))

    def with_seq(self, seq: int) -> Event:
        return replace(self, seq=seq)

    def to_row(self) -> dict[str, Any]:
        return {
            "stream": self.stream,
            "seq": self.seq,
            "kind": self.kind.value,
            "epoch": self.epoch,
            "snapshot_id": self.snapshot_id,
            "batch_id": self.batch_id,
            "query_id": self.query_id,
            "payload": json.dumps(self.payload, sort_keys=True, separators=(",", ":")),
            "event_id": self.event_id,
            "created_at": self.created_at,
            "format_version": self.format_version,
        }

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Event:
        version = row["format_version"]
        if version > FORMAT_VERSION:
            raise UnsupportedFormatVersion(
                f"record {row['stream']}#{row['seq']} has format_version {version}; this "
                f"pyspark-txn reads up to {FORMAT_VERSION}: upgrade pyspark-txn"
            )
        created = row["created_at"]
        if created.tzinfo is None:
            created = created.replace(tzinfo=timezone.utc)
        return cls(
            stream=row["stream"],
            seq=row["seq"],
            kind=EventKind(row["kind"]),
            epoch=row["epoch"],
            snapshot_id=row["snapshot_id"],
            batch_id=row["batch_id"],
            query_id=row["query_id"],
            payload=json.loads(row["payload"]),
            event_id=row["event_id"],
            created_at=created,
            format_version=version,
        )


def arrow_schema() -> pa.Schema:
    """The record table's schema (imported lazily: the pure core needs no pyarrow)."""
    import pyarrow as pa

    return pa.schema(
        [
            pa.field("stream", pa.string(), nullable=False),
            pa.field("seq", pa.int64(), nullable=False),
            pa.field("kind", pa.string(), nullable=False),
            pa.field("epoch", pa.int64(), nullable=False),
            pa.field("snapshot_id", pa.int64()),
            pa.field("batch_id", pa.int64()),
            pa.field("query_id", pa.string()),
            pa.field("payload", pa.string(), nullable=False),
            pa.field("event_id", pa.string(), nullable=False),
            pa.field("created_at", pa.timestamp("us", tz="UTC"), nullable=False),
            pa.field("format_version", pa.int32(), nullable=False),
        ]
    )


def events_to_arrow(events: list[Event]) -> pa.Table:
    import pyarrow as pa

    return pa.Table.from_pylist([e.to_row() for e in events], schema=arrow_schema())
