"""The PostgreSQL target of the two-phase protocol: prepared transactions.

Phase 1 (a write task): one transaction per partition bulk-loads the rows with
binary ``COPY`` (upsert: into a transaction-local staging table, then
``INSERT … ON CONFLICT``), inserts a marker row naming its gid into
``pyspark_txn_commits``, and ends with ``PREPARE TRANSACTION '<gid>'``. The gid
``ptxn:<sink>:<snapshot>:<token>:<partition>:<task attempt>`` names the sink, the
attempt and the task, so this sink finds its own prepared transactions in
``pg_prepared_xacts`` and nobody else's.

Phase 2 (driver): ``COMMIT PREPARED`` per gid, then one row per batch in
``pyspark_txn_batches`` (sink, batch, snapshot, record id). A gid is
*committed* when its marker row is visible, *pending* while it is in
``pg_prepared_xacts``, and *gone* when neither: so a lost response is re-read,
never guessed, and a batch is never committed twice. ``committed_batch`` comes
from ``pyspark_txn_batches``, inside the database.

Staging tables are ordinary unlogged tables created and dropped inside the
prepared transaction: PostgreSQL refuses to prepare a transaction that touched
a temporary table.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime, time
from decimal import Decimal
from typing import Any, NoReturn

from ..errors import (
    CheckpointMismatchError,
    ConfigError,
    CorruptSnapshotError,
    IndeterminateTargetCommitError,
    TargetBusyError,
    TargetError,
    TargetUnavailableError,
    TxnError,
)
from ..faults import NO_FAULTS, FaultPlan
from ..state import SnapshotRecord, TxnHandle
from . import _pgcopy
from .twophase import Target, TargetTerms

log = logging.getLogger(__name__)

GID_PREFIX = "ptxn"
COMMITS_TABLE = "pyspark_txn_commits"
BATCHES_TABLE = "pyspark_txn_batches"
MAX_GID = 200  # PostgreSQL's limit on a prepared transaction's identifier

# Built-in type oids.
INT2, INT4, INT8, NUMERIC, FLOAT4, FLOAT8 = 21, 23, 20, 1700, 700, 701
TEXT, VARCHAR, BPCHAR, BYTEA, BOOL, DATE = 25, 1043, 1042, 17, 16, 1082
TIMESTAMP, TIMESTAMPTZ, JSON, JSONB = 1114, 1184, 114, 3802


# --- gids --------------------------------------------------------------------------


def attempt_prefix(sink_id: str, snapshot_id: int, token: str) -> str:
    return f"{GID_PREFIX}:{sink_id}:{snapshot_id:012d}:{token}:"


def make_gid(sink_id: str, snapshot_id: int, token: str, partition: int, attempt: int) -> str:
    return f"{attempt_prefix(sink_id, snapshot_id, token)}{partition}:{attempt}"


def parse_gid(gid: str, sink_id: str) -> tuple[int, str] | None:
    """``(snapshot id, token)`` of one of ``sink_id``'s gids, else None."""
    head = f"{GID_PREFIX}:{sink_id}:"
    if not gid.startswith(head):
        return None
    parts = gid[len(head) :].split(":")
    if len(parts) != 4 or not parts[0].isdigit():
        return None
    return int(parts[0]), parts[1]


# --- names and connections ---------------------------------------------------------

_IDENT = re.compile(r'"((?:[^"]|"")+)"|([A-Za-z_][A-Za-z0-9_$]*)')


def parse_table_name(value: str) -> tuple[str, str]:
    """``schema.table`` (or ``table``, in ``public``) as PostgreSQL reads it: unquoted
    names fold to lower case, ``"Quoted"`` ones keep theirs."""
    parts: list[str] = []
    pos, text = 0, value.strip()
    while True:
        m = _IDENT.match(text, pos)
        if m is None:
            break
        parts.append(
            m.group(1).replace('""', '"') if m.group(1) is not None else m.group(2).lower()
        )
        pos = m.end()
        if pos < len(text) and text[pos] == ".":
            pos += 1
            continue
        break
    if pos != len(text) or not 1 <= len(parts) <= 2:
        raise ConfigError(
            f"option table={value!r}: expected schema.table (or table, in public); quote "
            'names with other characters: "My Schema"."My Table"'
        )
    return (parts[0], parts[1]) if len(parts) == 2 else ("public", parts[0])


def redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    try:
        from psycopg.conninfo import conninfo_to_dict, make_conninfo

        params = conninfo_to_dict(url)
        if "password" in params:
            params["password"] = "***"
        return make_conninfo("", **params)
    except Exception:
        return re.sub(r"//([^:/@]+):[^@]*@", r"//\1:***@", url)


