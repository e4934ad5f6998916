"""Operating a sink from outside Spark: find it, inspect, repair, verify.

The ``pyspark-txn`` command line is a thin client of this module. Everything
here reads the record table with delta-rs and the target with delta-rs and
fsspec (``txn-delta``) or SQL (``txn-postgres``: its prepared transactions and
bookkeeping tables); nothing needs a SparkSession. Which target a sink writes
to comes from its records (``target.kind``), or its checkpoint's ``sink.json``
before the first one. Library code logs, it never prints.

- :func:`open_sink` finds a sink from a checkpoint location or a record table.
- :func:`stuck_snapshots` lists safe records whose phase 2 never completed.
- :func:`abandon_snapshot` withdraws one of them (or an open allocation). After
  abandoning, **restart the query**: Spark replays the batch, which is then
  decided anew under a new snapshot id (the abandoned id is never reused).
- :func:`verify` re-reads every file a live record names and checks it.
- :func:`sink_status` summarises a sink: progress, lag, record-table size, trouble.
"""

from __future__ import annotations

import functools
import logging
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar, cast
from urllib.parse import unquote

from . import storage
from .errors import ConfigError, TxnError
from .sinks.twophase import (
    SPARK_ABORT_REASON,
    TargetTerms,
    abandon_lost_refusal,
    last_committed_batch,
    lost_batches,
    target_lost,
)
from .spark.options import check_location
from .state import (
    DeltaEventLog,
    EventKind,
    RecordStore,
    SinkState,
    SnapshotRecord,
    pending_phase2,
)
from .state.core import is_export_token
from .state.events import arrow_schema as record_table_schema
from .storage import fs as _fs
from .storage.checkpoint import RECORDS_DIR, read_sink_file

log = logging.getLogger(__name__)

#: First event kinds of offset-log streams (acknowledging sources), not sinks.
OFFSET_LOG_KINDS = frozenset({EventKind.CLAIM, EventKind.ACKED})
CHUNK_BYTES = 1 << 20

Progress = Callable[[int, int], None]


# --- finding a sink -----------------------------------------------------------


def _is_record_table(uri: str, storage_options: Mapping[str, str] | None) -> bool:
    """Whether ``uri`` is a record table; a Delta table of another kind is an error."""
    from deltalake import DeltaTable

    options = dict(storage_options or {}) or storage.current().for_delta()
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
    check_location("location", location)
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


#: Target kinds (``TargetTerms.kind``) the tools know.
DELTA, POSTGRES = "delta", "postgres"


def target_kind(meta: Mapping[str, Any]) -> str | None:
    """Which target a record's (or ``sink.json``'s) target description names; None if
    it names none."""
    kind = meta.get("kind")
    if kind:
        return str(kind)
    if meta.get("uri"):
        return DELTA
    if meta.get("table"):  # txn-postgres records from before the kind was kept
        return POSTGRES
    return None


def target_terms(kind: str | None) -> TargetTerms:
    """How messages name the things of a target kind (Delta's when it is unknown)."""
    if kind == POSTGRES:
        from .sinks.postgres_target import PostgresTarget

        return PostgresTarget.terms
    from .sinks.delta_target import DeltaTarget

    return DeltaTarget.terms


