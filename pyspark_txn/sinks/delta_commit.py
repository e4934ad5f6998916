"""What every phase-2 Delta commit is made of and what follows it, shared by the Delta
targets (append, overwrite, merge) and the tombstones: the add actions of staged files,
the sink's app version read cheaply from new commits, and the log's upkeep (a checkpoint
every ``delta.checkpointInterval`` versions, expired log entries cleaned up)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from ..state import TxnHandle
from ..storage.delta_tables import forget_table, read_commit_actions

log = logging.getLogger(__name__)


#: Delta's default ``delta.checkpointInterval`` (delta-rs's own hook uses 100).
DEFAULT_CHECKPOINT_INTERVAL = 10


def _NO_HOOKS():  # noqa: N802 - reads as a constant
    """delta-rs would checkpoint every 100 versions: :func:`maintain_log` does it as Delta."""
    from deltalake.transaction import PostCommitHookProperties

    return PostCommitHookProperties(create_checkpoint=False, cleanup_expired_logs=False)


def checkpoint_interval(config: Mapping[str, str]) -> int:
    """The table's ``delta.checkpointInterval``, Delta's default 10 if unset or invalid."""
    try:
        interval = int(config.get("delta.checkpointInterval", DEFAULT_CHECKPOINT_INTERVAL))
    except (TypeError, ValueError):
        return DEFAULT_CHECKPOINT_INTERVAL
    return interval if interval > 0 else DEFAULT_CHECKPOINT_INTERVAL


def maintain_log(dt, uri: str, storage_options: Mapping[str, str] | None = None) -> None:
    """After a commit of ours at ``dt.version()``: a checkpoint every
    ``delta.checkpointInterval`` versions, so that opening the table reads at most
    that many commit files (without one every open re-reads the whole log: on an
    object store one GET per commit ever made), and expired log files cleaned up
    if the table's ``delta.enableExpiredLogCleanup`` allows (its own retention).

    Best effort: the commit has landed; a failure here only costs reads later.
    """
    version = dt.version()
    config = dt.metadata().configuration or {}
    if version <= 0 or version % checkpoint_interval(config):
        return
    try:
        dt.create_checkpoint()
        # this thread's next open starts at the new checkpoint (storage.delta_tables)
        forget_table(uri, storage_options)
        if str(config.get("delta.enableExpiredLogCleanup", "true")).lower() != "false":
            dt.cleanup_metadata()
    except Exception as e:
        log.warning("Delta table %s: checkpoint at version %d failed: %r", uri, version, e)


def add_actions(txns: Sequence[TxnHandle]) -> list:
    """The Delta ``add`` actions of staged files, from what phase 1 measured."""
    from deltalake.transaction import AddAction

    return [
        AddAction(
            path=t.handle,
            size=t.bytes,
            partition_values=dict(t.meta.get("partition_values", {})),
            modification_time=t.meta["mtime"],
            data_change=True,
            stats=t.meta["stats"],
        )
        for t in txns
    ]


#: Per thread, (table uri, app id) -> (table object, its version, the app's version):
#: delta-rs finds an app transaction's version by replaying the log since the checkpoint
#: at every call (on an object store a GET of each of those commits).
_APP_VERSIONS = threading.local()


def _app_versions() -> dict[tuple[str, str], tuple[Any, int, int | None]]:
    seen = getattr(_APP_VERSIONS, "seen", None)
    if seen is None:
        seen = _APP_VERSIONS.seen = {}
    return seen


#: The most commits :func:`_app_version` reads itself to follow a table object it
#: has seen; beyond, delta-rs replays the log since the checkpoint.
APP_VERSION_CATCH_UP = 8


def _app_version(
    dt, uri: str, app_id: str, storage_options: Mapping[str, str] | None = None
) -> int | None:
    """``dt.transaction_version(app_id)``, asked once per table object and version.

    A table object seen at an older version was caught up in place (a re-created
    table is reopened as a new object, storage.delta_tables): the app's version is
    then the last ``txn`` of it in the commits since, one GET each, where delta-rs
    would GET every commit since the checkpoint (a planner caught up a table that
    another process committed to at every other batch)."""
    if dt is None:
        return None
    key = (uri, app_id)
    seen = _app_versions().get(key)
    version = dt.version()
    if seen is not None and seen[0] is dt:
        if seen[1] == version:
            return seen[2]
        if 0 < version - seen[1] <= APP_VERSION_CATCH_UP:
            known, done = _app_version_since(
                uri, app_id, seen[1], version, seen[2], storage_options
            )
            if known:
                _app_versions()[key] = (dt, version, done)
                return done
    done = dt.transaction_version(app_id)
    _app_versions()[key] = (dt, version, done)
    return done


def _app_version_since(
    uri: str,
    app_id: str,
    since: int,
    version: int,
    done: int | None,
    storage_options: Mapping[str, str] | None,
) -> tuple[bool, int | None]:
    """(whether every commit after ``since`` up to ``version`` could be read, the app's
    version after them, starting from ``done``)."""
    for v in range(since + 1, version + 1):
        actions = read_commit_actions(uri, v, storage_options)
        if actions is None:
            return False, None
        for action in actions:
            txn = action.get("txn")
            if isinstance(txn, dict) and txn.get("appId") == app_id:
                done = int(txn["version"])
    return True, done