def without_password(url: str) -> str:
    """The connection string with no password at all: what records keep, so that tools
    find the database (they take the password from libpq's PGPASSWORD or ~/.pgpass, or
    a password file)."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    params = conninfo_to_dict(url)
    for secret in ("password", "sslpassword"):
        params.pop(secret, None)
    return make_conninfo("", **params)


# --- database errors -----------------------------------------------------------------

_LOGIN = re.compile(
    r"authentication failed|no password supplied|password is required|pg_hba\.conf|"
    r'role "[^"]*" does not exist|database "[^"]*" does not exist|'
    r"permission denied for database|certificate",
    re.IGNORECASE,
)


def db_error(e: BaseException, doing: str, url: str) -> TxnError | None:
    """The package's error for a psycopg error users meet, saying what to do; None for
    any other. Raise it ``from e``: the database's own error stays the cause."""
    import psycopg
    from psycopg import errors as pe

    if not isinstance(e, psycopg.Error):
        return None
    where = f"the database at {redact(url)}"
    text = " ".join(str(e).split())
    head = f"txn-postgres: {doing}: {text} ({where})"
    if isinstance(e, pe.OutOfMemory) and "prepared transactions" in text:
        return ConfigError(
            f"{head}. Every write task of a batch holds one prepared transaction until "
            "phase 2, and other queries and applications hold theirs: raise the server's "
            "max_prepared_transactions (postgresql.conf or ALTER SYSTEM, then restart the "
            "server) to the write tasks of all queries writing at once, or write fewer "
            "partitions (df.coalesce(n)) before the sink"
        )
    if isinstance(e, (pe.UndefinedTable, pe.InvalidSchemaName)):
        return ConfigError(
            f"{head}. A table (or schema) the sink uses was dropped or renamed: create it "
            "again, or restart the query with createTable=true (the bookkeeping tables "
            f"{COMMITS_TABLE} and {BATCHES_TABLE} are made again when the query starts)"
        )
    if isinstance(e, pe.InsufficientPrivilege):
        return ConfigError(
            f"{head}. The sink's user needs USAGE on the schema; SELECT and INSERT (and "
            f"UPDATE for mode=upsert) on the table; SELECT, INSERT and DELETE on "
            f"{COMMITS_TABLE} and {BATCHES_TABLE}; CREATE on the schema where createTable "
            "or the bookkeeping tables must create something"
        )
    if isinstance(
        e, (pe.SerializationFailure, pe.DeadlockDetected, pe.LockNotAvailable, pe.QueryCanceled)
    ):
        return TargetBusyError(
            f"{head}. Concurrent work on the same rows or tables, or a lock_timeout or "
            "statement_timeout of the server or the user, made the database give up; the "
            "step was rolled back and running it again is safe. If it keeps failing, look "
            "for long transactions holding locks (pg_locks, pg_stat_activity) or raise "
            "those timeouts for the sink's user"
        )
    if isinstance(e, (pe.InvalidAuthorizationSpecification, pe.InvalidCatalogName)) or (
        isinstance(e, psycopg.OperationalError) and e.sqlstate is None and _LOGIN.search(text)
    ):
        return ConfigError(
            f"{head}. Check the user, the database name and the password (the URL, "
            "passwordFile (the CLI's --password-file), PGPASSWORD or ~/.pgpass) and the "
            "server's pg_hba.conf"
        )
    if isinstance(e, psycopg.OperationalError):
        return TargetUnavailableError(
            f"{head}. The database cannot be reached now. Nothing decided is lost: once "
            "it is back, restart the query; recovery commits or rolls back what is prepared"
        )
    if isinstance(e, (psycopg.IntegrityError, psycopg.DataError)):
        return TargetError(
            f"{head}. The database refused the rows; nothing of this batch is committed. "
            "Fix the data in the query (or the table's constraint), then restart the query"
        )
    return None


def raise_db_error(e: BaseException, doing: str, url: str) -> NoReturn:
    """Raise ``db_error``'s error from ``e``, or ``e`` itself when it has none."""
    err = db_error(e, doing, url)
    if err is None:
        raise e
    raise err from e


@dataclass(frozen=True)
class Connector:
    """How to reach the server: plain data that travels to executors."""

    url: str
    password_file: str | None = None

    def __repr__(self) -> str:
        return f"Connector({redact(self.url)!r}, password_file={self.password_file!r})"

    def connect(self, autocommit: bool = True, doing: str = "connecting"):
        """A connection; failing to make one is a ``ConfigError`` (login refused) or a
        ``TargetUnavailableError`` (anything else)."""
        import psycopg

        kw: dict[str, Any] = {"autocommit": autocommit, "application_name": "pyspark-txn"}
        if self.password_file:
            try:
                with open(self.password_file) as f:
                    kw["password"] = f.read().strip("\r\n")
            except OSError as e:
                raise ConfigError(
                    f"option passwordFile={self.password_file!r} cannot be read here: {e}"
                ) from e
        try:
            return psycopg.connect(self.url, **kw)
        except psycopg.Error as e:
            raise_db_error(e, doing, self.url)


# --- types -------------------------------------------------------------------------


def _array_element(t):
    """The PostgreSQL element type of an Arrow list whose values map to a scalar, else None."""
    import pyarrow as pa

    if pa.types.is_list(t) or pa.types.is_large_list(t):
        inner = t.value_type
        if pa.types.is_list(inner) or pa.types.is_large_list(inner) or _is_json(inner):
            return None
        return pg_type(inner, "element")
    return None


def _is_json(t) -> bool:
    import pyarrow as pa

    return pa.types.is_struct(t) or pa.types.is_map(t)


def pg_type(t, column: str) -> str:
    """The PostgreSQL column type ``createTable`` gives an Arrow (Spark) type."""
    import pyarrow as pa

    if pa.types.is_int8(t) or pa.types.is_int16(t):
        return "smallint"
    if pa.types.is_int32(t):
        return "integer"
    if pa.types.is_int64(t):
        return "bigint"
    if pa.types.is_float32(t):
        return "real"
    if pa.types.is_float64(t):
        return "double precision"
    if pa.types.is_decimal(t):
        return f"numeric({t.precision},{t.scale})"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "text"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return "bytea"
    if pa.types.is_boolean(t):
        return "boolean"
    if pa.types.is_date32(t):
        return "date"
    if pa.types.is_timestamp(t):
        return "timestamp with time zone" if t.tz else "timestamp without time zone"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        element = _array_element(t)
        return "jsonb" if element is None else f"{element}[]"
    if _is_json(t):
        return "jsonb"
    raise ConfigError(
        f"column {column!r} has type {t}, which txn-postgres cannot map to a PostgreSQL "
        "type; cast it (e.g. intervals to a string or a number) before the sink"
    )


