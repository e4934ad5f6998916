"""The PostgreSQL target without Spark: prepared transactions on a real server.

Phase 1 is ``postgres_staging.stage_partition`` (what a write task runs), the
protocol is ``TwoPhaseCommitter`` with a Delta record table, as in the sink.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
from decimal import Decimal

import psycopg
import pyarrow as pa
import pytest
from support import run_cli_process

from pyspark_txn.errors import (
    CheckpointMismatchError,
    ConfigError,
    CorruptSnapshotError,
    IndeterminateCommitError,
    IndeterminateTargetCommitError,
    TargetBusyError,
    TargetUnavailableError,
)
from pyspark_txn.faults import InjectedFault
from pyspark_txn.sinks import postgres_db, postgres_staging, postgres_target
from pyspark_txn.sinks.postgres import PostgresSinkOptions
from pyspark_txn.state import bookkeeping_floor, new_token, pending_phase2

SCHEMA = pa.schema([pa.field("id", pa.int64()), pa.field("v", pa.string())])


class Sink:
    """One txn-postgres sink driven by hand: allocate, stage partitions, commit."""

    def __init__(self, pg, tmp_path, arrow_schema=SCHEMA, **options):
        self.server, schema = pg
        self.table = f"{schema}.t"
        self.schema = arrow_schema
        self.opts = PostgresSinkOptions.parse(
            {
                "url": self.server.url,
                "table": self.table,
                "createTable": "true",
                "checkpointLocation": str(tmp_path / "chk"),
                "sinkId": "pg-sink",
                **options,
            }
        )
        self.opts = self.opts.with_checkpoint_sink_id()  # sink.json names the target
        self.config = self.opts.prepare_table(arrow_schema)
        self.committer = self.opts.committer()
        self.opts.record_store().log.create_if_missing()
        self.batch = 0
        self.query_id = "q"

    def stage(self, sid, tok, partitions, attempt=0):
        txns = []
        for p, rows in enumerate(partitions):
            batch = pa.RecordBatch.from_pylist(rows, schema=self.schema)
            txns += postgres_staging.stage_partition(
                [batch], self.config, sid, tok, p, attempt, self.schema
            )
        return txns

    def run_batch(self, partitions, run_id="r1"):
        sid, tok = self.committer.allocate()
        txns = self.stage(sid, tok, partitions)
        rec = self.committer.commit(
            self.batch,
            sid,
            tok,
            txns,
            run_id=run_id,
            query_id=self.query_id,
            target_meta=self.opts.target_meta(),
        )
        self.batch += 1
        return rec

    def query(self, sql, params=()):
        with self.server.connect() as conn:
            return conn.execute(sql, params).fetchall()

    def rows(self):
        return self.query(f"SELECT * FROM {self.table} ORDER BY id")

    def prepared(self):
        return [r[0] for r in self.query("SELECT gid FROM pg_prepared_xacts")]


def limited_role(server, schema, grants, name):
    """A new login role with USAGE on ``schema`` and ``grants`` on its tables; its URL."""
    role = f"{name}_{schema}"
    with server.connect() as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'pw'")
        conn.execute(f"GRANT USAGE ON SCHEMA {schema} TO {role}")
        conn.execute(f"GRANT {grants} ON ALL TABLES IN SCHEMA {schema} TO {role}")
    return f"postgresql://{role}:pw@127.0.0.1:{server.port}/postgres"


def rows_of(ids):
    return [{"id": i, "v": str(i)} for i in ids]


def test_each_partition_prepares_one_transaction_and_the_commit_makes_it_visible(pg, tmp_path):
    sink = Sink(pg, tmp_path)
    sid, tok = sink.committer.allocate()
    txns = sink.stage(sid, tok, [rows_of([1, 2]), [], rows_of([3])])
    assert len(txns) == 2  # the empty partition prepares nothing
    assert sorted(sink.prepared()) == sorted(t.handle for t in txns)
    assert all(t.handle.startswith(f"ptxn:pg-sink:{sid:012d}:{tok}:") for t in txns)
    assert sink.rows() == []  # invisible until phase 2
    sink.committer.commit(0, sid, tok, txns, run_id="r1", query_id="q", target_meta={})
    assert sink.rows() == [(1, "1"), (2, "2"), (3, "3")]
    assert sink.prepared() == []
    assert sink.committer.target.committed_batch("pg-sink") == 0


def test_a_fault_between_two_commit_prepared_is_finished_by_recovery(pg, tmp_path):
    sink = Sink(pg, tmp_path, faultInjection="mid_phase2:raise@batch=0")
    sid, tok = sink.committer.allocate()
    txns = sink.stage(sid, tok, [rows_of([1]), rows_of([2])])
    with pytest.raises(InjectedFault):
        sink.committer.commit(0, sid, tok, txns, run_id="r1", query_id="q", target_meta={})
    assert len(sink.rows()) == 1 and len(sink.prepared()) == 1  # half of the batch
    # a new run (no faults) recovers: phase 2 from the record, the other half lands once
    sink.committer = PostgresSinkOptions.parse({**_opts(sink), "faultInjection": ""}).committer()
    sink.batch = 1
    sink.run_batch([rows_of([3])], run_id="r2")
    assert [r[0] for r in sink.rows()] == [1, 2, 3]
    assert sink.prepared() == []


def _opts(sink):
    return {
        "url": sink.server.url,
        "table": sink.table,
        "checkpointLocation": sink.opts.checkpoint_location,
        "sinkId": "pg-sink",
    }


def test_a_lost_commit_response_never_commits_twice(pg, tmp_path):
    """COMMIT PREPARED landed but the answer was lost: the retry sees the marker row."""
    sink = Sink(pg, tmp_path)
    sid, tok = sink.committer.allocate()
    txns = sink.stage(sid, tok, [rows_of([1]), rows_of([2])])
    with sink.server.connect() as conn:
        conn.execute(f"COMMIT PREPARED '{txns[0].handle}'")  # "the lost response"
    sink.committer.commit(0, sid, tok, txns, run_id="r1", query_id="q", target_meta={})
    assert [r[0] for r in sink.rows()] == [1, 2]


def test_a_prepared_transaction_rolled_back_behind_the_sinks_back_is_named(pg, tmp_path):
    sink = Sink(pg, tmp_path)
    sid, tok = sink.committer.allocate()
    txns = sink.stage(sid, tok, [rows_of([1]), rows_of([2])])
    with sink.server.connect() as conn:
        conn.execute(f"ROLLBACK PREPARED '{txns[1].handle}'")
    with pytest.raises(CorruptSnapshotError, match="never committed"):
        sink.committer.commit(0, sid, tok, txns, run_id="r1", query_id="q", target_meta={})
    assert sink.rows() == []  # nothing of the batch, and no record was written
    assert sink.committer.load().records == {}
    sink.committer.abort(sid, tok)  # what Spark does next: the surviving txn goes too
    assert sink.prepared() == []


def test_prepared_transactions_survive_a_server_restart(pg, tmp_path):
    """Staged before a restart: the recorded attempt is committed, the unrecorded one
    rolled back, by the next run's recovery."""
    sink = Sink(pg, tmp_path, faultInjection="after_record:raise@batch=0")
    sid, tok = sink.committer.allocate()
    recorded = sink.stage(sid, tok, [rows_of([1]), rows_of([2])])
    with pytest.raises(InjectedFault):
        sink.committer.commit(0, sid, tok, recorded, run_id="r1", query_id="q", target_meta={})
    sid2, tok2 = sink.committer.allocate()
    sink.stage(sid2, tok2, [rows_of([100])])  # an attempt that never got its record
    sink.server.restart()
    assert len(sink.prepared()) == 3
    sink.committer = PostgresSinkOptions.parse(_opts(sink)).committer()
    sink.committer.release_staged()  # what the planner does before the next phase 1
    assert sink.prepared() == []
    assert [r[0] for r in sink.rows()] == [1, 2]
    sink.batch = 1
    sink.run_batch([rows_of([3])], run_id="r2")
    assert [r[0] for r in sink.rows()] == [1, 2, 3]


