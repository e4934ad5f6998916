"""PostgreSQL basics the txn-postgres sink shares: gids (which name the sink, attempt and
task of a prepared transaction), table names, connections (never a password in a
message) and what a database error means for the protocol."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NoReturn

from ..errors import (
    ConfigError,
    TargetBusyError,
    TargetError,
    TargetUnavailableError,
    TxnError,
)

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
