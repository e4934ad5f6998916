"""Operating a ``txn-delta`` sink from outside Spark: find it, inspect, repair, verify.

The ``pyspark-txn`` command line is a thin client of this module. Everything
here reads the record table and the target with delta-rs and fsspec; nothing
needs a SparkSession. Library code logs, it never prints.

- :func:`open_sink` finds a sink from a checkpoint location or a record table.
- :func:`stuck_snapshots` lists safe records whose phase 2 never completed.
- :func:`abandon_snapshot` withdraws one of them (or an open allocation). After
  abandoning, **restart the query**: Spark replays the batch, which is then
  decided anew under a new snapshot id (the abandoned id is never reused).
- :func:`verify` re-reads every file a live record names and checks it.
- :func:`sink_status` summarises a sink: progress, lag, record-table size, trouble.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import unquote

from . import _fs
from .checkpoint import RECORDS_DIR, read_sink_file
from .errors import ConfigError, TxnError
from .state import (
    DeltaEventLog,
    EventKind,
    RecordStore,
    SinkState,
    SnapshotRecord,
    pending_phase2,
)
from .state.events import arrow_schema as record_table_schema

log = logging.getLogger(__name__)

#: First event kinds of offset-log streams (acknowledging sources), not sinks.
OFFSET_LOG_KINDS = frozenset({EventKind.CLAIM, EventKind.ACKED})
CHUNK_BYTES = 1 << 20

Progress = Callable[[int, int], None]


# --- finding a sink -----------------------------------------------------------


def _is_record_table(uri: str, storage_options: Mapping[str, str] | None) -> bool:
    """Whether ``uri`` is a record table; a Delta table of another kind is an error."""
    from deltalake import DeltaTable

    options = dict(storage_options or {}) or None
    if not DeltaTable.is_deltatable(uri, options):
        return False
    names = set(DeltaTable(uri, storage_options=options).schema().to_arrow().names)
    if not set(record_table_schema().names) <= names:
        raise ConfigError(
            f"{uri} is a Delta table but not a pyspark-txn record table (its columns are "
            f"{sorted(names)}); give a checkpoint location or a record table"
        )
    return True


def find_record_table(
    location: str, storage_options: Mapping[str, str] | None = None
) -> tuple[str, str | None]:
    """``(record table URI, checkpoint URI or None)`` for a checkpoint or record table.

    A checkpoint's record table is ``<checkpoint>/pyspark_txn/records``, or the one
    its ``sink.json`` names (option ``recordTable``). The checkpoint's own comes
    first: a copied checkpoint must never act on the original's history. A
    record table given directly at the default place also yields its checkpoint.
    """
    if not location.strip():
        raise ConfigError("the location is empty: give a checkpoint location or a record table")
    uri = _fs.normalize_uri(location)
    candidate = _fs.join(uri, *RECORDS_DIR)
    if _is_record_table(candidate, storage_options):
        return candidate, uri
    kept = _kept_record_table(uri)
    if kept is not None and _is_record_table(kept, storage_options):
        return kept, uri  # a checkpoint whose sink keeps its records elsewhere
    if _is_record_table(uri, storage_options):
        suffix = "/" + "/".join(RECORDS_DIR)
        return uri, (uri[: -len(suffix)] if uri.endswith(suffix) else None)
    try:
        kept_file = read_sink_file(uri)
    except (OSError, ValueError):
        kept_file = None
    if kept_file is not None and kept_file.get("mode") == "light":
        raise ConfigError(
            f"the sink of checkpoint {location} runs with mode=light: it keeps no record "
            "table, so there is nothing to inspect here; its Delta table's history "
            "(commitInfo pyspark_txn.*) shows what it committed (docs/modes.md)"
        )
    if kept_file is not None:
        raise ConfigError(
            f"no record table at {candidate} yet: the sink of checkpoint {location} has not "
            "committed a batch"
        )
    raise ConfigError(
        f"no record table at {location} (looked for a checkpoint's {candidate} and for a "
        "Delta table at the location itself)"
    )


def _kept_record_table(location: str) -> str | None:
    try:
        kept = read_sink_file(location)
    except (OSError, ValueError):
        return None
    return None if kept is None else kept.get("record_table")


def sink_streams(store: RecordStore) -> list[str]:
    """The sink streams of a record table (offset-log streams of sources are skipped)."""
    out = []
    for stream in store.log.streams():
        events = store.events(stream)
        if events and events[0].kind not in OFFSET_LOG_KINDS:
            out.append(stream)
    return out


def kept_sink_id(checkpoint: str) -> str | None:
    """The sink id kept in ``<checkpoint>/pyspark_txn/sink.json``; None if there is none.

    Read only: unlike the sink's first use, this never writes the file.
    """
    kept = read_sink_file(checkpoint)
    return None if kept is None else kept["sink_id"]


@dataclass(frozen=True)
class SinkHandle:
    """Where one sink's history and data live. Build it with :func:`open_sink`."""

    record_table: str
    sink_id: str
    target_uri: str | None  # None: no snapshot record names the target yet
    storage_options: Mapping[str, str] = field(default_factory=dict, hash=False)
    partition_by: tuple[str, ...] = ()
    checkpoint: str | None = None

    def record_store(self) -> RecordStore:
        return RecordStore(DeltaEventLog(self.record_table, dict(self.storage_options)))

    def target(self):
        """The sink's :class:`~pyspark_txn.sinks.delta_target.DeltaTarget`."""
        from .sinks.delta_target import DeltaTarget

        if self.target_uri is None:
            raise ConfigError(
                f"sink {self.sink_id!r} has no snapshot record yet, so its target table is "
                "unknown; pass target_uri to open_sink"
            )
        return DeltaTarget(
            self.target_uri,
            self.sink_id,
            partition_by=self.partition_by,
            storage_options=dict(self.storage_options),
        )

    def committer(self):
        """A :class:`~pyspark_txn.sinks.twophase.TwoPhaseCommitter` for this sink."""
        from .sinks.twophase import TwoPhaseCommitter

        return TwoPhaseCommitter(self.record_store(), self.target(), self.sink_id)

    def load(self) -> SinkState:
        """The sink's state: a fold over its events (every invariant checked)."""
        return self.record_store().load_sink(self.sink_id)