def test_a_replayed_upsert_does_not_wait_on_its_own_earlier_attempt(pg, tmp_path):
    """The crashed attempt still holds the keys' locks: the planner's release frees them
    before the replay's phase 1, which would otherwise wait for its lock timeout."""
    sink = Sink(pg, tmp_path, mode="upsert", keyColumns="id", lockTimeout="2")
    sid, tok = sink.committer.allocate()
    sink.stage(sid, tok, [rows_of([1, 2])])  # then the driver died: no record, no abort
    sink.committer.release_staged()
    assert sink.prepared() == []
    sink.run_batch([[{"id": 1, "v": "one"}, {"id": 2, "v": "two"}]])
    assert sink.rows() == [(1, "one"), (2, "two")]


def _add_primary_key(sink):
    with sink.server.connect() as conn:
        conn.execute(f"ALTER TABLE {sink.table} ADD PRIMARY KEY (id)")


@pytest.mark.parametrize(
    "options",
    [{"mode": "upsert", "keyColumns": "id"}, {}],
    ids=["upsert", "append-into-a-primary-key"],
)
def test_a_task_retry_is_not_blocked_by_its_own_first_attempt(pg, tmp_path, options):
    """Spark retries a task whose first attempt prepared and then failed (its result was
    never taken): the retry rolls that attempt back instead of waiting on its row locks
    for lockTimeout (issue 23 item 7)."""
    sink = Sink(pg, tmp_path, lockTimeout="1", **options)
    if not options:
        _add_primary_key(sink)
    sid, tok = sink.committer.allocate()
    sink.stage(sid, tok, [rows_of([1, 2])], attempt=0)  # prepared, then the task failed
    txns = sink.stage(sid, tok, [rows_of([1, 2])], attempt=1)
    assert sink.prepared() == [t.handle for t in txns]
    sink.committer.commit(
        0, sid, tok, txns, run_id="r1", query_id="q", target_meta=sink.opts.target_meta()
    )
    assert sink.rows() == [(1, "1"), (2, "2")] and sink.prepared() == []