def _allowed_oids(t) -> set[int]:
    """Column types of an existing table that values of Arrow type ``t`` can be copied into."""
    import pyarrow as pa

    if pa.types.is_integer(t):
        return {INT2, INT4, INT8, NUMERIC, FLOAT4, FLOAT8}
    if pa.types.is_floating(t):
        return {FLOAT4, FLOAT8}
    if pa.types.is_decimal(t):
        return {NUMERIC}
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return {TEXT, VARCHAR, BPCHAR}
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return {BYTEA}
    if pa.types.is_boolean(t):
        return {BOOL}
    if pa.types.is_date32(t):
        return {DATE}
    if pa.types.is_timestamp(t):
        return {TIMESTAMPTZ} if t.tz else {TIMESTAMP}
    if pa.types.is_list(t) or pa.types.is_large_list(t) or _is_json(t):
        return {JSON, JSONB}
    return set()


@dataclass(frozen=True)
class Column:
    name: str
    oid: int  # the table column's type: binary COPY must send exactly that type
    json: bool  # values are converted to JSON-able Python objects first


def json_safe(v: Any) -> Any:
    """A Python value as JSON can hold it: maps as objects, NaN/±Infinity, decimals and
    times as strings, bytes as hex (``\\x…``, as PostgreSQL prints bytea)."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return (
            v
            if math.isfinite(v)
            else ("NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity"))
        )
    if isinstance(v, dict):
        return {str(k): json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    if isinstance(v, Decimal):
        return str(v)
    if isinstance(v, (datetime, date, time)):
        return v.isoformat()
    if isinstance(v, (bytes, bytearray, memoryview)):
        return "\\x" + bytes(v).hex()
    return str(v)


def _maps_to_dicts(v: Any, t) -> Any:
    """Arrow maps (nested anywhere) as dicts, so that an empty map is ``{}`` not ``[]``."""
    import pyarrow as pa

    if v is None:
        return None
    if pa.types.is_map(t):
        return {
            str(json_safe(_maps_to_dicts(k, t.key_type))): _maps_to_dicts(x, t.item_type)
            for k, x in v
        }
    if pa.types.is_struct(t):
        return {f.name: _maps_to_dicts(v.get(f.name), f.type) for f in t}
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return [_maps_to_dicts(x, t.value_type) for x in v]
    return v


# --- phase 1 -----------------------------------------------------------------------


@dataclass(frozen=True)
class WriteConfig:
    """What a write task needs: plain data, pickled with the writer."""

    connector: Connector
    schema: str
    table: str
    sink_id: str
    columns: tuple[Column, ...]
    mode: str = "append"
    key_columns: tuple[str, ...] = ()
    batch_rows: int = 10_000
    lock_timeout_s: int = 60
    # how _pgcopy encodes each column, when it can encode them all (else write_row)
    fast_kinds: tuple[str, ...] | None = None


def fast_kinds(columns: Sequence[Column], arrow_schema) -> tuple[str, ...] | None:
    from ._pgcopy import fast_kind

    kinds = [fast_kind(f.type, c.oid) for f, c in zip(arrow_schema, columns, strict=True)]
    return None if any(k is None for k in kinds) else tuple(k for k in kinds if k is not None)


_INT_BITS = {INT2: 16, INT4: 32}


def check_int_ranges(chunk, columns: Sequence[Column]) -> None:
    """Refuse integers a narrower table column cannot hold, naming the column and value.

    psycopg's binary int2/int4 dumpers wrap such values silently (2654435761 into
    smallint arrives as 31153): the server never sees them, so it cannot refuse them.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    for i, column in enumerate(columns):
        bits = _INT_BITS.get(column.oid)
        t = chunk.schema.field(i).type
        if bits is None or not pa.types.is_integer(t) or t.bit_width <= bits:
            continue
        low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        bounds = pc.min_max(chunk.column(i))
        smallest, largest = bounds["min"].as_py(), bounds["max"].as_py()
        if smallest is None:
            continue
        if smallest < low or largest > high:
            bad = smallest if smallest < low else largest
            name = "smallint" if bits == 16 else "integer"
            raise ConfigError(
                f"column {column.name!r}: value {bad} does not fit the table's {name} column "
                f"({low}..{high}); nothing of this batch was written. Widen the column or "
                "cast the value in the query"
            )


def _ident(*names: str):
    from psycopg import sql

    return sql.Identifier(*names)