def open_sink(
    location: str,
    sink_id: str | None = None,
    storage_options: Mapping[str, str] | None = None,
    *,
    target_uri: str | None = None,
) -> SinkHandle:
    """Find one sink from a checkpoint location or a record table URI.

    The sink id is, in order: ``sink_id``; the one kept in the checkpoint's
    ``pyspark_txn/sink.json``; the record table's only sink stream. Several
    sinks and no id is a :class:`ConfigError` naming them. The target is the one
    the sink's last snapshot record names (``target_uri`` overrides it).
    """
    storage = dict(storage_options or {})
    record_table, checkpoint = find_record_table(location, storage)
    store = RecordStore(DeltaEventLog(record_table, storage))
    sinks = sink_streams(store)
    chosen = sink_id or (kept_sink_id(checkpoint) if checkpoint else None)
    if chosen is None:
        if not sinks:
            raise ConfigError(f"the record table {record_table} holds no sink yet")
        if len(sinks) > 1:
            raise ConfigError(
                f"the record table {record_table} holds several sinks: {', '.join(sinks)}; "
                "choose one (--sink ID)"
            )
        chosen = sinks[0]
    elif chosen not in sinks:
        raise ConfigError(
            f"the record table {record_table} has no sink {chosen!r}; its sinks: "
            f"{', '.join(sinks) or 'none'}"
        )
    meta: Mapping[str, Any] = {}
    for event in reversed(store.events(chosen)):  # abandoned records still name the target
        if event.kind is EventKind.SNAPSHOT:
            meta = event.payload.get("target") or {}
            break
    else:  # the history starts at a summary: its records name the target
        last = store.load_sink(chosen).last_record
        meta = last.target if last is not None else {}
    uri = target_uri or meta.get("uri")
    return SinkHandle(
        record_table=record_table,
        sink_id=chosen,
        target_uri=_fs.normalize_uri(uri) if uri else None,
        storage_options=storage,
        partition_by=tuple(meta.get("partition_by") or ()),
        checkpoint=checkpoint,
    )