def test_a_key_held_in_append_mode_does_not_suggest_key_columns(pg, tmp_path):
    sink = Sink(pg, tmp_path, lockTimeout="1")
    _add_primary_key(sink)
    sid, tok = sink.committer.allocate()
    with pytest.raises(ConfigError, match="drop duplicates of the key") as e:
        sink.stage(sid, tok, [rows_of([1]), rows_of([1])])
    assert "repartition the stream by keyColumns" not in str(e.value)
    sink.committer.abort(sid, tok)  # Spark's abort of the failed job: partition 0's txn
    assert sink.prepared() == []


def test_upsert_updates_by_key_and_the_last_row_of_a_key_wins(pg, tmp_path):
    sink = Sink(pg, tmp_path, mode="upsert", keyColumns="id")
    sink.run_batch([rows_of([1, 2, 3])])
    sink.run_batch([[{"id": 2, "v": "a"}, {"id": 4, "v": "b"}, {"id": 2, "v": "c"}]])
    assert sink.rows() == [(1, "1"), (2, "c"), (3, "3"), (4, "b")]
    stages = sink.query(
        "SELECT count(*) FROM pg_tables WHERE tablename LIKE 'pyspark_txn_stage%%'", ()
    )
    assert stages == [(0,)]  # staging tables live and die inside the transaction


def test_duplicate_keys_in_two_partitions_fail_with_a_message(pg, tmp_path):
    sink = Sink(pg, tmp_path, mode="upsert", keyColumns="id", lockTimeout="1")
    sid, tok = sink.committer.allocate()
    with pytest.raises(ConfigError, match="repartition the stream by keyColumns"):
        sink.stage(sid, tok, [rows_of([1]), rows_of([1])])
    sink.committer.abort(sid, tok)  # Spark's abort of the failed job: partition 0's txn
    assert sink.prepared() == []


def test_committed_batch_comes_from_the_database_and_other_records_are_refused(pg, tmp_path):
    sink = Sink(pg, tmp_path)
    rec = sink.run_batch([rows_of([1])])
    target = sink.committer.target
    assert target.committed_batch("pg-sink") == 0
    assert target.committed_batch("someone-else") is None
    assert target.commit(rec) == 0  # idempotent
    tok = new_token()
    other = type(rec)(**{**rec.__dict__, "token": tok, "record_id": "another"})
    with pytest.raises(CheckpointMismatchError, match="same sink id"):
        target.commit(other)


ALL_TYPES = pa.schema(
    [
        ("id", pa.int64()),
        ("b", pa.int8()),
        ("s", pa.int16()),
        ("i", pa.int32()),
        ("f", pa.float32()),
        ("d", pa.float64()),
        ("dec", pa.decimal128(12, 3)),
        ("txt", pa.string()),
        ("bin", pa.binary()),
        ("ok", pa.bool_()),
        ("day", pa.date32()),
        ("ts", pa.timestamp("us", tz="UTC")),
        ("ntz", pa.timestamp("us")),
        ("arr", pa.list_(pa.int64())),
        ("nested", pa.list_(pa.list_(pa.int32()))),
        ("st", pa.struct([("a", pa.int64()), ("b", pa.string())])),
        ("m", pa.map_(pa.string(), pa.float64())),
    ]
)


