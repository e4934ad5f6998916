"""``pyspark-txn status``: what a sink is doing (progress, lag, record-table size, trouble),
read from its records and its target. :func:`location_status` also answers for the
checkpoints that have no record table: a ``mode=light`` sink's (from its table's history
and Spark's checkpoint) and one that ``snapshots prepare-query`` or ``backups restore``
made, before its query's first start."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any

from .. import storage
from ..errors import ConfigError
from ..sinks.delta_target import LIGHT_HISTORY_SCAN, META_PREFIX
from ..sinks.twophase import (
    SPARK_ABORT_REASON,
    lost_batches,
    target_lost,
)
from ..spark.options import check_location
from ..state import SnapshotRecord
from ..state.core import is_export_token, reserved_unused
from ..storage import fs as _fs
from ..storage.checkpoint import (
    latest_batch,
    read_query_id,
    read_restore_mark,
    read_sink_file,
    unfinished_restore,
)
from .handle import (
    POSTGRES,
    SinkHandle,
    _in_handle_storage,
    describe_origin,
    locate_record_table,
    location_uri,
    next_batch,
    open_sink,
    opened_target,
    read_started_from,
)
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
    # what a checkpoint made by prepare-query or a restore was made from (None: neither)
    started_from: Mapping[str, Any] | None = None

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
            "mode": "snapshots",
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
            "started_from": self.started_from,
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
        started_from=read_started_from(checkpoint) if checkpoint else None,
    )


# --- checkpoints without a record table ----------------------------------------------

#: A light sink's batch that Spark planned and the table does not hold after this many
#: seconds needs attention (the query failed or was stopped in it); ``--stale-after``.
DEFAULT_STALE_AFTER_S = 600.0


def _seconds_since(when: datetime | None) -> float | None:
    return None if when is None else (datetime.now(timezone.utc) - when).total_seconds()


def _planned_at(checkpoint: str, batch: int | None) -> datetime | None:
    """When Spark planned ``batch``: ``batchTimestampMs`` of its offset log file (kept
    as first written, so a replay keeps the first planning's time)."""
    if batch is None:
        return None
    fs, root = _fs.filesystem(checkpoint)
    try:
        with fs.open(_fs.join(root, "offsets", str(batch)), "r") as f:
            f.readline()
            meta = json.loads(f.readline() or "{}")
    except (OSError, ValueError):
        return None
    stamp = meta.get("batchTimestampMs") if isinstance(meta, dict) else None
    if not isinstance(stamp, int) or stamp <= 0:
        return None
    return datetime.fromtimestamp(stamp / 1000, timezone.utc)


def _iso(when: datetime | None) -> str | None:
    return when.isoformat() if when else None


#: what a light sink stamps in each of its commits (commitInfo)
META_SINK, META_BATCH, META_QUERY = (META_PREFIX + k for k in ("sink_id", "batch_id", "query_id"))


@dataclass(frozen=True)
class LightSinkStatus:
    """What a ``mode=light`` sink did, for ``pyspark-txn status``: it keeps no record
    table, so the answer comes from its Delta table (the app transaction and the
    commits stamped with its sink id) and Spark's checkpoint (offsets/, commits/)."""

    sink_id: str
    checkpoint: str
    target_uri: str | None  # None: not known (the checkpoint does not name it)
    target_exists: bool | None
    target_version: int | None
    target_batch: int | None  # the table's app transaction of the sink: its last batch
    target_error: str | None
    last_commit: Mapping[str, Any] | None  # the latest commit stamped with the sink id
    query_id: str | None  # Spark's, from the checkpoint's metadata
    spark_planned_batch: int | None
    spark_committed_batch: int | None
    spark_planned_at: datetime | None
    stale_after_s: float
    in_flight: int | None = None  # a batch Spark planned that is not done yet
    problems: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    started_from: Mapping[str, Any] | None = None

    @property
    def healthy(self) -> bool:
        return self.target_error is None and not self.problems

    @property
    def last_committed_at(self) -> datetime | None:
        stamp = (self.last_commit or {}).get("timestamp")
        if not isinstance(stamp, int):
            return None
        return datetime.fromtimestamp(stamp / 1000, timezone.utc)

    @property
    def lag_seconds(self) -> float | None:
        """Seconds since the table's last commit of this sink."""
        return _seconds_since(self.last_committed_at)

    @property
    def planned_seconds_ago(self) -> float | None:
        """Seconds since Spark planned its latest batch."""
        return _seconds_since(self.spark_planned_at)

    def to_json(self) -> dict[str, Any]:
        last = self.last_commit or {}
        return {
            "sink_id": self.sink_id,
            "mode": "light",
            "healthy": self.healthy,
            "record_table": None,
            "checkpoint": self.checkpoint,
            "target": self.target_uri,
            "target_uri": self.target_uri,
            "target_version": self.target_version,
            "target_batch": self.target_batch,
            "target_error": self.target_error,
            "last_batch": last.get(META_BATCH, self.target_batch),
            "last_version": last.get("version"),
            "last_committed_at": _iso(self.last_committed_at),
            "last_query_id": last.get(META_QUERY) or None,
            "lag_seconds": self.lag_seconds,
            "query_id": self.query_id,
            "spark_planned_batch": self.spark_planned_batch,
            "spark_committed_batch": self.spark_committed_batch,
            "spark_planned_at": _iso(self.spark_planned_at),
            "in_flight_batch": self.in_flight,
            "stale_after_seconds": self.stale_after_s,
            "problems": list(self.problems),
            "notes": list(self.notes),
            "started_from": self.started_from,
        }


def _batch(batch: int | None) -> int:
    """A batch id for comparisons: -1 for none."""
    return -1 if batch is None else batch


def _last_stamped_commit(dt: Any, sink_id: str) -> dict[str, Any] | None:
    """The table's latest commit stamped with ``sink_id``, searched as the light sink
    searches it (the last 10, 100, then 1,000 commits: each is a read on a store)."""
    for limit in (10, 100, LIGHT_HISTORY_SCAN):
        entry = next((e for e in dt.history(limit) if e.get(META_SINK) == sink_id), None)
        if entry is not None or limit > dt.version():
            return entry
    return None


def light_status(
    checkpoint: str,
    kept: Mapping[str, Any],
    *,
    target_uri: str | None = None,
    stale_after_s: float = DEFAULT_STALE_AFTER_S,
) -> LightSinkStatus:
    """Read-only summary of a ``mode=light`` sink from its table and Spark's checkpoint.

    ``target_uri``: the sink's Delta table; a light checkpoint does not name it (unless
    its ``sink.json`` does), and without it only Spark's checkpoint is shown.
    """
    from ..storage.delta_tables import open_table

    sink_id = str(kept["sink_id"])
    kept_target = kept.get("target") or {}
    uri = target_uri or (kept_target.get("uri") if isinstance(kept_target, Mapping) else None)
    uri = _fs.normalize_uri(uri) if uri else None
    started = read_started_from(checkpoint)
    base = started.get("batch_id") if started else None
    base = base if isinstance(base, int) else -1  # batches up to it were not this sink's
    planned = latest_batch(checkpoint)
    committed = latest_batch(checkpoint, "commits")
    planned_at = _planned_at(checkpoint, planned)
    query_id = read_query_id(checkpoint)
    exists = version = held = error = last = None
    if uri is not None:
        try:
            dt = open_table(uri, storage.current().for_delta())
            exists = dt is not None
            if dt is not None:
                version = dt.version()
                held = dt.transaction_version(sink_id)
                last = _last_stamped_commit(dt, sink_id)
        except Exception as e:  # a status must still show Spark's checkpoint
            error = f"{type(e).__name__}: {e}"
    problems: list[str] = []
    notes: list[str] = []
    readable = uri is not None and error is None
    if readable and not exists and committed is not None:
        problems.append(
            f"there is no Delta table at {uri}, but Spark's commit log says batch "
            f"{committed} is done: the table was deleted or moved, or --target names another "
            "table; a restart would write a new table without the batches up to "
            f"{committed} (light mode does not detect this, docs/modes.md)"
        )
    elif readable and held is None and committed is not None and committed > base:
        problems.append(
            f"the Delta table at {uri} holds no batch of sink {sink_id}, but Spark's commit "
            f"log says batches up to {committed} are done: --target names another table, "
            "or the table was re-created (light mode does not detect this, docs/modes.md)"
        )
    if held is not None and held > _batch(planned):
        problems.append(
            f"the table holds batch {held} of this sink, but Spark's checkpoint has planned "
            + ("no batch" if planned is None else f"only up to batch {planned}")
            + ": another query writes as this sink id, or this checkpoint was reset or "
            f"restored to an older state; the query would take its batches up to {held} "
            "for replays and drop them (give each query its own checkpoint and sinkId)"
        )
    writer = (last or {}).get(META_QUERY) or None
    if writer and query_id and writer != query_id:
        problems.append(
            f"the table's latest batch of this sink ({last.get(META_BATCH) if last else '?'}, "
            f"version {last.get('version') if last else '?'}) was written by query {writer}, "
            f"not by this checkpoint's query {query_id}: another query writes as this sink "
            "id, and each drops the other's batches as replays (give each query its own sinkId)"
        )
    done = max(_batch(committed), _batch(held))
    in_flight = planned if planned is not None and planned > done else None
    if in_flight is not None:
        age = _seconds_since(planned_at)
        where = "the table does not hold it" if readable else "its commit log does not have it"
        if age is not None and age > stale_after_s:
            problems.append(
                f"Spark planned batch {in_flight} {age:.0f} s ago and {where} "
                f"(over --stale-after {stale_after_s:.0f} s): the query failed or was stopped "
                "in it, or the batch is still running; if the query is not running, restart "
                "the query (it replays the batch)"
            )
        else:
            notes.append(
                f"batch {in_flight} in flight: Spark planned it"
                + ("" if age is None else f" {age:.0f} s ago")
                + f" and {where} yet"
            )
    elif held is not None and planned is not None and held >= planned and _batch(committed) < held:
        notes.append(
            f"batch {held} is in the table and Spark has not logged its commit yet: it is "
            "committing now, or the query stopped right after (a restart replays it as a no-op)"
        )
    if held is not None and committed is not None and committed > max(held, base):
        notes.append(
            f"Spark's commit log is at batch {committed}, the table's last batch of this sink "
            f"is {held}: the batches after it wrote no rows (an empty batch makes no commit), "
            "or the table lost them (light mode cannot tell, docs/modes.md)"
        )
    return LightSinkStatus(
        sink_id=sink_id,
        checkpoint=checkpoint,
        target_uri=uri,
        target_exists=exists,
        target_version=version,
        target_batch=held,
        target_error=error,
        last_commit=last,
        query_id=query_id,
        spark_planned_batch=planned,
        spark_committed_batch=committed,
        spark_planned_at=planned_at,
        stale_after_s=stale_after_s,
        in_flight=in_flight,
        problems=tuple(problems),
        notes=tuple(notes),
        started_from=started,
    )


@dataclass(frozen=True)
class NotStartedStatus:
    """A checkpoint that ``snapshots prepare-query`` or ``backups restore`` made, whose
    query has not committed a batch yet (so its sink has no record table yet)."""

    checkpoint: str
    started_from: Mapping[str, Any]
    sink_id: str | None  # the query has started (its sink kept its id); None: not yet
    mode: str | None
    spark_planned_batch: int | None
    spark_committed_batch: int | None
    next_batch: int | None
    problems: tuple[str, ...] = ()

    @property
    def healthy(self) -> bool:
        return not self.problems

    @property
    def origin(self) -> str:
        return describe_origin(self.started_from)

    def to_json(self) -> dict[str, Any]:
        return {
            "sink_id": self.sink_id,
            "mode": self.mode,
            "healthy": self.healthy,
            "state": "not_started" if self.sink_id is None else "no_batch_committed",
            "record_table": None,
            "checkpoint": self.checkpoint,
            "started_from": self.started_from,
            "next_batch": self.next_batch,
            "spark_planned_batch": self.spark_planned_batch,
            "spark_committed_batch": self.spark_committed_batch,
            "problems": list(self.problems),
        }


def _not_started(
    checkpoint: str, started: Mapping[str, Any], kept: Mapping[str, Any] | None
) -> NotStartedStatus:
    committed = latest_batch(checkpoint, "commits")
    batch = started.get("batch_id")
    problems = []
    if started.get("fresh"):  # a new query by design: Spark has logged nothing yet
        batch = None
    if isinstance(batch, int) and (committed is None or committed < batch):
        problems.append(
            f"Spark's commit log has no batch {batch} (the snapshot's): the checkpoint is "
            "unfinished, the `backups restore` or `snapshots prepare-query` that made it was "
            "interrupted; run the restore again, or prepare into a new checkpoint"
        )
    return NotStartedStatus(
        checkpoint=checkpoint,
        started_from=started,
        sink_id=str(kept["sink_id"]) if kept else None,
        mode=str(kept.get("mode", "snapshots")) if kept else None,
        spark_planned_batch=latest_batch(checkpoint),
        spark_committed_batch=committed,
        next_batch=next_batch(checkpoint, started),
        problems=tuple(problems),
    )


AnyStatus = SinkStatus | LightSinkStatus | NotStartedStatus


def location_status(
    location: str,
    sink: str | None = None,
    *,
    target_uri: str | None = None,
    url: str | None = None,
    password_file: str | None = None,
    stale_after_s: float = DEFAULT_STALE_AFTER_S,
) -> AnyStatus:
    """The status of whatever sink ``location`` (a checkpoint or a record table) holds,
    with the storage options in effect: a record-table sink's (:func:`sink_status`), a
    ``mode=light`` sink's (:func:`light_status`), or a prepared or restored checkpoint's
    before its first commit (:class:`NotStartedStatus`)."""
    if target_uri is not None:
        check_location("--target", target_uri)
    try:
        return sink_status(
            open_sink(location, sink, target_uri=target_uri, url=url, password_file=password_file)
        )
    except ConfigError:  # no record table there: a light sink, or one not started yet?
        found = _without_record_table(
            location, sink, target_uri, bool(url or password_file), stale_after_s
        )
        if found is None:
            raise
        return found


def _without_record_table(
    location: str,
    sink: str | None,
    target_uri: str | None,
    database: bool,
    stale_after_s: float,
) -> LightSinkStatus | NotStartedStatus | None:
    """The status of a checkpoint whose sink has no record table (None: not one of those;
    the caller's error then says what the location is)."""
    uri = location_uri(location)
    try:
        kept = read_sink_file(uri)
    except (OSError, ValueError):
        return None
    if kept is not None and kept.get("mode") == "light":
        if sink is not None and sink != kept.get("sink_id"):
            raise ConfigError(
                f"--sink {sink!r}: checkpoint {location} belongs to sink "
                f"{kept.get('sink_id')!r} (mode=light); drop --sink or give that id"
            )
        if database:
            raise ConfigError(
                "--url and --password-file apply to txn-postgres sinks; the sink of checkpoint "
                f"{location} is a mode=light txn-delta sink (give its table with --target)"
            )
        return light_status(uri, kept, target_uri=target_uri, stale_after_s=stale_after_s)
    started = read_started_from(uri)
    mark = read_restore_mark(uri)
    unfinished = unfinished_restore(mark)
    if unfinished is not None and locate_record_table(location) is None:
        assert mark is not None
        origin = started or {"backup": {k: mark.get(k) for k in ("backup_id", "to")}}
        return replace(_not_started(uri, origin, kept), problems=(f"{unfinished}",))
    if started is None or locate_record_table(location) is not None:
        return None
    return _not_started(uri, started, kept)