@dataclass(frozen=True)
class SinkHandle:
    """Where one sink's history and data live. Build it with :func:`open_sink`.

    ``kind`` is the target the sink's records name (``delta`` or ``postgres``; None
    before any does). A Delta target is ``target_uri``; a PostgreSQL one is
    ``target_meta`` (schema, table) in the database ``url`` (never with a password:
    libpq takes it from ``PGPASSWORD`` / ``~/.pgpass``, or ``password_file``).
    """

    record_table: str
    sink_id: str
    target_uri: str | None  # Delta; None: not a Delta target, or unknown yet
    storage_options: Mapping[str, str] = field(default_factory=dict, hash=False)
    fs_overrides: tuple[tuple[str, Any], ...] = field(default=(), hash=False)
    partition_by: tuple[str, ...] = ()
    checkpoint: str | None = None
    kind: str | None = None
    target_meta: Mapping[str, Any] = field(default_factory=dict, hash=False)
    url: str | None = field(default=None, repr=False)
    password_file: str | None = None

    @property
    def storage(self) -> storage.StorageOptions:
        """The sink's storage configuration (``storage_options`` and ``fs.*`` overrides)."""
        return storage.StorageOptions(
            items=tuple(sorted(self.storage_options.items())), fs_overrides=self.fs_overrides
        )

    @property
    def has_target(self) -> bool:
        """Whether the handle knows where the sink writes."""
        return self.kind == POSTGRES or self.target_uri is not None

    @property
    def terms(self) -> TargetTerms:
        return target_terms(self.kind)

    @property
    def target_label(self) -> str | None:
        """The target as messages name it (never with a password); None if unknown."""
        if self.kind != POSTGRES:
            return self.target_uri
        from .sinks.postgres_target import redact

        schema, table = self._pg_table()
        where = redact(self.url) if self.url else "a database its records do not name"
        return f"PostgreSQL table {schema}.{table} at {where}"

    def _pg_table(self) -> tuple[str, str]:
        meta = self.target_meta
        if meta.get("schema") and meta.get("name"):
            return str(meta["schema"]), str(meta["name"])
        schema, _, table = str(meta.get("table", "")).partition(".")  # older records
        return schema, table

    def require_delta(self, command: str) -> None:
        """Refuse ``command`` (which reads a Delta table's files) for another target."""
        if self.kind not in (None, DELTA):
            raise ConfigError(
                f"pyspark-txn {command}: sink {self.sink_id!r} writes to {self.target_label}; "
                f"{command} works on txn-delta sinks only (it copies or reads a Delta "
                "table's files), so it is not available for this sink"
            )

    def record_store(self) -> RecordStore:
        return RecordStore(DeltaEventLog(self.record_table, dict(self.storage_options)))

    def target(self):
        """The sink's phase-2 :class:`~pyspark_txn.sinks.twophase.Target` (close it after
        use: a PostgreSQL one holds a connection)."""
        if self.kind == POSTGRES:
            return self._postgres_target()
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
            storage=self.storage,
        )

    def _postgres_target(self):
        from .sinks.postgres_target import Connector, PostgresTarget

        schema, table = self._pg_table()
        if not self.url:
            raise ConfigError(
                f"sink {self.sink_id!r} writes to {self.target_label} (its records, written "
                "by an older pyspark-txn, do not name the database): pass --url "
                "postgresql://user@host:5432/db (open_sink(url=...))"
            )
        return PostgresTarget(Connector(self.url, self.password_file), schema, table, self.sink_id)

    def committer(self):
        """A :class:`~pyspark_txn.sinks.twophase.TwoPhaseCommitter` for this sink."""
        from .sinks.twophase import TwoPhaseCommitter

        return TwoPhaseCommitter(self.record_store(), self.target(), self.sink_id)

    def load(self) -> SinkState:
        """The sink's state: a fold over its events (every invariant checked)."""
        return self.record_store().load_sink(self.sink_id)



F = TypeVar("F", bound=Callable[..., Any])


def _in_handle_storage(func: F) -> F:
    """Run ``func(handle, ...)`` with the handle's storage options in effect, so every
    nested read (folder sizes, staged files, checkpoints) reaches the store with them,
    not with whatever configuration the caller had (a trial found ``sink_status``
    reading the record table's folder with the ambient one)."""

    @functools.wraps(func)
    def wrapper(handle: SinkHandle, *args: Any, **kwargs: Any) -> Any:
        with storage.using(handle.storage):
            return func(handle, *args, **kwargs)

    return cast(F, wrapper)


