"""One rooted error hierarchy: callers catch ``TxnError`` or a precise subclass.

Every message names the thing that is wrong and, where it helps, what is
allowed or how to repair it.
"""

from __future__ import annotations


class TxnError(Exception):
    """Root of every error raised by pyspark-txn.

    ``retryable``: the step may be run again as is (phase 2 retries such errors
    before giving up; the others are decided and retrying cannot change them).
    """

    retryable = False


class ConfigError(TxnError, ValueError):
    """An option or argument is invalid; raised before any data is touched."""


class CommitConflict(TxnError):
    """Another writer wrote the same record sequence number first (a determinate loss)."""


class FencedError(TxnError):
    """This writer's epoch was superseded by a newer run of the same sink."""


class IndeterminateCommitError(TxnError):
    """A durable write ended with an unknown outcome and re-reading could not decide it.

    The protocol stops here without phase 2; recovery on restart decides.
    """


class TargetError(TxnError):
    """The target's database refused or failed a step; the message says what to do and
    the database's own error is ``__cause__``."""


class TargetUnavailableError(TargetError):
    """The target cannot be reached now (refused, timed out, restarting, connection lost
    outside a commit). Nothing decided is lost: run the step again when it is back."""

    retryable = True


class TargetBusyError(TargetError):
    """Concurrent work made the database give up a step (serialization failure,
    deadlock, lock or statement timeout); it was rolled back, so running it again is safe."""

    retryable = True


class IndeterminateTargetCommitError(IndeterminateCommitError, TargetError):
    """The connection was lost while the target committed (``COMMIT PREPARED``): whether
    it committed is unknown until the target is read again, which a retry or recovery
    does. Never taken for a success or a failure."""

    retryable = True


class CorruptSnapshotError(TxnError):
    """A safe record points at data that is missing or does not match its checksum."""


class SnapshotWithdrawnError(TxnError):
    """An export's own snapshot id was withdrawn (settle, abandon) before it registered:
    nothing was registered, the export must run again."""


class CheckpointMismatchError(TxnError):
    """Spark's checkpoint does not belong to the sink's recorded history.

    Raised instead of silently starting over, which would skip or duplicate data.
    """


class TargetGoneError(CheckpointMismatchError):
    """The target lost what the record table says was committed to it (the table was
    deleted or moved): writing on would start a new one silently, without those batches.
    """


class TargetChangedError(TxnError):
    """The target changed after a batch's record was written (another engine added a
    CHECK constraint its rows break, a table feature, a schema change), so phase 2
    cannot commit the batch's files. Nothing was committed; retrying cannot change it:
    the record stays pending until the change is undone or ``pyspark-txn abandon``
    withdraws it."""


class UnsupportedFormatVersion(TxnError):
    """A record was written by a newer pyspark-txn than this one."""


class ProtocolViolation(TxnError):
    """A transition would break one of the protocol invariants (a bug or a zombie)."""


class StorageError(TxnError, OSError):
    """A store refused or failed a request (missing bucket, no credentials, unreachable
    endpoint, denied): one line that says which and what to check, with the client's text
    (cleaned) in it; the client's error itself is ``original``. An ``OSError`` too, so
    ``except OSError`` keeps catching it."""

    original: BaseException | None = None


class BackupError(TxnError):
    """A backup (or one of its parts) could not be taken or restored."""


class SourceError(TxnError):
    """A source cannot serve the requested offsets exactly as before."""


class SparkFeatureError(TxnError, ImportError):
    """The installed PySpark lacks a feature pyspark-txn needs (named in the message).

    Features are detected, never inferred from a version number: Databricks
    runtimes report Spark 3.5 yet ship the Python data source API.
    """
