"""Phase 1 of txn-postgres: Spark types to PostgreSQL types, and one prepared transaction
per partition that bulk-loads the rows with binary COPY (upsert: through a staging
table), inserts its marker row and ends with PREPARE TRANSACTION."""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import date, datetime, time
from decimal import Decimal
from typing import Any

from ..errors import (
    ConfigError,
)
from ..state import TxnHandle
from . import _pgcopy
from .postgres_db import (
    BOOL,
    BPCHAR,
    BYTEA,
    COMMITS_TABLE,
    DATE,
    FLOAT4,
    FLOAT8,
    INT2,
    INT4,
    INT8,
    JSON,
    JSONB,
    NUMERIC,
    TEXT,
    TIMESTAMP,
    TIMESTAMPTZ,
    VARCHAR,
    Connector,
    make_gid,
    raise_db_error,
)

log = logging.getLogger(__name__)


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