# --- status -------------------------------------------------------------------


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
    target_version: int | None
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
        return not self.stuck and self.target_error is None and not self.problems

    def to_json(self) -> dict[str, Any]:
        rec = self.last_record
        return {
            "sink_id": self.sink_id,
            "healthy": self.healthy,
            "record_table": self.record_table,
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
            "stuck": [s.to_json() for s in self.stuck],
            "problems": list(self.problems),
            "export_requests": [r.to_json() for r in self.export_requests],
        }


def _folder_size(uri: str) -> tuple[int, int]:
    fs, root = _fs.filesystem(uri)
    if not fs.exists(root):
        return 0, 0
    sizes = [info["size"] for info in fs.find(root, detail=True).values()]
    return len(sizes), sum(sizes)


def sink_status(handle: SinkHandle) -> SinkStatus:
    """Read-only summary of one sink from its record table, target and checkpoint."""
    from ._delta import open_table
    from .checkpoint import latest_batch

    store = handle.record_store()
    events = store.events(handle.sink_id)
    state = handle.load()
    target_batch = target_version = staged = None
    error = None
    if handle.target_uri is not None:
        target = handle.target()
        try:
            dt = open_table(handle.target_uri, dict(handle.storage_options))
            if dt is not None:
                target_batch = dt.transaction_version(handle.sink_id)
                target_version = dt.version()
            staged = len(target.staged_attempts())
        except Exception as e:  # a status must still show what the record table knows
            error = f"{type(e).__name__}: {e}"
    files, size = _folder_size(handle.record_table)
    stuck = () if error else tuple(_stuck(handle, state, (target_batch, None)))
    problems = []
    last = state.last_record
    if target_batch is not None and (last is None or target_batch > last.batch_id):
        problems.append(
            f"the target holds batch {target_batch} of this sink but the record table "
            + (f"ends at batch {last.batch_id}" if last else "has no record")
            + ": the query will refuse to start (another writer with this sink id, a lost "
            "record table, or a switch from mode=light)"
        )
    if last is not None and handle.target_uri is not None and error is None:
        if target_version is None:
            problems.append(f"the target table {handle.target_uri} is gone")
    checkpoint = handle.checkpoint
    return SinkStatus(
        sink_id=handle.sink_id,
        record_table=handle.record_table,
        target_uri=handle.target_uri,
        checkpoint=checkpoint,
        epoch=state.epoch,
        run_id=state.epoch_owner,
        query_id=state.query_id,
        last_record=state.last_record,
        target_batch=target_batch,
        target_version=target_version,
        target_error=error,
        spark_planned_batch=latest_batch(checkpoint) if checkpoint else None,
        spark_committed_batch=latest_batch(checkpoint, "commits") if checkpoint else None,
        record_events=len(events),
        summarized_at=state.summary_seq,
        record_files=files,
        record_bytes=size,
        staged_attempts=staged or 0,
        stuck=stuck,
        problems=tuple(problems),
        export_requests=tuple(
            sorted(state.export_requests.values(), key=lambda r: r.requested_seq)
        ),
    )


# --- stuck snapshots and abandon ------------------------------------------------


@dataclass(frozen=True)
class SnapshotStatus:
    """One snapshot id of a sink, as the record table and the target see it.

    ``state`` is ``pending`` (safe record, phase 2 not confirmed), ``committed``,
    ``allocated`` (reserved, never recorded), ``abandoned`` or ``unknown``.
    ``refusal`` says why :func:`abandon_snapshot` would refuse it (None: it
    would not).
    """

    sink_id: str
    snapshot_id: int
    state: str
    record: SnapshotRecord | None = None
    target_batch: int | None = None  # highest batch of this sink the target holds
    target_error: str | None = None  # the target could not be read
    refusal: str | None = None

    @property
    def target_holds_batch(self) -> bool:
        return (
            self.record is not None
            and self.target_batch is not None
            and self.target_batch >= self.record.batch_id
        )

    def to_json(self) -> dict[str, Any]:
        rec = self.record
        return {
            "sink_id": self.sink_id,
            "snapshot_id": self.snapshot_id,
            "state": self.state,
            "batch_id": rec.batch_id if rec else None,
            "rows": rec.rows if rec else None,
            "files": len(rec.txns) if rec else None,
            "bytes": sum(t.bytes for t in rec.txns) if rec else None,
            "created_at": rec.created_at.isoformat() if rec and rec.created_at else None,
            "run_id": rec.run_id if rec else None,
            "target_batch": self.target_batch,
            "target_holds_batch": self.target_holds_batch,
            "target_error": self.target_error,
            "abandonable": self.refusal is None,
            "refusal": self.refusal,
        }


