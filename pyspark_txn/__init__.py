"""pyspark-txn: exactly-once Spark Structured Streaming through Python data sources."""

from .errors import (
    CheckpointMismatchError,
    CommitConflict,
    ConfigError,
    CorruptSnapshotError,
    FencedError,
    IndeterminateCommitError,
    ProtocolViolation,
    SourceError,
    SparkFeatureError,
    TxnError,
    UnsupportedFormatVersion,
)
from .session import local_session, process_available, register

__version__ = "0.1.0"

__all__ = [
    "CheckpointMismatchError",
    "CommitConflict",
    "ConfigError",
    "CorruptSnapshotError",
    "FencedError",
    "IndeterminateCommitError",
    "ProtocolViolation",
    "SourceError",
    "SparkFeatureError",
    "TxnError",
    "UnsupportedFormatVersion",
    "__version__",
    "local_session",
    "process_available",
    "register",
]