def stage_partition(
    batches: Iterable[Any],
    cfg: WriteConfig,
    snapshot_id: int,
    token: str,
    partition: int,
    attempt: int,
    arrow_schema,
) -> list[TxnHandle]:
    """Phase 1 of one partition: load its rows in one transaction and prepare it.

    An empty partition prepares nothing (no handle). The transaction holds row
    locks until phase 2: a key of an upsert that another partition of the same
    batch also holds waits, and fails after ``lock_timeout_s`` with a message.
    """
    import psycopg
    from psycopg import sql

    it = (b for b in batches if b.num_rows)
    first = next(it, None)
    if first is None:
        return []
    gid = make_gid(cfg.sink_id, snapshot_id, token, partition, attempt)
    names = [c.name for c in cfg.columns]
    cols = sql.SQL(", ").join(_ident(n) for n in names)
    target = _ident(cfg.schema, cfg.table)
    stage = _ident(cfg.schema, "pyspark_txn_stage_" + hashlib.sha1(gid.encode()).hexdigest()[:20])
    rows = nbytes = 0
    conn = cfg.connector.connect(autocommit=True, doing=f"partition {partition}: connecting")
    try:
        _roll_back_earlier_attempts(conn, gid, cfg.sink_id)
        conn.autocommit = False
        with conn.cursor() as cur:
            cur.execute(
                sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(f"{cfg.lock_timeout_s}s"))
            )
            into = target
            if cfg.mode == "upsert":
                cur.execute(
                    sql.SQL("CREATE UNLOGGED TABLE {} AS SELECT {} FROM {} WITH NO DATA").format(
                        stage, cols, target
                    )
                )
                into = stage
            copy_sql = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT BINARY)").format(into, cols)
            with cur.copy(copy_sql) as copy:
                if cfg.fast_kinds is not None:
                    copy.write(_pgcopy.SIGNATURE)
                else:
                    copy.set_types([c.oid for c in cfg.columns])
                for batch in _chain(first, it):
                    for start in range(0, batch.num_rows, cfg.batch_rows):
                        chunk = batch.slice(start, cfg.batch_rows)
                        check_int_ranges(chunk, cfg.columns)
                        if cfg.fast_kinds is not None:
                            copy.write(_pgcopy.encode(chunk, cfg.fast_kinds))
                        else:
                            for row in zip(
                                *_python_columns(chunk, cfg.columns, arrow_schema), strict=True
                            ):
                                copy.write_row(row)
                        rows += chunk.num_rows
                    nbytes += batch.nbytes
                if cfg.fast_kinds is not None:
                    copy.write(_pgcopy.TRAILER)
            if cfg.mode == "upsert":
                keys = sql.SQL(", ").join(_ident(k) for k in cfg.key_columns)
                others = [n for n in names if n not in cfg.key_columns]
                action = (
                    sql.SQL("DO UPDATE SET ")
                    + sql.SQL(", ").join(
                        sql.SQL("{} = EXCLUDED.{}").format(_ident(n), _ident(n)) for n in others
                    )
                    if others
                    else sql.SQL("DO NOTHING")
                )
                # The last row of a key in this partition wins (load order = ctid order).
                cur.execute(
                    sql.SQL(
                        "INSERT INTO {} ({}) SELECT DISTINCT ON ({}) {} FROM {} "
                        "ORDER BY {}, ctid DESC ON CONFLICT ({}) "
                    ).format(target, cols, keys, cols, stage, keys, keys)
                    + action
                )
                cur.execute(sql.SQL("DROP TABLE {}").format(stage))
            cur.execute(
                sql.SQL(
                    "INSERT INTO {} (gid, sink_id, snapshot_id, token, partition, rows) "
                    "VALUES (%s, %s, %s, %s, %s, %s)"
                ).format(_ident(cfg.schema, COMMITS_TABLE)),
                (gid, cfg.sink_id, snapshot_id, token, partition, rows),
            )
            cur.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
    except psycopg.errors.LockNotAvailable as e:
        conn.rollback()
        if cfg.mode == "upsert":
            fix = (
                "Another partition of the same batch holds a row with the same key in its "
                "prepared transaction: repartition the stream by keyColumns "
                f"({', '.join(cfg.key_columns)}) before the sink, or an application outside "
                "the sink holds the lock"
            )
        else:
            fix = (
                "The table has a unique key or constraint, and another partition of the same "
                "batch (or an application outside the sink) holds a row with the same key "
                "uncommitted: drop duplicates of the key in the query (a duplicate would be "
                "refused anyway), or write with mode=upsert and keyColumns"
            )
        raise ConfigError(
            f"txn-postgres: partition {partition} waited {cfg.lock_timeout_s}s for a row lock "
            f"on {cfg.schema}.{cfg.table} ({e}). {fix}"
        ) from e
    except BaseException as e:
        try:
            conn.rollback()
        except Exception:  # the connection is gone: so is the transaction
            log.debug("rollback after a failed write failed", exc_info=True)
        raise_db_error(
            e,
            f"partition {partition} of snapshot {snapshot_id} into {cfg.schema}.{cfg.table}",
            cfg.connector.url,
        )
    finally:
        conn.close()
    return [TxnHandle(partition, gid, rows, nbytes, f"rows:{rows}", {})]


def _roll_back_earlier_attempts(conn, gid: str, sink_id: str) -> None:
    """Roll back what an earlier attempt of this task (same snapshot, token and
    partition; Spark retries a task under a new attempt number) left prepared.

    Its transaction holds the locks of its rows until someone ends it, so the retry
    would wait on its own first attempt (a unique key: every row again) and fail
    after ``lock_timeout``. Spark takes one attempt's result per task and this one is
    running, so the earlier one's result is not taken: a failed attempt's never is.
    (A speculative copy may run beside the original; should the original still win,
    its gid is gone and the commit's ``verify_staged`` refuses the batch before any
    record is written: Spark runs it again, nothing is lost.)
    """
    from psycopg import errors as pe
    from psycopg import sql

    task = gid.rsplit(":", 1)[0] + ":"
    rows = conn.execute(
        "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() "
        "AND left(gid, %s) = %s AND gid <> %s",
        (len(task), task, gid),
    ).fetchall()
    for (earlier,) in rows:
        try:
            conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(earlier)))
        except pe.UndefinedObject:  # ended meanwhile (an abort, the planner's release)
            continue
        log.warning(
            "sink %s: rolled back %s, an earlier attempt of this task, before its retry",
            sink_id,
            earlier,
        )


def _chain(first, rest):
    yield first
    yield from rest


def _python_columns(batch, columns: Sequence[Column], arrow_schema) -> list[list[Any]]:
    out = []
    for i, c in enumerate(columns):
        values = batch.column(i).to_pylist()
        if c.json:
            t = arrow_schema.field(i).type
            values = [None if v is None else json_safe(_maps_to_dicts(v, t)) for v in values]
        out.append(values)
    return out


# --- DDL and checks (planner side) -------------------------------------------------