def test_every_common_spark_type_round_trips(pg, tmp_path):
    sink = Sink(pg, tmp_path, arrow_schema=ALL_TYPES)
    ts = dt.datetime(2026, 11, 24, 12, 30, 1, 123456, tzinfo=dt.timezone.utc)
    full = {
        "id": 1, "b": -8, "s": 300, "i": 70000, "f": 1.5, "d": float("nan"),
        "dec": Decimal("123456789.125"), "txt": "é\n\t\"x\"", "bin": b"\x00\xff",
        "ok": True, "day": dt.date(1, 1, 1), "ts": ts, "ntz": dt.datetime(2026, 1, 2, 3, 4, 5),
        "arr": [1, None, 3], "nested": [[1], [2, 3]], "st": {"a": 7, "b": None},
        "m": [("k", float("inf")), ("n", 2.0)],
    }  # fmt: skip
    inf = dict.fromkeys(ALL_TYPES.names)
    inf.update(id=2, d=float("-inf"), f=float("inf"), m=[])
    sink.run_batch([[full, inf, {"id": 3}]])
    types = dict(
        sink.query(
            "SELECT column_name, data_type FROM information_schema.columns "
            "WHERE table_schema = %s AND table_name = 't'",
            (sink.table.split(".")[0],),
        )
    )
    assert types["b"] == "smallint" and types["i"] == "integer" and types["f"] == "real"
    assert types["dec"] == "numeric" and types["ts"] == "timestamp with time zone"
    assert types["ntz"] == "timestamp without time zone" and types["arr"] == "ARRAY"
    assert types["st"] == types["m"] == types["nested"] == "jsonb"
    r1, r2, r3 = sink.rows()
    got = dict(zip(ALL_TYPES.names, r1, strict=True))
    assert math.isnan(got.pop("d"))
    assert got["ts"] == ts and got["ntz"] == full["ntz"]
    assert got == {
        **{k: v for k, v in full.items() if k not in ("d", "m")},
        "ts": ts,
        "m": {"k": "Infinity", "n": 2.0},
    }
    assert r2[4] == math.inf and r2[5] == -math.inf and r2[-1] == {}
    assert r3[0] == 3 and set(r3[1:]) == {None}


def test_a_type_with_no_postgresql_counterpart_is_named(pg, tmp_path):
    with pytest.raises(ConfigError, match="'gap'"):
        Sink(pg, tmp_path, arrow_schema=pa.schema([("id", pa.int64()), ("gap", pa.duration("us"))]))


def test_an_existing_table_is_checked_column_by_column(pg, tmp_path):
    server, schema = pg
    with server.connect() as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(f"CREATE TABLE {schema}.t (id integer, v integer)")
    with pytest.raises(ConfigError, match="'v' has type string.*integer"):
        Sink(pg, tmp_path, createTable="false")
    with server.connect() as conn:
        conn.execute(f"ALTER TABLE {schema}.t ALTER COLUMN v TYPE varchar(20)")
        conn.execute(f"ALTER TABLE {schema}.t ADD COLUMN extra text NOT NULL")
    with pytest.raises(ConfigError, match=r"NOT NULL columns \['extra'\]"):
        Sink(pg, tmp_path, createTable="false")
    with server.connect() as conn:
        conn.execute(f"ALTER TABLE {schema}.t ALTER COLUMN extra SET DEFAULT 'x'")
    sink = Sink(pg, tmp_path, createTable="false")  # int64 into integer, text into varchar
    sink.run_batch([rows_of([5])])
    assert sink.rows() == [(5, "5", "x")]
    with pytest.raises(ConfigError, match="unique index or primary key"):
        Sink(pg, tmp_path, createTable="false", mode="upsert", keyColumns="id")
    with pytest.raises(ConfigError, match="does not exist.*createTable=true"):
        Sink((server, "nowhere"), tmp_path, createTable="false")


def test_integers_a_narrower_column_cannot_hold_are_refused_not_wrapped(pg, tmp_path):
    """psycopg's binary int2/int4 dumpers wrap silently (2654435761 into smallint arrived
    as 31153): such a value fails the partition before anything is prepared."""
    server, schema = pg
    with server.connect() as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(f"CREATE TABLE {schema}.t (id integer, v smallint)")
    wide = pa.schema([pa.field("id", pa.int64()), pa.field("v", pa.int64())])
    sink = Sink(pg, tmp_path, arrow_schema=wide, createTable="false")
    sid, tok = sink.committer.allocate()
    for rows, message in [
        ([{"id": 1, "v": 2654435761}], r"'v': value 2654435761 does not fit .* smallint"),
        ([{"id": 5_000_000_000, "v": 1}], r"'id': value 5000000000 does not fit .* integer"),
        ([{"id": 1, "v": -32769}], r"'v': value -32769 does not fit"),
    ]:
        with pytest.raises(ConfigError, match=message):
            sink.stage(sid, tok, [rows])
    assert sink.prepared() == [] and sink.rows() == []
    sink.run_batch([[{"id": 2**31 - 1, "v": -(2**15)}, {"id": 3, "v": None}]])
    assert sink.rows() == [(3, None), (2**31 - 1, -(2**15))]


