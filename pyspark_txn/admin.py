"""Operating a sink from outside Spark (kept so ``from pyspark_txn import admin`` works).

The code lives in :mod:`pyspark_txn.operations`: ``handle`` (:func:`open_sink`), ``status``
(:func:`sink_status`), ``repair`` (:func:`stuck_snapshots`, :func:`abandon_snapshot`,
:func:`settle`) and ``verify`` (:func:`verify`)."""

from .operations.handle import (
    CHUNK_BYTES,
    DELTA,
    OFFSET_LOG_KINDS,
    POSTGRES,
    Progress,
    SinkHandle,
    describe_target,
    find_record_table,
    kept_sink_id,
    open_sink,
    opened_target,
    recorded_target,
    sink_streams,
    target_kind,
    target_terms,
)
from .operations.repair import (
    SnapshotStatus,
    abandon_snapshot,
    settle,
    snapshot_status,
    stuck_snapshots,
)
from .operations.status import SinkStatus, sink_status
from .operations.verify import Problem, SnapshotCheck, VerifyReport, byte_progress, crc32_of, verify

__all__ = [
    "CHUNK_BYTES",
    "DELTA",
    "OFFSET_LOG_KINDS",
    "POSTGRES",
    "Problem",
    "Progress",
    "SinkHandle",
    "SinkStatus",
    "SnapshotCheck",
    "SnapshotStatus",
    "VerifyReport",
    "abandon_snapshot",
    "byte_progress",
    "crc32_of",
    "describe_target",
    "find_record_table",
    "kept_sink_id",
    "open_sink",
    "opened_target",
    "recorded_target",
    "settle",
    "sink_status",
    "sink_streams",
    "snapshot_status",
    "stuck_snapshots",
    "target_kind",
    "target_terms",
    "verify",
]