def check_server(conn, url: str) -> None:
    """Refuse a server that cannot prepare transactions, naming the setting to change."""
    (value,) = conn.execute("SHOW max_prepared_transactions").fetchone()
    if int(value) <= 0:
        raise ConfigError(
            f"txn-postgres: the PostgreSQL server at {redact(url)} has "
            f"max_prepared_transactions = {value}; PREPARE TRANSACTION needs it above 0. Set "
            "max_prepared_transactions to at least the number of write tasks of one batch "
            "(e.g. 64; Spark's shuffle partitions or the stream's partitions) in "
            "postgresql.conf (or ALTER SYSTEM SET max_prepared_transactions = 64) and "
            "restart the server"
        )


def ensure_marker_tables(conn, schema: str) -> None:
    """The sink's bookkeeping tables, next to the target table. Nothing is created when
    they exist: a user without CREATE privilege can use tables made by another."""
    from psycopg import sql

    exist = conn.execute(
        "SELECT to_regclass(%s) IS NOT NULL AND to_regclass(%s) IS NOT NULL",
        (
            sql.Identifier(schema, COMMITS_TABLE).as_string(conn),
            sql.Identifier(schema, BATCHES_TABLE).as_string(conn),
        ),
    ).fetchone()
    if exist and exist[0]:
        return
    with conn.transaction():
        # One creator at a time: concurrent CREATE TABLE IF NOT EXISTS can still fail.
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('pyspark_txn_tables'))")
        conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (gid text PRIMARY KEY, sink_id text NOT NULL, "
                "snapshot_id bigint NOT NULL, token text NOT NULL, partition integer NOT NULL, "
                "rows bigint NOT NULL, prepared_at timestamptz NOT NULL DEFAULT now())"
            ).format(_ident(schema, COMMITS_TABLE))
        )
        conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (sink_id text NOT NULL, batch_id bigint NOT NULL, "
                "snapshot_id bigint NOT NULL, record_id text NOT NULL, query_id text, "
                "rows bigint NOT NULL, committed_at timestamptz NOT NULL DEFAULT now(), "
                "PRIMARY KEY (sink_id, batch_id))"
            ).format(_ident(schema, BATCHES_TABLE))
        )


def create_table(conn, schema: str, table: str, arrow_schema, key_columns: Sequence[str]) -> None:
    """``CREATE TABLE IF NOT EXISTS`` with the stream's columns (and the keys as primary key).
    An existing table is left alone, without asking for CREATE privileges."""
    from psycopg import sql

    if table_columns(conn, schema, table) is not None:
        return

    defs = [
        sql.SQL("{} {}").format(_ident(f.name), sql.SQL(pg_type(f.type, f.name)))
        for f in arrow_schema
    ]
    if key_columns:
        defs.append(
            sql.SQL("PRIMARY KEY ({})").format(sql.SQL(", ").join(_ident(k) for k in key_columns))
        )
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('pyspark_txn_tables'))")
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(_ident(schema)))
        conn.execute(
            sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(
                _ident(schema, table), sql.SQL(", ").join(defs)
            )
        )


def table_columns(conn, schema: str, table: str) -> dict[str, tuple[int, str, bool, bool]] | None:
    """name -> (type oid, type as SQL, NOT NULL, has a default) of a table; None if absent."""
    rows = conn.execute(
        "SELECT a.attname, a.atttypid::int, format_type(a.atttypid, a.atttypmod), a.attnotnull, "
        "a.atthasdef OR a.attidentity <> '' OR a.attgenerated <> '' "
        "FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid "
        "JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relname = %s AND a.attnum > 0 AND NOT a.attisdropped "
        "ORDER BY a.attnum",
        (schema, table),
    ).fetchall()
    if not rows:
        exists = conn.execute(
            "SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relname = %s",
            (schema, table),
        ).fetchone()
        return {} if exists else None
    return {r[0]: (r[1], r[2], r[3], r[4]) for r in rows}


def _array_element_oid(conn, oid: int) -> int:
    row = conn.execute("SELECT typelem::int FROM pg_type WHERE oid = %s", (oid,)).fetchone()
    return row[0] if row else 0


def unique_key_sets(conn, schema: str, table: str) -> list[set[str]]:
    """The column sets of the table's unique indexes (primary key included)."""
    rows = conn.execute(
        "SELECT array_agg(a.attname::text) FROM pg_index i "
        "JOIN pg_class c ON c.oid = i.indrelid JOIN pg_namespace n ON n.oid = c.relnamespace "
        "JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = ANY(i.indkey) "
        "WHERE n.nspname = %s AND c.relname = %s AND i.indisunique AND i.indpred IS NULL "
        "GROUP BY i.indexrelid",
        (schema, table),
    ).fetchall()
    return [set(r[0]) for r in rows]


def resolve_columns(
    conn, schema: str, table: str, arrow_schema, key_columns: Sequence[str]
) -> tuple[Column, ...]:
    """Match the stream's columns to the table's, by name and type; raise naming the column."""
    have = table_columns(conn, schema, table)
    where = f"{schema}.{table}"
    if have is None:
        raise ConfigError(
            f"txn-postgres: table {where} does not exist; create it, or set "
            "createTable=true to create it from the stream's schema"
        )
    lower = {n.lower(): n for n in have}
    out = []
    for f in arrow_schema:
        pg_type(f.type, f.name)  # refuses types with no PostgreSQL counterpart, by name
        if f.name not in have:
            near = lower.get(f.name.lower())
            hint = f" (the table has {near!r}: names are case-sensitive)" if near else ""
            raise ConfigError(
                f"txn-postgres: column {f.name!r} of the stream is not in table {where}{hint}; "
                f"its columns: {sorted(have)}"
            )
        oid, sql_type, _, _ = have[f.name]
        allowed = _allowed_oids(f.type)
        element = _array_element(f.type)
        if element is not None:
            el_oid = _array_element_oid(conn, oid)
            inner = f.type.value_type
            if el_oid and el_oid in _allowed_oids(inner):
                allowed = allowed | {oid}
        if oid not in allowed:
            raise ConfigError(
                f"txn-postgres: column {f.name!r} has type {f.type} in the stream but "
                f"{sql_type} in table {where}; cast it in the stream, or alter the column "
                f"(e.g. to {pg_type(f.type, f.name)})"
            )
        out.append(Column(f.name, oid, oid in (JSON, JSONB)))
    stream = set(arrow_schema.names)
    required = [n for n, (_, _, notnull, default) in have.items() if notnull and not default]
    missing = sorted(set(required) - stream)
    if missing:
        raise ConfigError(
            f"txn-postgres: table {where} has NOT NULL columns {missing} without a default "
            "that the stream does not have"
        )
    if key_columns and set(key_columns) not in unique_key_sets(conn, schema, table):
        raise ConfigError(
            f"txn-postgres: mode=upsert needs a unique index or primary key on exactly "
            f"keyColumns ({', '.join(key_columns)}) of table {where}; create one (e.g. ALTER "
            f"TABLE {where} ADD PRIMARY KEY ({', '.join(key_columns)}))"
        )
    return tuple(out)