def open_sink(
    location: str,
    sink_id: str | None = None,
    storage_options: storage.StorageOptions | Mapping[str, Any] | str | None = None,
    *,
    target_uri: str | None = None,
    url: str | None = None,
    password_file: str | None = None,
) -> SinkHandle:
    """Find one sink from a checkpoint location or a record table URI.

    The sink id is, in order: ``sink_id``; the one kept in the checkpoint's
    ``pyspark_txn/sink.json``; the record table's only sink stream. Several
    sinks and no id is a :class:`ConfigError` naming them. The target is the one
    the sink's last snapshot record names (before any: the checkpoint's
    ``sink.json``, for targets other than Delta). ``target_uri`` overrides a Delta
    table; ``url`` the database of a PostgreSQL one, whose password comes from
    ``password_file``, the URL, or libpq (``PGPASSWORD``, ``~/.pgpass``).
    ``storage_options``: the object-store keys of ``storageOptions`` (JSON text, a
    mapping or :class:`~pyspark_txn.storage.StorageOptions`; default: the ones in effect,
    e.g. the CLI's ``--storage-options``), for the record table, target and checkpoint.
    """
    parsed = (
        storage.current()
        if storage_options is None
        else storage.StorageOptions.coerce(storage_options)
    )
    with storage.using(parsed):
        return _open_sink(location, sink_id, parsed, target_uri, url, password_file)


def _open_sink(
    location: str,
    sink_id: str | None,
    parsed: storage.StorageOptions,
    target_uri: str | None,
    url: str | None,
    password_file: str | None,
) -> SinkHandle:
    options = dict(parsed.items)
    record_table, checkpoint = find_record_table(location, options)
    store = RecordStore(DeltaEventLog(record_table, options))
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
    meta = recorded_target(store, chosen)
    if target_kind(meta) is None and checkpoint is not None:
        kept = read_sink_file(checkpoint) or {}
        if kept.get("sink_id") == chosen:
            meta = kept.get("target") or meta
    kind = target_kind(meta) or (DELTA if target_uri else None)
    if kind == POSTGRES and target_uri:
        raise ConfigError(
            f"sink {chosen!r} writes to PostgreSQL, not to a Delta table: target_uri does "
            "not apply (give the database with url / --url)"
        )
    if kind != POSTGRES and (url or password_file):
        raise ConfigError(
            f"--url and --password-file apply to txn-postgres sinks; sink {chosen!r} "
            + ("writes to a Delta table" if kind == DELTA else "has no record naming its target")
        )
    uri = (target_uri or meta.get("uri")) if kind != POSTGRES else None
    return SinkHandle(
        record_table=record_table,
        sink_id=chosen,
        target_uri=_fs.normalize_uri(uri) if uri else None,
        storage_options=options,
        fs_overrides=parsed.fs_overrides,
        partition_by=tuple(meta.get("partition_by") or ()),
        checkpoint=checkpoint,
        kind=kind,
        target_meta=dict(meta) if kind == POSTGRES else {},
        url=(url or meta.get("url")) if kind == POSTGRES else None,
        password_file=password_file,
    )


def recorded_target(
    store: RecordStore, sink_id: str, state: SinkState | None = None
) -> Mapping[str, Any]:
    """What the sink's last snapshot record says about its target (``{}``: none does)."""
    for event in reversed(store.events(sink_id)):  # abandoned records still name the target
        if event.kind is EventKind.SNAPSHOT:
            return event.payload.get("target") or {}
    # the history starts at a summary: its records name the target
    last = (state or store.load_sink(sink_id)).last_record
    return last.target if last is not None else {}


def describe_target(meta: Mapping[str, Any]) -> str:
    """A record's target description as a line (never a password)."""
    kind = target_kind(meta)
    if kind == POSTGRES:
        from .sinks.postgres_target import redact

        url = meta.get("url")
        return f"PostgreSQL table {meta.get('table')}" + (f" at {redact(url)}" if url else "")
    if kind == DELTA:
        return f"Delta table {meta.get('uri')}"
    return f"{kind}" if kind else "not named by any record yet"


@contextmanager
def opened_target(handle: SinkHandle) -> Iterator[Any]:
    """The handle's target, closed afterwards; None when the target is not known yet."""
    if not handle.has_target:
        yield None
        return
    target = handle.target()
    try:
        yield target
    finally:
        target.close()


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