def _target_batch(handle: SinkHandle) -> tuple[int | None, str | None]:
    try:
        return handle.target().committed_batch(handle.sink_id), None
    except TxnError:
        raise
    except Exception as e:  # a diagnosis must still show what the record table knows
        log.warning("sink %s: cannot read target %s: %r", handle.sink_id, handle.target_uri, e)
        return None, f"{type(e).__name__}: {e}"


def _status(
    handle: SinkHandle,
    state: SinkState,
    snapshot_id: int,
    target: tuple[int | None, str | None] | None = None,
) -> SnapshotStatus:
    rec = state.record_for_snapshot(snapshot_id)
    if snapshot_id in state.abandoned:
        kind, refusal = "abandoned", "it is already abandoned"
    elif snapshot_id in state.committed:
        kind, refusal = "committed", "it is committed; a committed snapshot is never abandoned"
    elif rec is not None:
        kind, refusal = "pending", None
        if rec is not state.last_record:
            refusal = f"it is not the last record (snapshot {state.snapshot_id} is)"
    elif snapshot_id in state.allocations:
        kind, refusal = "allocated", None
    else:
        kind, refusal = "unknown", "this sink never allocated it"
    batch, error = (None, None)
    if rec is not None and handle.target_uri is not None:
        batch, error = target if target is not None else _target_batch(handle)
    if kind == "pending" and rec is not None and batch is not None and batch >= rec.batch_id:
        # The usual state of the last record: its phase 2 landed and the next
        # record (or a restart's recovery) confirms it in the record table.
        kind = "committed"
        refusal = (
            f"it is committed (the target holds batch {batch} >= {rec.batch_id}); a "
            "committed snapshot is never abandoned"
        )
    if refusal is None and rec is not None and batch is not None and batch >= rec.batch_id:
        refusal = (
            f"the target already holds batch {batch} >= {rec.batch_id}: phase 2 landed; "
            "restart the query and recovery records it as committed"
        )
    if refusal is None and error is not None:
        refusal = f"the target cannot be read ({error})"
    return SnapshotStatus(handle.sink_id, snapshot_id, kind, rec, batch, error, refusal)


def snapshot_status(handle: SinkHandle, snapshot_id: int) -> SnapshotStatus:
    """What the record table and the target say about one snapshot id."""
    return _status(handle, handle.load(), snapshot_id)


def stuck_snapshots(handle: SinkHandle) -> list[SnapshotStatus]:
    """Safe records whose phase 2 was never confirmed, oldest first, each with the
    target's committed batch of this sink.

    A running query shows its current batch here for a moment. A record whose
    batch the target holds is committed (the next record confirms it), so it is
    not listed. One whose batch the target lacks is finished by a restart too, unless phase 2 can no longer succeed (files lost, target
    dropped or altered): then :func:`abandon_snapshot` withdraws it.
    """
    state = handle.load()
    if not pending_phase2(state):
        return []
    return _stuck(handle, state, _target_batch(handle) if handle.target_uri else None)


def _stuck(
    handle: SinkHandle, state: SinkState, target: tuple[int | None, str | None] | None
) -> list[SnapshotStatus]:
    statuses = [_status(handle, state, r.snapshot_id, target) for r in pending_phase2(state)]
    return [s for s in statuses if s.state == "pending"]