# --- the target --------------------------------------------------------------------


class PostgresTarget(Target):
    """Phase 2 on a PostgreSQL database: ``COMMIT PREPARED`` / ``ROLLBACK PREPARED``."""

    terms = TargetTerms(
        "postgres",
        "prepared transaction",
        "prepared transactions",
        f"batch {{}} marked in {BATCHES_TABLE}",
        "no batch marked",
    )

    def __init__(
        self,
        connector: Connector,
        schema: str,
        table: str,
        sink_id: str,
        *,
        faults: FaultPlan = NO_FAULTS,
    ) -> None:
        self.connector = connector
        self.schema = schema
        self.table = table
        self.sink_id = sink_id
        self.faults = faults
        self._conn: Any = None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def conn(self):
        """One autocommit connection, reopened after a failure (retries start afresh)."""
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = self.connector.connect(
                autocommit=True, doing=f"sink {self.sink_id!r}: connecting"
            )
        return self._conn

    def _run(self, query, params: Sequence[Any] | Mapping[str, Any] = (), *, doing: str):
        """Execute one statement; the database's errors users meet come out as the
        package's (``db_error``). Returns the cursor."""
        import psycopg

        try:
            return self.conn().execute(query, params)
        except psycopg.Error as e:
            if isinstance(e, psycopg.OperationalError):
                self.close()
            raise_db_error(e, f"sink {self.sink_id!r}: {doing}", self.connector.url)

    def _q(
        self,
        query,
        params: Sequence[Any] | Mapping[str, Any] = (),
        *,
        doing: str,
        missing_ok: bool = False,
    ) -> list[tuple]:
        """Rows of one statement; ``missing_ok``: none when a bookkeeping table is missing
        (no batch of any sink was committed in this schema yet)."""
        try:
            cur = self._run(query, params, doing=doing)
        except ConfigError as e:
            from psycopg import errors as pe

            if missing_ok and isinstance(e.__cause__, pe.UndefinedTable):
                return []
            raise
        return cur.fetchall() if cur.description else []

    def _marker(self, name: str):
        return _ident(self.schema, name)

    # --- reading state ---

    def _prepared(self, prefix: str) -> list[str]:
        rows = self._q(
            "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() "
            "AND left(gid, %s) = %s",
            (len(prefix), prefix),
            doing="listing its prepared transactions",
        )
        return [r[0] for r in rows]

    def attempt_txns(self, snapshot_id: int, token: str) -> list[str]:
        """The prepared transactions of one attempt now (gids)."""
        return sorted(self._prepared(attempt_prefix(self.sink_id, snapshot_id, token)))

    def prepared_txns(self) -> list[str]:
        """Every prepared transaction of this sink now (gids), whatever its attempt."""
        return sorted(self._prepared(f"{GID_PREFIX}:{self.sink_id}:"))

    def _committed_rows(self, gids: Sequence[str]) -> dict[str, int]:
        from psycopg import sql

        if not gids:
            return {}
        rows = self._q(
            sql.SQL("SELECT gid, rows FROM {} WHERE gid = ANY(%s)").format(
                self._marker(COMMITS_TABLE)
            ),
            (list(gids),),
            doing=f"reading {COMMITS_TABLE}",
            missing_ok=True,
        )
        return {g: n for g, n in rows}

    def txn_states(self, record: SnapshotRecord) -> dict[str, tuple[str, int | None]]:
        """Each gid of ``record``: ``committed`` (its marker row, with the rows it counts),
        ``prepared`` or ``missing`` (neither: rolled back outside the sink, or lost)."""
        prepared = set(
            self._prepared(attempt_prefix(self.sink_id, record.snapshot_id, record.token))
        )
        # after the prepared list: a commit in between shows up as committed, not missing
        committed = self._committed_rows([t.handle for t in record.txns])
        out: dict[str, tuple[str, int | None]] = {}
        for t in record.txns:
            if t.handle in committed:
                out[t.handle] = ("committed", committed[t.handle])
            else:
                out[t.handle] = ("prepared" if t.handle in prepared else "missing", None)
        return out

    def committed_batch(self, sink_id: str) -> int | None:
        from psycopg import sql

        rows = self._q(
            sql.SQL("SELECT max(batch_id) FROM {} WHERE sink_id = %s").format(
                self._marker(BATCHES_TABLE)
            ),
            (sink_id,),
            doing=f"reading {BATCHES_TABLE}",
            missing_ok=True,
        )
        return rows[0][0] if rows else None

    def batch_record(self, batch_id: int) -> str | None:
        """The record id that committed ``batch_id`` of this sink, per its batch row."""
        from psycopg import sql

        rows = self._q(
            sql.SQL("SELECT record_id FROM {} WHERE sink_id = %s AND batch_id = %s").format(
                self._marker(BATCHES_TABLE)
            ),
            (self.sink_id, batch_id),
            doing=f"reading {BATCHES_TABLE}",
            missing_ok=True,
        )
        return rows[0][0] if rows else None

    def location(self) -> str:
        return f"the table {self.schema}.{self.table}"

    def gone(self) -> str | None:
        if self.table_exists():
            return None
        return f"there is no table {self.schema}.{self.table} in the database"

    def table_exists(self) -> bool:
        from psycopg import sql

        name = sql.Identifier(self.schema, self.table).as_string(self.conn())
        rows = self._q("SELECT to_regclass(%s) IS NOT NULL", (name,), doing="finding its table")
        return bool(rows and rows[0][0])

    def staged_attempts(self) -> set[tuple[int, str]]:
        out = set()
        for gid in self._prepared(f"{GID_PREFIX}:{self.sink_id}:"):
            parsed = parse_gid(gid, self.sink_id)
            if parsed is not None:
                out.add(parsed)
        return out

    def verify_staged(self, snapshot_id: int, token: str, txns: Sequence[TxnHandle]) -> None:
        prefix = attempt_prefix(self.sink_id, snapshot_id, token)
        gids = [t.handle for t in txns]
        foreign = [g for g in gids if not g.startswith(prefix)]
        prepared = set(self._prepared(prefix))
        committed = self._committed_rows([g for g in gids if g not in prepared])
        missing = [g for g in gids if g not in prepared and g not in committed]
        wrong = [
            f"{t.handle} ({committed[t.handle]} rows, the task reported {t.rows})"
            for t in txns
            if t.handle in committed and committed[t.handle] != t.rows
        ]
        if foreign or missing or wrong:
            raise CorruptSnapshotError(
                f"sink {self.sink_id!r}, snapshot {snapshot_id}: prepared transactions "
                f"missing from pg_prepared_xacts and never committed: {missing}; "
                f"not of this attempt: {foreign}; wrong row counts: {wrong}. Someone rolled "
                "them back (ROLLBACK PREPARED) or the database was restored; nothing of this "
                "batch is committed. Abandon the snapshot (`pyspark-txn abandon`) to replay it"
            )

    def check_new_sink(self, sink_id: str, query_id: str | None) -> None:
        from psycopg import sql

        if query_id is None:
            return
        rows = self._q(
            sql.SQL(
                "SELECT sink_id, batch_id FROM {} WHERE query_id = %s AND sink_id <> %s LIMIT 1"
            ).format(self._marker(BATCHES_TABLE)),
            (query_id, sink_id),
            doing=f"reading {BATCHES_TABLE}",
            missing_ok=True,
        )
        if rows:
            raise CheckpointMismatchError(
                f"table {self.schema}.{BATCHES_TABLE} holds batch {rows[0][1]} of streaming "
                f"query {query_id} made by sink {rows[0][0]!r}, but this checkpoint now writes "
                f"as sink {sink_id!r} with no history: its pyspark_txn folder or record table "
                "was lost or replaced. Continuing would duplicate data. Restore them, or start "
                "a new query with a new checkpoint."
            )

    def abandon_refusal(self, record: SnapshotRecord) -> str | None:
        """Refuse while phase 2 can still finish (every gid prepared or committed: a restart
        commits the rest) and once it has begun (a committed gid's rows are visible: a
        replay would write them again). Only a batch none of whose transactions committed
        and one of which is gone can be replayed afresh."""
        states = self.txn_states(record)
        committed = sorted(g for g, (st, _) in states.items() if st == "committed")
        missing = sorted(g for g, (st, _) in states.items() if st == "missing")
        prepared = len(states) - len(committed) - len(missing)
        if committed and missing:
            return (
                f"phase 2 has begun and cannot finish: {len(committed)} of its "
                f"{len(states)} prepared transactions are committed (their rows are in "
                f"{self.schema}.{self.table}) and {missing} are neither prepared nor "
                "committed (rolled back outside the sink, or the database was restored). "
                "Abandoning would replay the whole batch and write the committed partitions' "
                "rows again. To replay it anyway, first delete those rows and their marker "
                f"rows (DELETE FROM {self.schema}.{COMMITS_TABLE} WHERE gid IN (...)) for "
                f"{committed}, then abandon"
            )
        if committed:
            return (
                f"phase 2 has begun: {len(committed)} of its {len(states)} prepared "
                f"transactions are committed and the other {prepared} are still prepared; "
                "restart the query and recovery commits them (abandoning would lose the rows "
                "of those partitions)"
            )
        if not missing:
            what = (
                f"all {prepared} of its prepared transactions are still prepared"
                if states
                else "it has no prepared transaction"
            )
            return (
                f"{what}, so its phase 2 can still commit: restart the query and recovery "
                "commits it"
            )
        return None

    # --- phase 2 ---

    def commit(self, record: SnapshotRecord) -> int | None:
        """COMMIT PREPARED every gid of ``record`` (those already committed are skipped),
        then mark the batch. Returns the batch id as the target's version."""
        from psycopg import sql

        own = self.batch_record(record.batch_id)
        if own is not None:
            if own != record.record_id:
                raise self._not_ours(
                    record, f"batch {record.batch_id} was committed by record {own}"
                )
            return record.batch_id
        top = self.committed_batch(self.sink_id)
        if top is not None and top > record.batch_id:
            raise self._not_ours(record, f"batch {top} > {record.batch_id} is committed")
        done = self._committed_rows([t.handle for t in record.txns])
        for i, t in enumerate(record.txns):
            # mid_phase2: right after a COMMIT PREPARED of this attempt's own
            first_was_ours = i == 1 and record.txns[0].handle not in done
            if first_was_ours and self.faults.hit("mid_phase2", record.batch_id):
                self._lose_connection()
            if t.handle not in done:
                self._commit_gid(record, t.handle)
        self._commit_step(
            record,
            sql.SQL(
                "INSERT INTO {} (sink_id, batch_id, snapshot_id, record_id, query_id, rows) "
                "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING"
            ).format(self._marker(BATCHES_TABLE)),
            (
                self.sink_id,
                record.batch_id,
                record.snapshot_id,
                record.record_id,
                record.query_id,
                record.rows,
            ),
            f"marking batch {record.batch_id} in {BATCHES_TABLE}",
        )
        own = self.batch_record(record.batch_id)
        if own != record.record_id:
            raise self._not_ours(record, f"batch {record.batch_id} was committed by record {own}")
        return record.batch_id

    def _lose_connection(self) -> None:
        """Tests only (fault action ``disconnect``): another session ends this one's, as a
        network failure or a server restart would; its next statement finds it gone."""
        pid = self.conn().info.backend_pid
        with self.connector.connect() as other:
            other.execute("SELECT pg_terminate_backend(%s, 10000)", (pid,))

    def _commit_step(self, record: SnapshotRecord, query, params: Sequence[Any], what: str):
        """One durable step of phase 2. A lost connection leaves its outcome unknown:
        ``IndeterminateTargetCommitError`` (retried; re-reading the markers decides it),
        never taken for a success or a failure. An error the server answered with is
        decided: the step did not happen."""
        import psycopg

        conn = self.conn()  # cannot connect: nothing was sent, TargetUnavailableError
        try:
            return conn.execute(query, params)
        except psycopg.errors.UndefinedObject:
            raise
        except psycopg.Error as e:
            if conn.broken or conn.closed:
                self.close()
                raise IndeterminateTargetCommitError(
                    f"sink {self.sink_id!r}, batch {record.batch_id} (snapshot "
                    f"{record.snapshot_id}): the connection to {redact(self.connector.url)} "
                    f"was lost while {what} ({' '.join(str(e).split())}); whether it "
                    "happened is unknown until the database is read again. The record is "
                    "safe: the next attempt, batch or start of the query reads the markers "
                    "and finishes phase 2 exactly once"
                ) from e
            raise_db_error(
                e, f"sink {self.sink_id!r}, batch {record.batch_id}: {what}", self.connector.url
            )

    def _commit_gid(self, record: SnapshotRecord, gid: str) -> None:
        import psycopg
        from psycopg import sql

        if not gid.startswith(attempt_prefix(self.sink_id, record.snapshot_id, record.token)):
            raise CorruptSnapshotError(
                f"sink {self.sink_id!r}: record of snapshot {record.snapshot_id} names {gid!r}, "
                "which is not one of its prepared transactions"
            )
        try:
            self._commit_step(
                record,
                sql.SQL("COMMIT PREPARED {}").format(sql.Literal(gid)),
                (),
                f"committing prepared transaction {gid}",
            )
            return
        except psycopg.errors.UndefinedObject:
            pass  # gone from pg_prepared_xacts: committed by someone else, or lost
        if not self._committed_rows([gid]):
            raise CorruptSnapshotError(
                f"sink {self.sink_id!r}, batch {record.batch_id}: prepared transaction {gid!r} "
                "is neither pending nor committed: it was rolled back outside the sink or the "
                "database was restored. The rows of its partition are lost to this batch; "
                "abandon the snapshot (`pyspark-txn abandon`) to replay the batch"
            )

    def _not_ours(self, record: SnapshotRecord, detail: str) -> CheckpointMismatchError:
        return CheckpointMismatchError(
            f"sink {self.sink_id!r}: {detail} in {self.schema}.{BATCHES_TABLE}, but not by "
            f"snapshot {record.snapshot_id} (record {record.record_id}): another query writes "
            "to this database as the same sink id. Give every query its own sinkId."
        )

    def discard(self, snapshot_id: int, token: str, keep: Iterable[str] = ()) -> None:
        import psycopg
        from psycopg import sql

        kept = set(keep)
        for gid in self._prepared(attempt_prefix(self.sink_id, snapshot_id, token)):
            if gid in kept:
                continue
            try:
                self._run(
                    sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)),
                    doing=f"rolling back {gid}",
                )
                log.info("sink %s: rolled back prepared transaction %s", self.sink_id, gid)
            except psycopg.errors.UndefinedObject:
                pass  # rolled back (or committed) meanwhile

    # --- bookkeeping ---

    def prune(self, floor: int) -> None:
        """Delete this sink's marker rows and batch rows of snapshot ids below ``floor``,
        always keeping its newest batch row (``committed_batch``, ``check_new_sink``).

        Each DELETE is one autocommit statement: a crash leaves all or none, and the
        next summary prunes again. Prepared transactions' own marker rows are not
        visible to it (and are above the floor)."""
        from psycopg import sql

        commits = self._run(
            sql.SQL("DELETE FROM {} WHERE sink_id = %s AND snapshot_id < %s").format(
                self._marker(COMMITS_TABLE)
            ),
            (self.sink_id, floor),
            doing=f"pruning {COMMITS_TABLE}",
        ).rowcount
        batches = self._run(
            sql.SQL(
                "DELETE FROM {t} WHERE sink_id = %s AND snapshot_id < %s "
                "AND batch_id < (SELECT max(batch_id) FROM {t} WHERE sink_id = %s)"
            ).format(t=self._marker(BATCHES_TABLE)),
            (self.sink_id, floor, self.sink_id),
            doing=f"pruning {BATCHES_TABLE}",
        ).rowcount
        log.info(
            "sink %s: pruned %d rows of %s and %d of %s below snapshot %d",
            self.sink_id,
            commits,
            COMMITS_TABLE,
            batches,
            BATCHES_TABLE,
            floor,
        )