def test_a_task_that_prepares_after_spark_aborted_rolls_back_itself(pg, tmp_path):
    """Spark aborts a failed batch while other tasks still write: abort writes
    'abandoned' first, so a task preparing after abort's roll-back sees it."""
    from pyspark_txn.sinks.postgres import release_if_aborted

    sink = Sink(pg, tmp_path)
    sid, tok = sink.committer.allocate()
    assert sink.stage(sid, tok, [rows_of([1])])
    assert not release_if_aborted(sink.committer, sid, tok)  # not aborted: left prepared
    sink.committer.abort(sid, tok)  # Spark's abort: abandoned, then rolled back
    assert sink.prepared() == []
    late = sink.stage(sid, tok, [[], rows_of([2])])  # a task still writing prepares now
    assert late and sink.prepared() == [late[0].handle]
    assert release_if_aborted(sink.committer, sid, tok)
    assert sink.prepared() == [] and sink.rows() == []


def test_a_server_without_prepared_transactions_is_refused_naming_the_setting(tmp_path):
    from pg_server import PostgresServer, pg_bindir

    server = PostgresServer(pg_bindir(), max_prepared=0)
    try:
        with pytest.raises(ConfigError, match="max_prepared_transactions = 0.*restart"):
            Sink((server, "s"), tmp_path)
    finally:
        server.destroy()


@pytest.mark.parametrize(
    "options, message",
    [
        ({"url": None}, "option url is required"),
        ({"table": None}, "option table"),
        ({"table": "a.b.c"}, "expected schema.table"),
        ({"colour": "red"}, r"unknown option 'colour'; allowed \(case-insensitive\): .*batchRows"),
        ({"mode": "merge"}, "mode='merge'"),
        ({"mode": "upsert"}, "keyColumns is required"),
        ({"keyColumns": "id"}, "mode=upsert only"),
        ({"batchRows": "0"}, "batchRows='0'"),
        ({"createTable": "maybe"}, "createTable='maybe'"),
        ({"checkpointLocation": None}, "checkpointLocation is required"),
        ({"sinkId": "a:b"}, "sinkId='a:b'"),
    ],
)
def test_options_are_refused_before_anything_is_written(options, message):
    base = {"url": "postgresql://u:pw@localhost/db", "table": "s.t", "checkpointLocation": "/c"}
    merged = {k: v for k, v in {**base, **options}.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        PostgresSinkOptions.parse(merged)


def test_the_password_is_never_shown(pg, tmp_path):
    server, schema = pg
    opts = PostgresSinkOptions.parse(
        {"url": server.url, "table": f"{schema}.t", "checkpointLocation": "/c"}
    )
    assert server.password not in repr(opts) and server.password not in repr(opts.connector)
    assert server.password not in opts.redacted_url
    bad = PostgresSinkOptions.parse(
        {"url": server.url.replace("@127", "x@127"), "table": "s.t", "checkpointLocation": "/c"}
    )
    with pytest.raises(ConfigError) as e:
        bad.prepare_table(SCHEMA)
    assert server.password not in str(e.value)


def test_the_password_may_come_from_a_file_or_the_environment(pg, tmp_path, monkeypatch):
    server, schema = pg
    pw = tmp_path / "pw"
    pw.write_text(server.password + "\n")
    sink = Sink((server, schema), tmp_path, url=server.url_without_password, passwordFile=str(pw))
    sink.run_batch([rows_of([1])])
    monkeypatch.setenv("PGPASSWORD", server.password)
    opts = PostgresSinkOptions.parse(
        {"url": server.url_without_password, "table": sink.table, "checkpointLocation": "/c"}
    )
    opts.prepare_table(SCHEMA)
    with psycopg.connect(server.url_without_password) as conn:
        assert conn.execute(f"SELECT count(*) FROM {sink.table}").fetchone() == (1,)


SCALARS = pa.schema(
    [
        ("id", pa.int64()),
        ("b", pa.int8()),
        ("s", pa.int16()),
        ("i", pa.int32()),
        ("f", pa.float32()),
        ("d", pa.float64()),
        ("ok", pa.bool_()),
        ("day", pa.date32()),
        ("ts", pa.timestamp("us", tz="UTC")),
        ("ntz", pa.timestamp("us")),
        ("txt", pa.string()),
        ("bin", pa.binary()),
    ]
)


@pytest.mark.parametrize("nulls", [False, True])
def test_the_numpy_copy_encoder_writes_what_psycopg_writes(pg, tmp_path, nulls):
    """The fast path (Arrow buffers to binary COPY with numpy) against psycopg's
    ``write_row``, on every type it covers, with and without nulls, on a sliced batch."""
    import dataclasses

    server, schema = pg
    ts = dt.datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=dt.timezone.utc)
    rows = [
        {
            "id": i, "b": -128 + i, "s": -300 * i, "i": 2**31 - 1 - i, "f": [1.5, math.inf][i % 2],
            "d": [math.nan, -0.0, 1e300][i % 3], "ok": i % 2 == 0,
            "day": dt.date(1, 1, 1) + dt.timedelta(days=400 * i), "ts": ts + dt.timedelta(days=i),
            "ntz": dt.datetime(2000, 1, 1) - dt.timedelta(microseconds=i),
            "txt": ["", "é\x01\n\\", "a" * 300][i % 3], "bin": bytes(range(i % 7)),
        }
        for i in range(50)
    ]  # fmt: skip
    if nulls:
        for i, r in enumerate(rows):
            for k in SCALARS.names[1:]:
                if (i + len(k)) % 3 == 0:
                    r[k] = None
    batch = pa.RecordBatch.from_pylist(rows, schema=SCALARS).slice(3, 40)
    got = {}
    for fast in (True, False):
        sink = Sink((server, f"{schema}_{int(fast)}"), tmp_path / str(fast), SCALARS)
        assert sink.config.fast_kinds is not None
        if not fast:
            sink.config = dataclasses.replace(sink.config, fast_kinds=None)
        sid, tok = sink.committer.allocate()
        txns = postgres_staging.stage_partition([batch], sink.config, sid, tok, 0, 0, SCALARS)
        sink.committer.commit(0, sid, tok, txns, run_id="r", query_id="q", target_meta={})
        got[fast] = sink.rows()
    assert len(got[True]) == 40
    assert repr(got[True]) == repr(got[False])  # repr: NaN == NaN
    want = [tuple(r.values()) for r in rows[3:43]]
    assert repr(got[True]) == repr(want).replace(
        "datetime.timezone.utc", "zoneinfo.ZoneInfo(key='Etc/UTC')"
    )