def _view(handle: SinkHandle, target) -> _TargetView:
    if handle.kind == POSTGRES:
        from .sinks.postgres_target import parse_gid

        gids = target.prepared_txns()
        return _TargetView(
            batch=target.committed_batch(handle.sink_id),
            exists=target.table_exists(),
            staged_attempts=len({parse_gid(g, handle.sink_id) for g in gids}),
            staged_txns=len(gids),
        )
    from .storage.delta_tables import open_table

    assert handle.target_uri is not None
    dt = open_table(handle.target_uri, dict(handle.storage_options))
    return _TargetView(
        batch=dt.transaction_version(handle.sink_id) if dt is not None else None,
        version=dt.version() if dt is not None else None,
        exists=dt is not None,
        staged_attempts=len(target.staged_attempts()),
    )


@_in_handle_storage
def sink_status(handle: SinkHandle) -> SinkStatus:
    """Read-only summary of one sink from its record table, target and checkpoint."""
    from .storage.checkpoint import latest_batch

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
        sid for sid in unrecorded if sid > floor and not is_export_token(state.allocations[sid])
    )
    planned = latest_batch(checkpoint) if checkpoint else None
    batch_ids = [sid for sid, tok in state.allocations.items() if not is_export_token(tok)]
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


# --- stuck snapshots and abandon ------------------------------------------------


@dataclass(frozen=True)
class SnapshotStatus:
    """One snapshot id of a sink, as the record table and the target see it.

    ``state`` is ``pending`` (safe record, phase 2 not confirmed), ``committed``,
    ``allocated`` (reserved, never recorded), ``abandoned`` or ``unknown``.
    ``refusal`` says why :func:`abandon_snapshot` would refuse it (None: it
    would not). ``txn_states`` (PostgreSQL): each prepared transaction of a pending
    record (prepared, committed or missing), or of an allocation (prepared).
    """

    sink_id: str
    snapshot_id: int
    state: str
    record: SnapshotRecord | None = None
    target_batch: int | None = None  # highest batch of this sink the target holds
    target_error: str | None = None  # the target could not be read
    refusal: str | None = None
    terms: TargetTerms | None = None
    txn_states: Mapping[str, str] = field(default_factory=dict, hash=False)
    # the target lost (deleted, replaced) batches up to last_committed committed to it
    target_gone: str | None = None
    last_committed: int | None = None
    lost_batches: str | None = None  # what the record table says went to the lost target

    @property
    def target_holds_batch(self) -> bool:
        return (
            self.record is not None
            and self.target_batch is not None
            and self.target_batch >= self.record.batch_id
        )

    def to_json(self) -> dict[str, Any]:
        rec = self.record
        out = {
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
            "target_gone": self.target_gone,
        }
        if self.txn_states:
            out["txn_states"] = dict(self.txn_states)
        return out


def _target_batch(handle: SinkHandle, target) -> tuple[int | None, str | None]:
    try:
        return target.committed_batch(handle.sink_id), None
    except TxnError:
        raise
    except Exception as e:  # a diagnosis must still show what the record table knows
        log.warning("sink %s: cannot read target %s: %r", handle.sink_id, handle.target_label, e)
        return None, f"{type(e).__name__}: {e}"


