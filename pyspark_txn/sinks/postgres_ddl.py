"""txn-postgres on the planner side: server checks, the bookkeeping tables, creating the
target table and resolving its columns and unique keys."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import (
    ConfigError,
)
from .postgres_db import BATCHES_TABLE, COMMITS_TABLE, JSON, JSONB, redact
from .postgres_staging import Column, _allowed_oids, _array_element, _ident, pg_type

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