def abandon_snapshot(handle: SinkHandle, snapshot_id: int, reason: str) -> SinkState:
    """Withdraw a stuck snapshot record (or an open allocation) with an ``abandoned`` event
    and delete its staged files. Returns the sink's state afterwards.

    Refused (:class:`TxnError`) for a committed snapshot, a record that is not
    the last one, or one whose batch the target already holds. Abandoning an
    id that is already abandoned changes nothing.

    Stop the query first: the target check and the ``abandoned`` event are two
    steps, so a running query's recovery could land phase 2 between them (the
    sink would then refuse to restart with ``CheckpointMismatchError``).

    After abandoning, **restart the query**: Spark replays the batch and it is
    decided anew, under a new snapshot id (ids are never reused).
    """
    log.info("sink %s: abandoning snapshot %d: %s", handle.sink_id, snapshot_id, reason)
    state = handle.committer().abandon(snapshot_id, reason)
    log.info("sink %s: snapshot %d is abandoned", handle.sink_id, snapshot_id)
    return state


def settle(location: str, sink: str | None = None, *, reason: str = "settled") -> SinkState:
    """Finish or roll back whatever a stopped query left of its sink's last batch.

    Stop the query first: settling takes the sink's epoch, so a run still
    going would be fenced (it fails with ``FencedError`` at its next commit).
    """
    handle = open_sink(location, sink)
    return handle.committer().settle(reason)


# --- verify ---------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """One finding about one file of one snapshot record."""

    severity: str  # "error" or "warning"
    kind: str  # missing | size | checksum | unreadable | not-in-table | checksum-format
    handle: str  # the file, relative to the target table root
    message: str

    def to_json(self) -> dict[str, Any]:
        return {
            "severity": self.severity,
            "kind": self.kind,
            "handle": self.handle,
            "message": self.message,
        }


@dataclass(frozen=True)
class SnapshotCheck:
    snapshot_id: int
    batch_id: int
    committed: bool
    files: int
    bytes: int
    problems: tuple[Problem, ...] = ()

    @property
    def ok(self) -> bool:
        return not any(p.severity == "error" for p in self.problems)

    def to_json(self) -> dict[str, Any]:
        return {
            "snapshot_id": self.snapshot_id,
            "batch_id": self.batch_id,
            "committed": self.committed,
            "files": self.files,
            "bytes": self.bytes,
            "ok": self.ok,
            "problems": [p.to_json() for p in self.problems],
        }


@dataclass(frozen=True)
class VerifyReport:
    sink_id: str
    target_uri: str | None
    snapshots: tuple[SnapshotCheck, ...] = ()

    @property
    def problems(self) -> list[tuple[int, Problem]]:
        """Every ``(snapshot id, problem)``, errors and warnings."""
        return [(s.snapshot_id, p) for s in self.snapshots for p in s.problems]

    @property
    def errors(self) -> list[tuple[int, Problem]]:
        return [(sid, p) for sid, p in self.problems if p.severity == "error"]

    @property
    def warnings(self) -> list[tuple[int, Problem]]:
        return [(sid, p) for sid, p in self.problems if p.severity == "warning"]

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.snapshots)

    def to_json(self) -> dict[str, Any]:
        return {
            "sink_id": self.sink_id,
            "target_uri": self.target_uri,
            "ok": self.ok,
            "snapshots": [s.to_json() for s in self.snapshots],
        }


def _table_files(handle: SinkHandle) -> tuple[int, set[str]] | None:
    """(version, relative paths) of the target now; None if there is no table."""
    import pyarrow as pa

    from ._delta import open_table

    if handle.target_uri is None:
        return None
    dt = open_table(handle.target_uri, dict(handle.storage_options))
    if dt is None:
        return None
    paths = pa.table(dt.get_add_actions(flatten=False)).column("path").to_pylist()
    return dt.version(), {unquote(p) for p in paths} | set(paths)


def _not_in_table(
    table: tuple[int, set[str]] | None,
    committed_version: int | None,
    stamp_matches: bool = True,
) -> Problem:
    """Why a committed file is not in the table now: a later removal is a warning; a table
    that is gone, older than the commit, or whose commit at that version is not this
    record's (re-created, restored) lost committed data."""
    if table is None:
        return Problem("error", "not-in-table", "", "committed, but there is no table any more")
    version = table[0]
    if committed_version is not None and (version < committed_version or not stamp_matches):
        return Problem(
            "error",
            "not-in-table",
            "",
            f"committed at table version {committed_version}, but the table is at version "
            f"{version}: it was re-created or restored and lost committed data",
        )
    return Problem("warning", "not-in-table", "", "not in the current table version")