def _status(
    handle: SinkHandle,
    state: SinkState,
    snapshot_id: int,
    target,
    batch_read: tuple[int | None, str | None] | None = None,
) -> SnapshotStatus:
    """``target``: the opened target (None: unknown); ``batch_read``: its committed batch
    of this sink (and why it could not be read), when the caller read it already."""
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
    if rec is not None and target is not None:
        batch, error = batch_read if batch_read is not None else _target_batch(handle, target)
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
    states: Mapping[str, str] = {}
    token = state.allocations.get(snapshot_id)
    if handle.kind == POSTGRES and target is not None and rec is None and token is not None:
        # an allocation (open or abandoned): what its tasks prepared, which abandoning
        # rolls back (a task may prepare after Spark's abort abandoned the attempt)
        states = dict.fromkeys(target.attempt_txns(snapshot_id, token), "prepared")
    if kind == "pending" and rec is not None and target is not None and error is None:
        # where phase 2 is several steps, how far it got decides (Target.abandon_refusal)
        try:
            if handle.kind == POSTGRES:
                states = {g: st for g, (st, _) in target.txn_states(rec).items()}
            if refusal is None:
                refusal = target.abandon_refusal(rec)
        except TxnError:
            raise
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    if refusal is None and error is not None:
        refusal = f"the target cannot be read ({error})"
    gone, last = None, last_committed_batch(state)
    if rec is not None and target is not None and error is None and last is not None:
        try:
            gone = target_lost(state, target, batch)
        except TxnError:
            raise
        except Exception as e:
            log.warning("sink %s: cannot tell whether the target is there: %r", handle.sink_id, e)
    if gone is not None and rec is not None and kind == "pending":
        # its phase 2 may have landed in the lost table: only a restored one can say
        refusal = abandon_lost_refusal(gone, rec.batch_id)
    restart = lost_batches(state) if gone is not None else None
    return SnapshotStatus(
        handle.sink_id,
        snapshot_id,
        kind,
        rec,
        batch,
        error,
        refusal,
        handle.terms,
        states,
        gone,
        last,
        restart,
    )


@_in_handle_storage
def snapshot_status(handle: SinkHandle, snapshot_id: int) -> SnapshotStatus:
    """What the record table and the target say about one snapshot id."""
    with opened_target(handle) as target:
        return _status(handle, handle.load(), snapshot_id, target)


@_in_handle_storage
def stuck_snapshots(handle: SinkHandle) -> list[SnapshotStatus]:
    """Safe records whose phase 2 was never confirmed, oldest first, each with the
    target's committed batch of this sink.

    A running query shows its current batch here for a moment. A record whose
    batch the target holds is committed (the next record confirms it), so it is
    not listed. One whose batch the target lacks is finished by a restart too, unless
    phase 2 can no longer succeed (files lost, prepared transactions rolled back,
    target dropped or altered): then :func:`abandon_snapshot` withdraws it.
    """
    state = handle.load()
    if not pending_phase2(state):
        return []
    with opened_target(handle) as target:
        batch_read = _target_batch(handle, target) if target is not None else None
        return _stuck(handle, state, target, batch_read)


def _stuck(
    handle: SinkHandle,
    state: SinkState,
    target,
    batch_read: tuple[int | None, str | None] | None,
) -> list[SnapshotStatus]:
    statuses = [
        _status(handle, state, r.snapshot_id, target, batch_read) for r in pending_phase2(state)
    ]
    return [s for s in statuses if s.state == "pending"]


@_in_handle_storage
def abandon_snapshot(handle: SinkHandle, snapshot_id: int, reason: str) -> SinkState:
    """Withdraw a stuck snapshot record (or an open allocation) with an ``abandoned`` event
    and roll back what it staged (Delta: its files; PostgreSQL: its prepared
    transactions, as recovery would). Returns the sink's state afterwards.

    Refused (:class:`TxnError`) for a committed snapshot, a record that is not
    the last one, one whose batch the target already holds, and one the target
    says could still commit or has begun to (:meth:`Target.abandon_refusal`).
    Abandoning an id that is already abandoned changes nothing.

    Stop the query first: the target check and the ``abandoned`` event are two
    steps, so a running query's recovery could land phase 2 between them (the
    sink would then refuse to restart with ``CheckpointMismatchError``).

    After abandoning, **restart the query**: Spark replays the batch and it is
    decided anew, under a new snapshot id (ids are never reused).
    """
    log.info("sink %s: abandoning snapshot %d: %s", handle.sink_id, snapshot_id, reason)
    committer = handle.committer()
    try:
        state = committer.abandon(snapshot_id, reason)
    finally:
        committer.target.close()
    log.info("sink %s: snapshot %d is abandoned", handle.sink_id, snapshot_id)
    return state