def test_a_user_without_create_privileges_writes_into_existing_tables(pg, tmp_path):
    server, schema = pg
    Sink(pg, tmp_path / "owner")  # the owner creates the table and the marker tables
    url = limited_role(server, schema, "SELECT, INSERT", "w")
    sink = Sink(pg, tmp_path / "writer", url=url)  # createTable=true, tables exist: no DDL
    sink.run_batch([rows_of([1, 2]), rows_of([3])])
    assert [r[0] for r in sink.rows()] == [1, 2, 3]
    assert sink.prepared() == []


@pytest.mark.parametrize(
    "name, parsed",
    [
        ("orders", ("public", "orders")),
        ("Sales.Orders", ("sales", "orders")),
        ('"My Schema"."Order ""x"""', ("My Schema", 'Order "x"')),
        (' s."T" ', ("s", "T")),
    ],
)
def test_table_names_are_read_as_postgresql_reads_them(name, parsed):
    assert postgres_db.parse_table_name(name) == parsed


def test_gids_name_sink_attempt_and_task_and_parse_back():
    gid = postgres_db.make_gid("my.sink-1", 42, "abc123", 3, 7)
    assert gid == "ptxn:my.sink-1:000000000042:abc123:3:7"
    assert postgres_db.parse_gid(gid, "my.sink-1") == (42, "abc123")
    assert postgres_db.parse_gid(gid, "my.sink") is None  # another sink's prefix
    assert postgres_db.parse_gid("ptxn:my.sink-1:x:y", "my.sink-1") is None


def test_redact_hides_the_password_in_uris_and_keyword_strings():
    assert "pw" not in postgres_db.redact("postgresql://u:pw@h:5432/db")
    assert "pw" not in postgres_db.redact("host=h user=u password=pw dbname=db")
    kept = postgres_db.without_password("postgresql://u:sekrit@h:5432/db?sslpassword=sekrit")
    assert "sekrit" not in kept and "password" not in kept and "host=h" in kept


# --- database errors users meet, as the package's errors -------------------------------


def test_a_refused_login_and_an_unreachable_server_are_named_errors(pg, tmp_path):
    from pg_server import free_port

    server, schema = pg
    bad = postgres_db.Connector(server.url.replace(server.password, "wrong-pw"))
    with pytest.raises(ConfigError, match="password authentication failed") as e:
        bad.connect()
    assert isinstance(e.value.__cause__, psycopg.OperationalError)
    assert "PGPASSWORD" in str(e.value) and "wrong-pw" not in str(e.value)
    assert "--password-file" in str(e.value)  # the CLI's spelling too (issue 23 item 13)
    gone = postgres_db.Connector(f"postgresql://txn:pw@127.0.0.1:{free_port()}/postgres")
    target = postgres_target.PostgresTarget(gone, schema, "t", "pg-sink")
    with pytest.raises(TargetUnavailableError, match="cannot be reached") as e:
        target.committed_batch("pg-sink")
    assert e.value.retryable and isinstance(e.value.__cause__, psycopg.OperationalError)


