"""pyspark-txn: exactly-once Spark Structured Streaming through Python data sources."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import (
    BackupError,
    CheckpointMismatchError,
    CommitConflict,
    ConfigError,
    CorruptSnapshotError,
    FencedError,
    IndeterminateCommitError,
    IndeterminateTargetCommitError,
    ProtocolViolation,
    SnapshotWithdrawnError,
    SourceError,
    SparkFeatureError,
    StorageError,
    TargetBusyError,
    TargetError,
    TargetUnavailableError,
    TxnError,
    UnsupportedFormatVersion,
)
from .session import local_session, process_available, register
from .sinks import hooks as _hooks

if TYPE_CHECKING:
    from .sinks.fast import DeltaBatchWriter
    from .sinks.hooks import ExportSite
    from .state import SinkState, SnapshotRecord

__version__ = "0.1.0"


def delta_batch_writer(path: str, checkpoint: str, **options: Any) -> DeltaBatchWriter:
    """The fast path: a ``foreachBatch`` function that appends each micro-batch to a
    Delta table exactly once, staged by Spark's own parquet writer (docs/fast_path.md).
    Imported lazily: PySpark is needed only when it is used."""
    from .sinks.fast import delta_batch_writer as make

    return make(path, checkpoint, **options)


def _serve_sink_exports(
    site: ExportSite, state: SinkState, record: SnapshotRecord, version: int | None
) -> None:
    """The sinks' export server (:mod:`pyspark_txn.sinks.hooks`): this package's top is
    where the sinks meet the operations, so neither imports the other. Imported lazily:
    only a commit with pending export requests needs it."""
    from .operations.snapshots.requests import serve_sink_exports

    serve_sink_exports(site, state, record, version)


_hooks.set_export_server(_serve_sink_exports)

__all__ = [
    "BackupError",
    "CheckpointMismatchError",
    "CommitConflict",
    "ConfigError",
    "CorruptSnapshotError",
    "FencedError",
    "IndeterminateCommitError",
    "IndeterminateTargetCommitError",
    "ProtocolViolation",
    "SnapshotWithdrawnError",
    "SourceError",
    "SparkFeatureError",
    "StorageError",
    "TargetBusyError",
    "TargetError",
    "TargetUnavailableError",
    "TxnError",
    "UnsupportedFormatVersion",
    "__version__",
    "delta_batch_writer",
    "local_session",
    "process_available",
    "register",
]