def byte_progress(total: int, progress: Progress | None) -> Callable[[int], None]:
    """A callback that adds bytes done and reports ``(done, total)`` to ``progress``
    (reported once with 0 at once)."""
    done = 0
    if progress is not None:
        progress(0, total)

    def advance(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(min(done, total), total)

    return advance


def crc32_of(fs, path: str, on_bytes: Callable[[int], None]) -> str:
    crc = 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
            on_bytes(len(chunk))
    return f"crc32:{crc:08x}"


def verify(handle: SinkHandle, progress: Progress | None = None) -> VerifyReport:
    """Re-read every file every live (non-abandoned) snapshot record names.

    Each file must exist with the recorded size and CRC32. A committed record's
    files must also be in the target's current version; a file that is not (a
    later delete, overwrite or vacuum removed it) is a warning, and is not read.
    ``progress(done_bytes, total_bytes)`` is called as files are read.
    """
    state = handle.load()
    records = sorted(state.records.values(), key=lambda r: r.snapshot_id)
    if not records or handle.target_uri is None:
        return VerifyReport(handle.sink_id, handle.target_uri)
    fs, root = _fs.filesystem(handle.target_uri)
    target = handle.target()
    committed = dict(state.committed)
    for rec in pending_phase2(state):  # the last record: the next one would confirm it
        version = target.committed_version(rec)
        if version is not None:
            committed[rec.snapshot_id] = version
    table = _table_files(handle) if committed else None
    stamps = target.commit_stamps(v for v in committed.values() if v is not None)
    plan: list[tuple[SnapshotRecord, list[Problem], list]] = []
    for rec in records:
        problems: list[Problem] = []
        to_read = []
        for t in rec.txns:
            if rec.snapshot_id in committed and (table is None or t.handle not in table[1]):
                version = committed.get(rec.snapshot_id)
                why = _not_in_table(
                    table, version, version is None or stamps.get(version) == rec.record_id
                )
                problems.append(replace(why, handle=t.handle))
            else:
                to_read.append(t)
        plan.append((rec, problems, to_read))
    advance = byte_progress(sum(t.bytes for _, _, to_read in plan for t in to_read), progress)
    checks = []
    for rec, problems, to_read in plan:
        for t in to_read:
            problems.extend(_check_file(fs, _fs.join(root, t.handle), t, advance))
        checks.append(
            SnapshotCheck(
                snapshot_id=rec.snapshot_id,
                batch_id=rec.batch_id,
                committed=rec.snapshot_id in committed,
                files=len(rec.txns),
                bytes=sum(t.bytes for t in rec.txns),
                problems=tuple(problems),
            )
        )
        for p in problems:  # the report carries them; the log is for --verbose
            log.debug(
                "sink %s, snapshot %d: %s: %s", handle.sink_id, rec.snapshot_id, p.handle, p.message
            )
    return VerifyReport(handle.sink_id, handle.target_uri, tuple(checks))


def _check_file(fs, path: str, t, advance: Callable[[int], None]) -> Iterable[Problem]:
    try:
        info = fs.info(path)
    except FileNotFoundError:
        advance(t.bytes)
        return [Problem("error", "missing", t.handle, "file is missing")]
    size = info.get("size")
    if size != t.bytes:
        advance(t.bytes)
        return [Problem("error", "size", t.handle, f"expected {t.bytes} bytes, found {size} bytes")]
    if not str(t.checksum).startswith("crc32:"):
        advance(t.bytes)
        return [
            Problem(
                "warning", "checksum-format", t.handle, f"unknown checksum {t.checksum!r}: not read"
            )
        ]
    read = 0

    def count(n: int) -> None:
        nonlocal read
        read += n
        advance(n)

    try:
        actual = crc32_of(fs, path, count)
    except OSError as e:
        advance(t.bytes - read)
        return [Problem("error", "unreadable", t.handle, f"cannot be read: {e}")]
    if actual != t.checksum:
        return [
            Problem(
                "error",
                "checksum",
                t.handle,
                f"checksum mismatch: recorded {t.checksum}, file has {actual}",
            )
        ]
    return []