def test_a_dropped_table_and_a_missing_grant_are_config_errors_naming_the_fix(pg, tmp_path):
    server, schema = pg
    sink = Sink(pg, tmp_path / "owner")
    reader = Sink(pg, tmp_path / "reader", url=limited_role(server, schema, "SELECT", "r"))
    sid, tok = reader.committer.allocate()
    with pytest.raises(ConfigError, match="SELECT and INSERT") as e:
        reader.stage(sid, tok, [rows_of([1])])
    assert isinstance(e.value.__cause__, psycopg.errors.InsufficientPrivilege)
    with server.connect() as conn:
        conn.execute(f"DROP TABLE {sink.table}")
    sid, tok = sink.committer.allocate()
    with pytest.raises(ConfigError, match="dropped or renamed.*createTable=true") as e:
        sink.stage(sid, tok, [rows_of([1])])
    assert isinstance(e.value.__cause__, psycopg.errors.UndefinedTable)
    assert sink.prepared() == []


def test_too_few_prepared_transactions_is_a_config_error_naming_the_setting(tmp_path):
    from pg_server import PostgresServer, pg_bindir

    server = PostgresServer(pg_bindir(), max_prepared=1)
    try:
        sink = Sink((server, "s"), tmp_path)
        sid, tok = sink.committer.allocate()
        with pytest.raises(ConfigError, match="raise the server's max_prepared_transactions"):
            sink.stage(sid, tok, [rows_of([1]), rows_of([2])])  # two write tasks, one slot
        sink.committer.abort(sid, tok)  # Spark's abort: the first task's one goes
        assert sink.prepared() == [] and sink.rows() == []
    finally:
        server.destroy()


def test_lock_and_serialization_failures_are_busy_errors_and_phase_2_finishes_later(pg, tmp_path):
    """Marking the batch waits on a lock past the user's lock_timeout: phase 2 fails
    with a retryable TargetBusyError after its retries; the record is safe and the next
    batch finishes it, exactly once."""
    server, schema = pg
    sink = Sink(pg, tmp_path, url=server.url + "?options=-c%20lock_timeout%3D200")
    sink.run_batch([rows_of([1])])
    sink.committer.phase2_attempts, sink.committer.backoff_s = 2, 0
    sid, tok = sink.committer.allocate()
    txns = sink.stage(sid, tok, [rows_of([2]), rows_of([3])])
    with server.connect() as holder:  # reads pass, inserts wait
        holder.execute("BEGIN")
        holder.execute(f"LOCK TABLE {schema}.pyspark_txn_batches IN SHARE MODE")
        with pytest.raises(TargetBusyError, match="lock_timeout") as e:
            sink.committer.commit(1, sid, tok, txns, run_id="r1", query_id="q", target_meta={})
        assert isinstance(e.value.__cause__, psycopg.errors.LockNotAvailable)
    assert [r.batch_id for r in pending_phase2(sink.committer.load())] == [1]
    sink.batch = 2
    sink.run_batch([rows_of([4])])
    assert [r[0] for r in sink.rows()] == [1, 2, 3, 4] and sink.prepared() == []

    a, b = server.connect(), server.connect()  # a real serialization failure
    with a, b:
        a.execute(f"CREATE TABLE {schema}.ser (x int)")
        for c in (a, b):
            c.execute("BEGIN ISOLATION LEVEL SERIALIZABLE")
            c.execute(f"SELECT count(*) FROM {schema}.ser").fetchone()
            c.execute(f"INSERT INTO {schema}.ser VALUES (1)")
        a.execute("COMMIT")
        with pytest.raises(psycopg.errors.SerializationFailure) as raw:
            b.execute("COMMIT")
    err = postgres_db.db_error(raw.value, "upserting", server.url)
    assert isinstance(err, TargetBusyError) and err.retryable and server.password not in str(err)


def test_a_connection_lost_during_commit_prepared_is_indeterminate_until_read(pg, tmp_path):
    """The session dies between two COMMIT PREPARED: the second's outcome is unknown.
    With no retry left that is an IndeterminateCommitError (never a success or a plain
    failure) and the record stays safe; the next run reads the markers and commits the
    rest exactly once. With retries, the retry reads them at once."""
    server, schema = pg
    sink = Sink(pg, tmp_path / "a", faultInjection="mid_phase2:disconnect@batch=0")
    sink.committer.phase2_attempts = 1
    sid, tok = sink.committer.allocate()
    txns = sink.stage(sid, tok, [rows_of([1]), rows_of([2])])
    with pytest.raises(IndeterminateTargetCommitError, match="whether it happened is unknown") as e:
        sink.committer.commit(0, sid, tok, txns, run_id="r1", query_id="q", target_meta={})
    assert isinstance(e.value, IndeterminateCommitError)
    assert isinstance(e.value.__cause__, psycopg.OperationalError)
    assert server.password not in str(e.value)
    assert len(sink.rows()) == 1 and len(sink.prepared()) == 1
    assert [r.batch_id for r in pending_phase2(sink.committer.load())] == [0]
    sink.committer = PostgresSinkOptions.parse(_opts(sink)).committer()
    sink.batch = 1
    sink.run_batch([rows_of([3])], run_id="r2")
    assert [r[0] for r in sink.rows()] == [1, 2, 3] and sink.prepared() == []

    retried = Sink((server, schema + "_b"), tmp_path / "b", faultInjection="mid_phase2:disconnect")
    retried.committer.backoff_s = 0
    retried.run_batch([rows_of([1]), rows_of([2])])
    assert [r[0] for r in retried.rows()] == [1, 2] and retried.prepared() == []


