"""``pyspark-txn status``: what a sink is doing (progress, lag, record-table size, trouble),
read from its records and its target."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..sinks.twophase import (
    SPARK_ABORT_REASON,
    lost_batches,
    target_lost,
)
from ..state import SnapshotRecord
from ..state.core import is_export_token, reserved_unused
from ..storage import fs as _fs
from .handle import POSTGRES, SinkHandle, _in_handle_storage, opened_target
from .repair import SnapshotStatus, _stuck


@dataclass(frozen=True)
class SinkStatus:
    """What a sink is doing, for ``pyspark-txn status``: progress, lag, size, trouble."""

    sink_id: str
    record_table: str
    target_uri: str | None
    checkpoint: str | None
    epoch: int
    run_id: str | None
    query_id: str | None
    last_record: SnapshotRecord | None
    target_batch: int | None  # highest batch of this sink the target holds
    target_version: int | None  # Delta's table version (None for other targets)
    target_error: str | None
    spark_planned_batch: int | None  # Spark's offset log
    spark_committed_batch: int | None  # Spark's commit log
    record_events: int  # events in the record table's current history
    summarized_at: int  # seq of the last summary (0: none yet)
    record_files: int
    record_bytes: int
    staged_attempts: int
    stuck: tuple[SnapshotStatus, ...] = ()
    problems: tuple[str, ...] = ()  # what keeps the query from (re)starting
    export_requests: tuple[Any, ...] = ()  # exports requested for the next commit (pending)
    target_kind: str | None = None
    target_label: str | None = None  # the target as messages name it (no password)
    staged_txns: int | None = None  # staged txns right now, where the target can count them
    # snapshot ids allocated above the last record, neither recorded nor abandoned: a
    # batch in flight, or what a failed or killed run left (its next start rolls it back)
    open_attempts: tuple[int, ...] = ()
    # snapshot ids allocated by an export that has not registered: an export running
    # now, or what a killed one left (a failed export withdraws its id itself)
    open_exports: tuple[int, ...] = ()
    # Spark planned a batch the sink never recorded, and no run of the query is
    # holding it open: the last attempt failed or was killed (restart the query)
    failed_attempt: bool = False

    @property
    def lag_seconds(self) -> float | None:
        """Seconds since the last snapshot record was written."""
        from datetime import datetime, timezone

        rec = self.last_record
        if rec is None or rec.created_at is None:
            return None
        return (datetime.now(timezone.utc) - rec.created_at).total_seconds()

    @property
    def healthy(self) -> bool:
        return (
            not self.stuck
            and self.target_error is None
            and not self.problems
            and not self.failed_attempt
        )

    def to_json(self) -> dict[str, Any]:
        rec = self.last_record
        return {
            "sink_id": self.sink_id,
            "healthy": self.healthy,
            "record_table": self.record_table,
            "target_kind": self.target_kind,
            "target": self.target_label,
            "target_uri": self.target_uri,
            "checkpoint": self.checkpoint,
            "epoch": self.epoch,
            "run_id": self.run_id,
            "query_id": self.query_id,
            "last_batch": rec.batch_id if rec else None,
            "last_snapshot_id": rec.snapshot_id if rec else None,
            "last_rows": rec.rows if rec else None,
            "last_recorded_at": rec.created_at.isoformat() if rec and rec.created_at else None,
            "lag_seconds": self.lag_seconds,
            "target_batch": self.target_batch,
            "target_version": self.target_version,
            "target_error": self.target_error,
            "spark_planned_batch": self.spark_planned_batch,
            "spark_committed_batch": self.spark_committed_batch,
            "record_table_events": self.record_events,
            "record_table_summarized_at": self.summarized_at,
            "record_table_files": self.record_files,
            "record_table_bytes": self.record_bytes,
            "staged_attempts": self.staged_attempts,
            "staged_txns": self.staged_txns,
            "stuck": [s.to_json() for s in self.stuck],
            "problems": list(self.problems),
            "export_requests": [r.to_json() for r in self.export_requests],
            "open_attempts": list(self.open_attempts),
            "open_exports": list(self.open_exports),
            "failed_attempt": self.failed_attempt,
        }


def _folder_size(uri: str) -> tuple[int, int]:
    fs, root = _fs.filesystem(uri)
    if not fs.exists(root):
        return 0, 0
    sizes = [info["size"] for info in fs.find(root, detail=True).values()]
    return len(sizes), sum(sizes)


@dataclass(frozen=True)
class _TargetView:
    """What a status shows of the target."""

    batch: int | None = None  # highest batch of this sink it holds
    version: int | None = None  # Delta's table version
    exists: bool | None = None  # None: not known
    staged_attempts: int = 0
    staged_txns: int | None = None
    staged: frozenset[tuple[int, str]] = frozenset()  # (snapshot id, token) of each


def _view(handle: SinkHandle, target: Any) -> _TargetView:
    if handle.kind == POSTGRES:
        from ..sinks.postgres_db import parse_gid

        gids = target.prepared_txns()
        attempts = {parse_gid(g, handle.sink_id) for g in gids}
        return _TargetView(
            batch=target.committed_batch(handle.sink_id),
            exists=target.table_exists(),
            staged_attempts=len(attempts),
            staged_txns=len(gids),
            staged=frozenset(a for a in attempts if a is not None),
        )
    from ..storage.delta_tables import open_table

    assert handle.target_uri is not None
    dt = open_table(handle.target_uri, dict(handle.storage_options))
    staged = frozenset(target.staged_attempts())
    return _TargetView(
        batch=dt.transaction_version(handle.sink_id) if dt is not None else None,
        version=dt.version() if dt is not None else None,
        exists=dt is not None,
        staged_attempts=len(staged),
        staged=staged,
    )


@_in_handle_storage
def sink_status(handle: SinkHandle) -> SinkStatus:
    """Read-only summary of one sink from its record table, target and checkpoint."""
    from ..storage.checkpoint import latest_batch

    store = handle.record_store()
    events = store.events(handle.sink_id)
    state = handle.load()
    view, error, lost = _TargetView(), None, None
    stuck: tuple[SnapshotStatus, ...] = ()
    if handle.has_target:
        try:
            with opened_target(handle) as target:
                view = _view(handle, target)
                lost = target_lost(state, target, view.batch)
                stuck = tuple(_stuck(handle, state, target, (view.batch, None)))
        except Exception as e:  # a status must still show what the record table knows
            error = f"{type(e).__name__}: {e}"
    files, size = _folder_size(handle.record_table)
    problems = []
    last = state.last_record
    if view.batch is not None and (last is None or view.batch > last.batch_id):
        problems.append(
            f"the target holds batch {view.batch} of this sink but the record table "
            + (f"ends at batch {last.batch_id}" if last else "has no record")
            + ": the query will refuse to start (another writer with this sink id, a lost "
            "record table, or a switch from mode=light)"
        )
    if lost is not None:
        problems.append(
            f"{lost}; the record table says {lost_batches(state)}: the query will refuse to "
            "start (TargetGoneError). Restore the table where it was (with its _delta_log), "
            "or start over with a new checkpoint"
        )
    checkpoint = handle.checkpoint
    floor = last.snapshot_id if last is not None else -1
    named_ids = {n.snapshot_id for n in state.named.values()}
    unrecorded = [
        sid
        for sid, token in sorted(state.allocations.items())
        if sid not in state.abandoned
        and sid not in named_ids
        and state.record_for_snapshot(sid) is None
    ]
    open_exports = tuple(sid for sid in unrecorded if is_export_token(state.allocations[sid]))
    open_attempts = tuple(
        sid
        for sid in unrecorded
        if sid > floor
        and not is_export_token(state.allocations[sid])
        and not reserved_unused(state, sid, view.staged)
    )
    planned = latest_batch(checkpoint) if checkpoint else None
    batch_ids = [
        sid
        for sid, tok in state.allocations.items()
        if not is_export_token(tok) and not reserved_unused(state, sid, view.staged)
    ]
    top = max(batch_ids, default=None)
    failed_attempt = (
        planned is not None
        and (last is None or planned > last.batch_id)
        and top is not None
        and top > floor
        and top in state.abandoned
        and any(
            e.kind.value == "abandoned"
            and e.snapshot_id == top
            and e.payload.get("reason") == SPARK_ABORT_REASON
            for e in events
        )
    )
    return SinkStatus(
        sink_id=handle.sink_id,
        record_table=handle.record_table,
        target_uri=handle.target_uri,
        checkpoint=checkpoint,
        epoch=state.epoch,
        run_id=state.epoch_owner,
        query_id=state.query_id,
        last_record=state.last_record,
        target_batch=view.batch,
        target_version=view.version,
        target_error=error,
        spark_planned_batch=planned,
        spark_committed_batch=latest_batch(checkpoint, "commits") if checkpoint else None,
        record_events=len(events),
        summarized_at=state.summary_seq,
        record_files=files,
        record_bytes=size,
        staged_attempts=view.staged_attempts,
        stuck=stuck,
        problems=tuple(problems),
        export_requests=tuple(
            sorted(state.export_requests.values(), key=lambda r: r.requested_seq)
        ),
        target_kind=handle.kind,
        target_label=handle.target_label,
        staged_txns=view.staged_txns,
        open_attempts=open_attempts,
        open_exports=open_exports,
        failed_attempt=failed_attempt,
    )
