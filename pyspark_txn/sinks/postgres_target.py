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

Modules: ``postgres_db`` (gids, names, connections, database errors),
``postgres_staging`` (types and phase 1: COPY into a prepared transaction),
``postgres_ddl`` (tables and checks, planner side); this one: the target (phase 2,
recovery, the bookkeeping of prepared transactions)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..errors import (
    CheckpointMismatchError,
    ConfigError,
    CorruptSnapshotError,
    IndeterminateTargetCommitError,
)
from ..faults import NO_FAULTS, FaultPlan
from ..state import SnapshotRecord, TxnHandle
from .postgres_db import (
    BATCHES_TABLE,
    COMMITS_TABLE,
    GID_PREFIX,
    Connector,
    attempt_prefix,
    parse_gid,
    raise_db_error,
    redact,
)
from .postgres_staging import _ident
from .target import Target, TargetTerms

log = logging.getLogger(__name__)


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