def settle(
    location: str, sink: str | None = None, *, reason: str = "settled", **target
) -> SinkState:
    """Finish or roll back whatever a stopped query left of its sink's last batch.

    Stop the query first: settling takes the sink's epoch, so a run still
    going would be fenced (it fails with ``FencedError`` at its next commit).
    ``target``: ``url`` / ``password_file`` of a PostgreSQL sink, as for :func:`open_sink`.
    """
    handle = open_sink(location, sink, **target)
    with storage.using(handle.storage):
        committer = handle.committer()
        try:
            return committer.settle(reason)
        finally:
            committer.target.close()


# --- verify ---------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """One finding about one file of one snapshot record."""

    severity: str  # "error" or "warning"
    # missing | size | checksum | unreadable | not-in-table | checksum-format (Delta);
    # missing | prepared | rows | not-in-table (PostgreSQL)
    kind: str
    handle: str  # the file, relative to the target table root; a PostgreSQL gid
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
    target_uri: str | None  # the target as messages name it (Delta: its URI)
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

    from .storage.delta_tables import open_table

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


@_in_handle_storage
def verify(handle: SinkHandle, progress: Progress | None = None) -> VerifyReport:
    """Re-read every file every live (non-abandoned) snapshot record names.

    Each file must exist with the recorded size and CRC32. A committed record's
    files must also be in the target's current version; a file that is not (a
    later delete, overwrite or vacuum removed it) is a warning, and is not read.
    ``progress(done_bytes, total_bytes)`` is called as files are read.
    """
    state = handle.load()
    records = sorted(state.records.values(), key=lambda r: r.snapshot_id)
    if not records or not handle.has_target:
        return VerifyReport(handle.sink_id, handle.target_label)
    if handle.kind == POSTGRES:
        with opened_target(handle) as target:
            return _verify_postgres(handle, state, records, target)
    assert handle.target_uri is not None
    fs, root = _fs.filesystem(handle.target_uri, handle.storage)
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


def _verify_postgres(
    handle: SinkHandle, state: SinkState, records: list[SnapshotRecord], target
) -> VerifyReport:
    """Every prepared transaction of every live record must be committed with the rows
    the record counts (or, while its phase 2 is pending, still prepared), and every
    committed record's batch row must be its own. Nothing is re-read row by row."""
    from .sinks.postgres_target import BATCHES_TABLE

    checks = []
    for rec in records:
        own = target.batch_record(rec.batch_id)
        committed = rec.snapshot_id in state.committed or own == rec.record_id
        problems: list[Problem] = []
        if committed and own != rec.record_id:
            problems.append(
                Problem(
                    "error",
                    "not-in-table",
                    "",
                    (
                        f"batch {rec.batch_id} has no row in {BATCHES_TABLE}"
                        if own is None
                        else f"the row of batch {rec.batch_id} in {BATCHES_TABLE} names "
                        f"record {own}, not this one"
                    )
                    + ": the bookkeeping was changed or the database restored",
                )
            )
        states = target.txn_states(rec)
        for t in rec.txns:
            st, rows = states[t.handle]
            if st == "missing":
                problems.append(
                    Problem(
                        "error",
                        "missing",
                        t.handle,
                        "neither prepared nor committed: rolled back outside the sink, or "
                        "the database was restored",
                    )
                )
            elif st == "prepared" and committed:
                problems.append(
                    Problem(
                        "error",
                        "prepared",
                        t.handle,
                        "still prepared although its batch is committed: it holds its locks "
                        "until someone commits it (COMMIT PREPARED)",
                    )
                )
            elif st == "committed" and rows != t.rows:
                problems.append(
                    Problem(
                        "error",
                        "rows",
                        t.handle,
                        f"committed {rows} rows, the record says {t.rows}",
                    )
                )
        checks.append(
            SnapshotCheck(
                snapshot_id=rec.snapshot_id,
                batch_id=rec.batch_id,
                committed=committed,
                files=len(rec.txns),
                bytes=sum(t.bytes for t in rec.txns),
                problems=tuple(problems),
            )
        )
    return VerifyReport(handle.sink_id, handle.target_label, tuple(checks))


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
