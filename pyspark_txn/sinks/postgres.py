"""``txn-postgres`` as a streaming sink: two-phase commit with prepared transactions.

The same protocol as ``txn-delta`` (``TwoPhaseCommitter``), another target
(``PostgresTarget``): each write task prepares one transaction, the driver
commits them after the snapshot record is safe. The record table stays a
Delta table inside the checkpoint.

Prepared transactions hold row locks, so before a batch's phase 1 the planner
finishes phase 2 of safe records and rolls back dead attempts
(``TwoPhaseCommitter.release_staged``): a replayed batch never waits on the
locks of its own earlier attempt.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import ConfigError, ProtocolViolation, TxnError
from ..faults import FaultPlan
from ..spark.options import check_location, reject_unknown_options
from ..state import (
    DEFAULT_RETAIN_SNAPSHOTS,
    DeltaEventLog,
    RecordStore,
    Replay,
    SinkState,
    decide,
)
from ..storage import fs as _fs
from ..storage.checkpoint import (
    default_record_table,
    latest_batch,
    persisted_sink_id,
    read_batch_offsets,
)
from ._spark import (
    TxnCommitMessage,
    WriterBase,
    abort_attempts,
    as_arrow,
    batch_attempt,
    check_sink_id,
    commit_batch,
    commit_message,
    parse_bool,
    parse_log_level,
    parse_positive_int,
    prepare_attempt,
    spark_to_arrow_schema,
    task_slot,
    worker_logging,
)
from .postgres_db import (
    MAX_GID,
    Connector,
    parse_table_name,
    raise_db_error,
    redact,
    without_password,
)
from .postgres_ddl import check_server, create_table, ensure_marker_tables, resolve_columns
from .postgres_staging import WriteConfig, fast_kinds, stage_partition
from .postgres_target import PostgresTarget
from .twophase import TwoPhaseCommitter

SINK_OPTIONS = {
    "url": "libpq URI of the database, e.g. postgresql://user@host:5432/db (required)",
    "passwordFile": "file holding the password (else the URI's, or PGPASSWORD / ~/.pgpass)",
    "table": "target table, schema.table (required)",
    "createTable": "true|false (default false): create the table from the stream's schema",
    "mode": "append (default) or upsert (INSERT … ON CONFLICT on keyColumns)",
    "keyColumns": "comma-separated key columns of mode=upsert",
    "batchRows": "rows converted per COPY chunk in a write task (default 10000)",
    "lockTimeout": "seconds a write task waits for a row lock before failing (default 60)",
    "checkpointLocation": "set by Spark from writeStream.option('checkpointLocation')",
    "queryName": "set by Spark from queryName()",
    "sinkId": "the sink's id (default derived from the checkpoint location)",
    "sinkIdPrefix": "prefix of the derived sink id (default 'txn')",
    "retainSnapshots": "snapshot records the record table keeps (default 100)",
    "logLevel": "what Spark's Python workers log: INFO (default), WARNING, ERROR, DEBUG or OFF",
    "faultInjection": "TESTS ONLY: crash plan, see pyspark_txn.faults",
}
MODES = ("append", "upsert")
# gid = ptxn:<sink>:<12 digits>:<10-char token>:<partition>:<attempt>
_MAX_SINK_ID = MAX_GID - 64

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PostgresSinkOptions:
    """The sink's options, parsed and validated once. Plain data: safe to pickle.
    The URL is left out of ``repr`` (it may hold a password)."""

    url: str = field(repr=False)
    schema: str
    table: str
    checkpoint_location: str
    record_table: str
    sink_id: str
    explicit_sink_id: bool = False
    password_file: str | None = None
    create_table: bool = False
    mode: str = "append"
    key_columns: tuple[str, ...] = ()
    batch_rows: int = 10_000
    lock_timeout_s: int = 60
    query_name: str | None = None
    faults: FaultPlan = field(default_factory=FaultPlan)
    retain_snapshots: int = DEFAULT_RETAIN_SNAPSHOTS
    log_level: str = "INFO"
    fast_copy: bool = True  # encode COPY rows from Arrow with numpy where the types allow

    @property
    def redacted_url(self) -> str:
        return redact(self.url)

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> PostgresSinkOptions:
        opts = {k.lower(): v for k, v in options.items()}
        reject_unknown_options("txn-postgres sink", opts, SINK_OPTIONS)
        if not opts.get("url"):
            raise ConfigError(
                "txn-postgres sink: option url is required: a libpq URI such as "
                "postgresql://user@host:5432/db (the password may come from passwordFile, "
                "PGPASSWORD or ~/.pgpass)"
            )
        _check_url(opts["url"])
        if not opts.get("table"):
            raise ConfigError("txn-postgres sink: option table (schema.table) is required")
        schema, table = parse_table_name(opts["table"])
        if not opts.get("checkpointlocation"):
            raise ConfigError(
                "txn-postgres sink: option checkpointLocation is required: exactly-once needs "
                "Spark's checkpoint. Set it on the writer: .writeStream.option("
                "'checkpointLocation', '/chk/my_query')"
            )
        mode = opts.get("mode", "append").strip().lower()
        if mode not in MODES:
            raise ConfigError(f"option mode={opts['mode']!r}: expected one of {', '.join(MODES)}")
        keys = tuple(k.strip() for k in opts.get("keycolumns", "").split(",") if k.strip())
        if mode == "upsert" and not keys:
            raise ConfigError("option keyColumns is required with mode=upsert, e.g. 'id'")
        if mode == "append" and keys:
            raise ConfigError("option keyColumns applies to mode=upsert only")
        if len(set(keys)) != len(keys):
            raise ConfigError(f"option keyColumns={opts['keycolumns']!r} repeats a column")
        check_location("checkpointLocation", opts["checkpointlocation"])
        checkpoint = _fs.normalize_uri(opts["checkpointlocation"])
        prefix = check_sink_id(opts.get("sinkidprefix", "txn"), "sinkIdPrefix")
        explicit = check_sink_id(opts["sinkid"], "sinkId") if "sinkid" in opts else None
        digest = hashlib.sha256(checkpoint.encode()).hexdigest()[:16]
        sink_id = explicit or f"{prefix}-{digest}"
        if len(sink_id) > _MAX_SINK_ID:
            raise ConfigError(
                f"option sinkId: {len(sink_id)} characters; at most {_MAX_SINK_ID} (it names "
                f"prepared transactions, whose ids PostgreSQL limits to {MAX_GID - 1} bytes)"
            )
        return cls(
            url=opts["url"],
            schema=schema,
            table=table,
            checkpoint_location=checkpoint,
            record_table=default_record_table(checkpoint),
            sink_id=sink_id,
            explicit_sink_id=explicit is not None,
            password_file=opts.get("passwordfile") or None,
            create_table=parse_bool("createTable", opts.get("createtable", "false")),
            mode=mode,
            key_columns=keys,
            batch_rows=parse_positive_int("batchRows", opts.get("batchrows", "10000")),
            lock_timeout_s=parse_positive_int("lockTimeout", opts.get("locktimeout", "60")),
            query_name=opts.get("queryname"),
            faults=FaultPlan.parse(opts.get("faultinjection")),
            retain_snapshots=parse_positive_int(
                "retainSnapshots", opts.get("retainsnapshots", str(DEFAULT_RETAIN_SNAPSHOTS))
            ),
            log_level=parse_log_level(opts.get("loglevel", "INFO")),
        )

    def with_checkpoint_sink_id(self) -> PostgresSinkOptions:
        """The sink id kept in the checkpoint (written there on first use, with where the
        sink writes, so tools find its database before its first record)."""
        sink_id = persisted_sink_id(
            self.checkpoint_location,
            self.sink_id,
            self.sink_id if self.explicit_sink_id else None,
            target=self.target_meta(),
        )
        return replace(self, sink_id=sink_id)

    def target_meta(self) -> dict[str, Any]:
        """What each record (and sink.json) says about the target: enough for the CLI to
        find the database and the bookkeeping tables. Never the password."""
        return {
            "kind": PostgresTarget.terms.kind,
            "table": self.qualified_table,
            "schema": self.schema,
            "name": self.table,
            "mode": self.mode,
            "url": without_password(self.url),
        }

    @property
    def connector(self) -> Connector:
        return Connector(self.url, self.password_file)

    @property
    def qualified_table(self) -> str:
        return f"{self.schema}.{self.table}"

    def record_store(self) -> RecordStore:
        return RecordStore(DeltaEventLog(self.record_table))

    def target(self) -> PostgresTarget:
        return PostgresTarget(
            self.connector, self.schema, self.table, self.sink_id, faults=self.faults
        )

    def committer(self) -> TwoPhaseCommitter:
        # Listing this sink's prepared transactions is one cheap query: sweep every
        # batch, so that nothing dead holds locks for long.
        return TwoPhaseCommitter(
            self.record_store(),
            self.target(),
            self.sink_id,
            faults=self.faults,
            retain_snapshots=self.retain_snapshots,
            sweep_every=1,
        )

    def prepare_table(self, arrow_schema) -> WriteConfig:
        """Planner side, before anything is staged: check the server, create the tables
        asked for, and match the stream's columns to the table's."""
        import psycopg

        missing = [k for k in self.key_columns if k not in arrow_schema.names]
        if missing:
            raise ConfigError(
                f"option keyColumns: columns {missing} are not in the stream {arrow_schema.names}"
            )
        conn = self.connector.connect(doing=f"preparing table {self.qualified_table}")
        try:
            with conn:
                check_server(conn, self.url)
                if self.create_table:
                    create_table(conn, self.schema, self.table, arrow_schema, self.key_columns)
                columns = resolve_columns(
                    conn, self.schema, self.table, arrow_schema, self.key_columns
                )
                ensure_marker_tables(conn, self.schema)
        except psycopg.Error as e:
            raise_db_error(e, f"preparing table {self.qualified_table}", self.url)
        return WriteConfig(
            connector=self.connector,
            schema=self.schema,
            table=self.table,
            sink_id=self.sink_id,
            columns=columns,
            mode=self.mode,
            key_columns=self.key_columns,
            batch_rows=self.batch_rows,
            lock_timeout_s=self.lock_timeout_s,
            fast_kinds=fast_kinds(columns, arrow_schema) if self.fast_copy else None,
        )


def _check_url(url: str) -> None:
    try:
        from psycopg.conninfo import conninfo_to_dict

        conninfo_to_dict(url)
    except Exception as e:
        raise ConfigError(f"option url={redact(url)!r} is not a libpq URI: {e}") from None


def _prepare_attempt(opts: PostgresSinkOptions) -> tuple[tuple[int, str], bool]:
    """Release what earlier attempts still hold, then allocate the batch's snapshot id.
    Returns the attempt and whether the batch is a replay of a decided one."""
    committer = opts.committer()
    try:
        attempt = prepare_attempt(committer, opts.record_table, release_staged=True)
        return attempt, _is_replay(opts, committer.load())
    finally:
        _close(committer)


def _is_replay(opts: PostgresSinkOptions, state: SinkState) -> bool:
    """Whether the batch being planned (the newest in Spark's offset log: Spark writes
    it before planning the batch) has a safe record with the same offsets.

    Its rows are then not staged again: they are in the table already, or will be by
    the record's phase 2, and a unique index would refuse them. The commit checks the
    guess: a batch staged as a replay that has no record fails instead of being
    recorded empty.
    """
    latest = latest_batch(opts.checkpoint_location)
    rec = state.records.get(latest) if latest is not None else None
    if rec is None or latest is None:
        return False
    offsets = read_batch_offsets(opts.checkpoint_location, latest)
    try:
        decision = decide(state, latest, rec.snapshot_id, state.epoch, state.query_id, offsets)
    except TxnError:
        return False  # the commit raises it, with the whole story
    return isinstance(decision, Replay)


def release_if_aborted(committer: TwoPhaseCommitter, snapshot_id: int, token: str) -> bool:
    """After a task prepared: if the attempt was aborted meanwhile, roll it back now.

    Spark aborts a failed batch while its other tasks may still be writing. Abort
    appends ``abandoned`` before it rolls back what is prepared, so a task that
    prepares after that roll-back sees the event here and rolls back itself,
    instead of leaving its transaction (and its locks) to the query's next start.
    """
    if snapshot_id not in committer.load().abandoned:
        return False
    log.warning(
        "sink %s: snapshot %d was aborted while this task prepared: rolling it back",
        committer.sink_id,
        snapshot_id,
    )
    committer.target.discard(snapshot_id, token)
    return True


class TxnPostgresStreamWriter(WriterBase):
    def __init__(self, opts: PostgresSinkOptions, spark_schema) -> None:
        self.opts = opts
        self.arrow_schema = spark_to_arrow_schema(spark_schema, "a PostgreSQL table")
        # Checked here, where Spark reports a plain "failed to initialize" error.
        self.config = opts.prepare_table(self.arrow_schema)
        self._attempt: tuple[int, str] | None = None
        self._replay = False

    def __getstate__(self) -> dict[str, Any]:
        # Pickling happens in the driver, once per batch, before any task runs.
        if self._attempt is None:
            worker_logging(self.opts.log_level)
            self._attempt, self._replay = _prepare_attempt(self.opts)
        return self.__dict__

    def write(self, iterator) -> TxnCommitMessage:

        worker_logging(self.opts.log_level)
        assert self._attempt is not None, "the writer was pickled without an attempt"
        snapshot_id, token = self._attempt
        partition, attempt = task_slot()
        if self._replay:
            for _ in iterator:  # decided already: the rows are (or will be) in the table
                pass
            self.opts.faults.hit("phase1", snapshot=snapshot_id, partition=partition)
            return commit_message(self.opts.sink_id, snapshot_id, token, partition, [], True)
        handles = stage_partition(
            as_arrow(iterator, self.arrow_schema),
            self.config,
            snapshot_id,
            token,
            partition,
            attempt,
            self.arrow_schema,
        )
        if handles and release_if_aborted(self.opts.committer(), snapshot_id, token):
            handles = []
        self.opts.faults.hit("phase1", snapshot=snapshot_id, partition=partition)
        return commit_message(self.opts.sink_id, snapshot_id, token, partition, handles)

    def commit(self, messages, batchId: int) -> None:
        worker_logging(self.opts.log_level)
        msgs = [m for m in messages if m is not None]
        committer = self.opts.committer()
        try:
            attempt = batch_attempt(committer, msgs, batchId)
            if any(m.replay for m in msgs) and batchId not in committer.load().records:
                raise ProtocolViolation(
                    f"sink {self.opts.sink_id!r}: batch {batchId} was planned as a replay "
                    "of a decided batch, but the record table has no record of it; its "
                    "rows were not staged. Restart the query: the batch is planned again"
                )
            commit_batch(
                committer,
                msgs,
                batchId,
                attempt,
                self.opts.checkpoint_location,
                self.opts.query_name,
                self.opts.target_meta,
            )
        finally:
            _close(committer)

    def abort(self, messages, batchId: int) -> None:
        worker_logging(self.opts.log_level)
        committer = self.opts.committer()
        try:
            abort_attempts(committer, messages)
        finally:
            _close(committer)


def _close(committer: TwoPhaseCommitter) -> None:
    if isinstance(committer.target, PostgresTarget):
        committer.target.close()
