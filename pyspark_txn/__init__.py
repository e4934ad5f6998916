"""pyspark-txn: exactly-once Spark Structured Streaming through Python data sources."""

from .errors import (
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
    TargetBusyError,
    TargetError,
    TargetUnavailableError,
    TxnError,
    UnsupportedFormatVersion,
)
from .session import local_session, process_available, register

__version__ = "0.1.0"


def delta_batch_writer(path: str, checkpoint: str, **options):
    """The fast path: a ``foreachBatch`` function that appends each micro-batch to a
    Delta table exactly once, staged by Spark's own parquet writer (docs/fast_path.md).
    Imported lazily: PySpark is needed only when it is used."""
    from .sinks.fast import delta_batch_writer as make

    return make(path, checkpoint, **options)


__all__ = [
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
