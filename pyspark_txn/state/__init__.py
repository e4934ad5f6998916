"""Protocol state: a pure core (records, fold, transitions) and a thin IO shell."""

from .core import (
    NO_SNAPSHOT,
    Decide,
    ExecutionRecord,
    Invariant,
    Replay,
    SinkState,
    SnapshotKind,
    SnapshotRecord,
    TxnHandle,
    allocate,
    begin_epoch,
    check_epoch,
    check_invariants,
    decide,
    fold_sink,
    mark_committed,
    orphan_snapshot_ids,
    pending_phase2,
    record_snapshot,
)
from .delta_log import DeltaEventLog
from .events import FORMAT_VERSION, Event, EventKind
from .offset_log import OffsetLogState, fold_offsets
from .store import AppendRejected, EventLog, MemoryEventLog, RecordStore

__all__ = [
    "FORMAT_VERSION",
    "NO_SNAPSHOT",
    "AppendRejected",
    "Decide",
    "DeltaEventLog",
    "Event",
    "EventKind",
    "EventLog",
    "ExecutionRecord",
    "Invariant",
    "MemoryEventLog",
    "OffsetLogState",
    "RecordStore",
    "Replay",
    "SinkState",
    "SnapshotKind",
    "SnapshotRecord",
    "TxnHandle",
    "allocate",
    "begin_epoch",
    "check_epoch",
    "check_invariants",
    "decide",
    "fold_offsets",
    "fold_sink",
    "mark_committed",
    "orphan_snapshot_ids",
    "pending_phase2",
    "record_snapshot",
]