# --- pruning the bookkeeping tables ----------------------------------------------------


def _bookkeeping(sink, sink_id="pg-sink"):
    schema = sink.table.split(".")[0]
    commits = sink.query(
        f"SELECT snapshot_id FROM {schema}.pyspark_txn_commits WHERE sink_id = %s", (sink_id,)
    )
    batches = sink.query(
        f"SELECT snapshot_id, batch_id FROM {schema}.pyspark_txn_batches WHERE sink_id = %s",
        (sink_id,),
    )
    return sorted(r[0] for r in commits), sorted(batches)


def test_bookkeeping_is_pruned_to_the_records_the_record_table_keeps(pg, tmp_path, caplog):
    """Marker and batch rows of snapshots older than the oldest record the record table
    keeps (retainSnapshots) go at each summary; another sink's rows and everything a
    retained record needs stay. A prune that fails (no DELETE grant) never fails a batch
    and is done again at the next summary."""
    server, schema = pg
    other = Sink(pg, tmp_path / "other", sinkId="other")
    other.query_id = "another query"
    for _ in range(3):
        other.run_batch([rows_of([0])])
    url = limited_role(server, schema, "SELECT, INSERT", "p")
    sink = Sink(pg, tmp_path / "sink", url=url, retainSnapshots="2")
    sink.committer.summary_window_ids = 2
    stale = None
    with caplog.at_level(logging.WARNING, logger="pyspark_txn.sinks.twophase"):
        for b in range(12):
            sink.run_batch([rows_of([2 * b]), rows_of([2 * b + 1])])
            stale = stale or sink.committer.load()
    assert "pruning the target's bookkeeping failed" in caplog.text and "DELETE" in caplog.text
    assert len(_bookkeeping(sink)[1]) == 12  # nothing pruned: no DELETE grant
    with server.connect() as conn:
        conn.execute(f"GRANT DELETE ON ALL TABLES IN SCHEMA {schema} TO p_{schema}")
    for b in range(12, 24):
        sink.run_batch([rows_of([2 * b]), rows_of([2 * b + 1])])
    state = sink.committer.load()
    floor = bookkeeping_floor(state)
    kept = sorted(r.snapshot_id for r in state.records.values())
    commits, batches = _bookkeeping(sink)
    assert floor is not None and floor > 12 and kept[0] == floor
    assert commits == sorted(2 * kept)  # two partitions of every retained record, no more
    assert [s for s, _ in batches] == kept and batches[-1][1] == 23
    assert sink.committer.target.committed_batch("pg-sink") == 23
    for rec in state.records.values():  # phase 2 of every retained record is still a no-op
        assert sink.committer.target.commit(rec) == rec.batch_id
    assert [r[0] for r in sink.rows()] == [0, 0, 0, *range(48)]
    assert _bookkeeping(other, "other") == ([0, 1, 2], [(0, 0), (1, 1), (2, 2)])
    sink.committer.target.prune(bookkeeping_floor(stale))  # a stale run prunes less, never more
    assert _bookkeeping(sink) == (commits, batches)


def test_abandon_rolls_back_what_tasks_prepared_after_spark_aborted_the_attempt(pg, tmp_path):
    """A task prepares after abort ran without its commit message: its transaction
    belongs to an abandoned attempt. ``pyspark-txn abandon`` rolls it back, as the next
    start's sweep would, without starting the query."""
    sink = Sink(pg, tmp_path)
    sink.run_batch([rows_of([1])])
    sid, tok = sink.committer.allocate()
    sink.committer.abort(sid, tok)  # Spark's abort, before this task prepared
    (late,) = sink.stage(sid, tok, [rows_of([2])])
    env = {"PGPASSWORD": sink.server.password}
    chk = sink.opts.checkpoint_location
    code, out, _ = run_cli_process("status", chk, env=env)
    assert code == 0 and "1 prepared transaction(s) of 1 attempt(s) pending" in out
    code, out, _ = run_cli_process("abandon", chk, "--snapshot", sid, "--yes", env=env)
    assert code == 0 and f"snapshot {sid} of sink pg-sink: abandoned" in out
    assert f"{late.handle}: prepared" in out and "rolled back the 1 prepared" in out
    assert sink.prepared() == [] and [r[0] for r in sink.rows()] == [1]
