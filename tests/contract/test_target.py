"""One contract suite for every phase-2 ``Target``: the in-memory one the unit tests
use, the real Delta target (staged parquet files, read back with delta-rs) and the
PostgreSQL target (prepared transactions on a real server, read back with SQL).
Then what only the Delta target checks before a record is written."""

from __future__ import annotations

import json
import logging
import os

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake
from support import MemoryTarget

from pyspark_txn.errors import CheckpointMismatchError, ConfigError, CorruptSnapshotError
from pyspark_txn.sinks.delta import DeltaSinkOptions
from pyspark_txn.sinks.delta_target import check_writable_schema, schema_to_b64
from pyspark_txn.sinks.staging import stage_partition
from pyspark_txn.sinks.twophase import TargetTerms, TwoPhaseCommitter
from pyspark_txn.state import (
    MemoryEventLog,
    RecordStore,
    SnapshotKind,
    SnapshotRecord,
    TxnHandle,
    new_token,
)

SINK = "sink-a"
SCHEMA = pa.schema([pa.field("id", pa.int64()), pa.field("v", pa.string())])


class Stager:
    """Stages ``rows`` for one attempt on either target; returns the txn handles."""

    def __init__(self, kind, tmp_path, pg=None):
        self.kind = kind
        self.uri = str(tmp_path / "table")
        if kind == "memory":
            self.target = MemoryTarget()
        elif kind == "postgres":
            from pyspark_txn.sinks.postgres import PostgresSinkOptions

            self.server, schema = pg
            self.table = f"{schema}.t"
            opts = PostgresSinkOptions.parse(
                {
                    "url": self.server.url,
                    "table": self.table,
                    "createTable": "true",
                    "checkpointLocation": "/unused",
                    "sinkId": SINK,
                }
            )
            self.config = opts.prepare_table(SCHEMA)
            self.target = opts.target()
        else:  # delta: appended; delta-merge: merged by key; delta-complete: overwritten
            opts = DeltaSinkOptions.parse(
                {
                    "path": self.uri,
                    "checkpointLocation": "/unused",
                    "sinkId": SINK,
                    **({"keys": "id"} if kind == "delta-merge" else {}),
                }
            )
            if kind == "delta-complete":
                opts = opts.for_complete_mode()
            self.staging = opts.staging()
            self.target = opts.target()

    @property
    def is_delta(self):
        return self.kind.startswith("delta")

    def stage(self, sid, token, ids, partition=0):
        if self.kind == "memory":
            handle = f"{sid}-{token}-{partition}"
            self.target.stage(sid, token, handle, ids)
            return [TxnHandle(partition, handle, len(ids), 1, "crc32:0")]
        batch = pa.record_batch(
            [pa.array(ids, pa.int64()), pa.array([str(i) for i in ids])], schema=SCHEMA
        )
        if self.kind == "postgres":
            from pyspark_txn.sinks import postgres_staging

            return postgres_staging.stage_partition(
                [batch], self.config, sid, token, partition, 0, SCHEMA
            )
        return stage_partition([batch], self.staging, sid, token, partition, SCHEMA)

    def meta(self):
        """The target metadata a sink records with each batch."""
        base = self.target.base() if self.is_delta else {"base_version": None}
        return {"arrow_schema": schema_to_b64(SCHEMA), **base}

    def record(self, sid, token, batch, txns, **kw):
        return SnapshotRecord(
            sink_id=SINK,
            snapshot_id=sid,
            batch_id=batch,
            epoch=1,
            kind=SnapshotKind.AUTOMATIC,
            txns=tuple(txns),
            target=self.meta(),
            token=token,
            **kw,
        )

    def rows(self):
        if self.kind == "memory":
            return sorted(self.target.rows)
        if self.kind == "postgres":
            with self.server.connect() as conn:
                return [r[0] for r in conn.execute(f"SELECT id FROM {self.table} ORDER BY id")]
        return sorted(DeltaTable(self.uri).to_pyarrow_table().column("id").to_pylist())


@pytest.fixture(params=["memory", "delta", "delta-merge", "delta-complete", "postgres"])
def stager(request, tmp_path):
    pg = request.getfixturevalue("pg") if request.param == "postgres" else None
    return Stager(request.param, tmp_path, pg)


def test_commit_is_idempotent_and_versions_count(stager):
    tok = new_token()
    rec = stager.record(0, tok, 0, stager.stage(0, tok, [1, 2, 3]))
    v0 = stager.target.commit(rec)
    assert stager.target.commit(rec) == v0  # a replay finds its own commit
    assert stager.target.committed_batch(SINK) == 0
    assert stager.rows() == [1, 2, 3]


def test_commits_nothing_says_what_an_empty_batch_leaves_in_the_target(stager):
    """``commits_nothing``: true only where phase 2 of a record leaves no trace in an
    existing target (tools then take such a last record for committed), so a target's
    committed batch must then stay where it was; false for a record with rows."""
    tok = new_token()
    first = stager.record(0, tok, 0, stager.stage(0, tok, [1, 2]))
    stager.target.commit(first)
    assert not stager.target.commits_nothing(first)
    empty = stager.record(1, new_token(), 1, [])
    nothing = stager.target.commits_nothing(empty)
    stager.target.commit(empty)
    if nothing:
        assert stager.target.committed_batch(SINK) == 0
    else:
        assert stager.target.committed_batch(SINK) == 1
    assert nothing == (stager.kind in ("delta", "delta-merge"))


def test_a_commit_of_another_sink_with_the_same_id_is_not_taken_for_ours(stager):
    """Two queries write as one sink id: the app transaction says "batch 1 done", but
    the commit carrying it is not this record's: refuse instead of losing the batch."""
    t1, t2 = new_token(), new_token()
    theirs = stager.record(0, t1, 1, stager.stage(0, t1, [1]))
    ours = stager.record(0, t2, 1, stager.stage(0, t2, [2]))
    stager.target.commit(theirs)
    with pytest.raises(CheckpointMismatchError):
        stager.target.commit(ours)
    assert stager.rows() == [1]
    stager.target.discard(0, t2)  # the refused attempt is withdrawn (Spark's abort does)


def test_staged_attempts_discard_and_keep(stager):
    t1, t2 = new_token(), new_token()
    h1 = stager.stage(5, t1, [1, 2], partition=0) + stager.stage(5, t1, [3], partition=1)
    stager.stage(6, t2, [4])
    assert stager.target.staged_attempts() == {(5, t1), (6, t2)}
    stager.target.discard(5, t1, keep=[h1[0].handle])
    stager.target.verify_staged(5, t1, h1[:1])
    with pytest.raises(CorruptSnapshotError):
        stager.target.verify_staged(5, t1, h1)
    stager.target.discard(6, t2)
    stager.target.forget(6, t2)
    assert stager.target.staged_attempts() == {(5, t1)}
    stager.target.discard(6, t2)  # idempotent
    stager.target.forget(6, t2)
    stager.target.discard(5, t1)  # the kept part too: nothing is left staged


def test_same_snapshot_id_other_token_is_another_attempt(stager):
    """Discarding one attempt of an id removes its data and leaves the other token's."""
    t1, t2 = new_token(), new_token()
    h1 = stager.stage(3, t1, [1])
    h2 = stager.stage(3, t2, [2])
    stager.target.discard(3, t1)
    with pytest.raises(CorruptSnapshotError):  # the discarded attempt's data is gone
        stager.target.verify_staged(3, t1, h1)
    stager.target.verify_staged(3, t2, h2)
    stager.target.commit(stager.record(3, t2, 0, h2))
    assert stager.rows() == [2]


def test_the_committers_messages_speak_the_targets_terms(stager, caplog):
    """Files and table versions only for Delta: the shared committer's log line takes
    its words from the target."""
    terms = stager.target.terms
    assert isinstance(terms, TargetTerms)
    assert terms.kind == {"memory": "target", "postgres": "postgres"}.get(stager.kind, "delta")
    committer = TwoPhaseCommitter(RecordStore(MemoryEventLog()), stager.target, SINK)
    sid, tok = committer.allocate()
    txns = stager.stage(sid, tok, [1, 2]) + stager.stage(sid, tok, [3], partition=1)
    with caplog.at_level(logging.INFO, logger="pyspark_txn.sinks.twophase"):
        committer.commit(0, sid, tok, txns, run_id="r", query_id="q", target_meta=stager.meta())
    (line,) = [r.getMessage() for r in caplog.records if "committed as snapshot" in r.getMessage()]
    assert f"3 rows, {terms.count(2)}, " in line and terms.version.split("{}")[0] in line
    if not stager.is_delta:
        assert "file" not in line and "table version" not in line
    assert stager.rows() == [1, 2, 3]


def test_pruning_keeps_what_committed_batch_and_a_repeated_commit_need(stager):
    """``prune(floor)`` drops bookkeeping of snapshots below the floor only: the sink's
    committed batch, the rows and the phase 2 of a record at the floor are untouched."""
    records, versions = [], []
    for b in range(3):
        tok = new_token()
        rec = stager.record(b, tok, b, stager.stage(b, tok, [10 * b, 10 * b + 1]))
        versions.append(stager.target.commit(rec))
        records.append(rec)
    rows = stager.rows()
    for _ in range(2):  # idempotent
        stager.target.prune(2)
        stager.target.close()  # and usable again after close
        assert stager.target.committed_batch(SINK) == 2
        assert stager.target.commit(records[-1]) == versions[-1]
        assert stager.rows() == rows


def test_abandon_refusal_of_a_staged_record(stager):
    """A target whose phase 2 is one atomic commit never refuses; PostgreSQL refuses
    while every prepared transaction could still commit."""
    tok = new_token()
    txns = stager.stage(0, tok, [1]) + stager.stage(0, tok, [2], partition=1)
    rec = stager.record(0, tok, 0, txns)
    refusal = stager.target.abandon_refusal(rec)
    if stager.kind != "postgres":
        assert refusal is None
        return
    assert "all 2 of its prepared transactions are still prepared" in refusal
    stager.target.discard(0, tok, keep=[txns[0].handle])  # one rolled back behind its back
    assert stager.target.abandon_refusal(rec) is None
    stager.target.discard(0, tok)  # nothing left prepared


# --- the Delta target's checks before the record ---------------------------------------


@pytest.fixture
def delta(tmp_path):
    return Stager("delta", tmp_path)


def test_footer_row_counts_are_checked(delta):
    tok = new_token()
    (h,) = delta.stage(0, tok, [1, 2, 3])
    lying = TxnHandle(h.partition, h.handle, h.rows + 1, h.bytes, h.checksum, h.meta)
    with pytest.raises(CorruptSnapshotError, match="footer says 3"):
        delta.target.verify_staged(0, tok, [lying])


def _table_with(uri, schema, **kw):
    write_deltalake(uri, pa.Table.from_pylist([], schema=schema), **kw)


def test_nulls_into_a_not_null_column_are_refused_before_the_record(delta):
    strict = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("v", pa.string())])
    _table_with(delta.uri, strict)
    tok = new_token()
    txns = delta.stage(0, tok, [1, 2])
    delta.target.preflight(delta.record(0, tok, 0, txns))  # no nulls: fine
    stats = json.loads(txns[0].meta["stats"])
    stats["nullCount"]["id"] = 1
    nully = TxnHandle(
        0, txns[0].handle, 2, txns[0].bytes, "c", {**txns[0].meta, "stats": json.dumps(stats)}
    )
    with pytest.raises(ConfigError, match="NOT NULL"):
        delta.target.preflight(delta.record(0, tok, 0, [nully]))


def test_check_constraints_are_refused(delta):
    _table_with(delta.uri, SCHEMA)
    DeltaTable(delta.uri).alter.add_constraint({"id_positive": "id > 0"})
    tok = new_token()
    rec = delta.record(0, tok, 0, delta.stage(0, tok, [1]))
    with pytest.raises(ConfigError, match="CHECK constraints"):
        delta.target.preflight(rec)


@pytest.mark.parametrize(
    "schema, message",
    [
        (pa.schema([("a", pa.int64()), ("A", pa.int64())]), "differ only by case"),
        (pa.schema([("gap", pa.duration("us"))]), "'gap'.*cannot store"),
        (pa.schema([("nothing", pa.null())]), "NULL"),
        (pa.schema([("s", pa.struct([("n", pa.null())]))]), "NULL"),
        (pa.schema([("es", pa.struct([]))]), "'es' has a struct with no fields"),
        (pa.schema([("l", pa.list_(pa.struct([])))]), "'l' has a struct with no fields"),
    ],
)
def test_schemas_delta_cannot_store_are_refused(schema, message):
    with pytest.raises(ConfigError, match=message):
        check_writable_schema(schema)


def test_late_files_in_a_recorded_attempt_go_at_the_next_batch(tmp_path):
    """A speculative task writes into batch 0's attempt after its phase 2: the file is in
    no record and never in the Delta log; the next batch's phase 2 removes it. A task
    still writing into an aborted attempt: its file goes at the next sweep."""
    uri = str(tmp_path / "table")
    opts = DeltaSinkOptions.parse({"path": uri, "checkpointLocation": str(tmp_path / "chk")})
    committer = opts.committer()
    opts.record_store().log.create_if_missing()
    meta = {"arrow_schema": schema_to_b64(SCHEMA), "uri": uri}

    def stage(sid, tok, ids, partition=0):
        arrays = [pa.array(ids, pa.int64()), pa.array([str(i) for i in ids])]
        batch = pa.record_batch(arrays, schema=SCHEMA)
        return stage_partition([batch], opts.staging(), sid, tok, partition, SCHEMA)

    def batch(b, ids):
        sid, tok = committer.allocate()
        txns = stage(sid, tok, ids)
        base = committer.target.base()
        committer.commit(b, sid, tok, txns, run_id="r", query_id="q", target_meta={**meta, **base})
        return sid, tok

    def files():
        return {p.name for p in (tmp_path / "table").glob("*.parquet")}

    sid, tok = batch(0, [1, 2])
    late = stage(sid, tok, [99], partition=1)  # a task of batch 0 that ran on after phase 2
    assert late[0].handle in files()
    batch(1, [3])
    assert late[0].handle not in files()
    assert sorted(DeltaTable(uri).to_pyarrow_table().column("id").to_pylist()) == [1, 2, 3]
    # a task still writing into an aborted attempt
    sid, tok = committer.allocate()
    committer.abort(sid, tok)
    zombie = stage(sid, tok, [98])
    assert zombie[0].handle in files()
    batch(2, [4])  # skipped an id: a sweep
    assert zombie[0].handle not in files()
    assert sorted(DeltaTable(uri).to_pyarrow_table().column("id").to_pylist()) == [1, 2, 3, 4]
    live = {os.path.basename(u) for u in DeltaTable(uri).file_uris()}
    assert files() == live


def test_generated_columns_are_refused_by_name(delta):
    from deltalake.schema import Field, PrimitiveType, Schema

    generated = Field("g", PrimitiveType("long"), metadata={"delta.generationExpression": "id"})
    DeltaTable.create(delta.uri, Schema([Field("id", PrimitiveType("long")), generated]))
    with pytest.raises(ConfigError, match="'g'.*generated column"):
        delta.target.check_stream_schema(pa.schema([("id", pa.int64()), ("g", pa.int64())]), False)


def test_append_only_and_change_data_feed_tables_take_appends(delta):
    DeltaTable.create(
        delta.uri,
        SCHEMA,
        configuration={"delta.appendOnly": "true", "delta.enableChangeDataFeed": "true"},
    )
    tok = new_token()
    rec = delta.record(0, tok, 0, delta.stage(0, tok, [1, 2]))
    delta.target.preflight(rec)
    delta.target.commit(rec)
    assert delta.rows() == [1, 2]


def test_change_data_feed_column_names_are_refused_where_the_feed_is_on(delta, tmp_path):
    stream = SCHEMA.append(pa.field("_change_type", pa.string()))
    # an existing table with the feed on
    write_deltalake(
        delta.uri,
        pa.table({"id": [0], "v": ["x"]}, schema=SCHEMA),
        configuration={"delta.enableChangeDataFeed": "true"},
    )
    with pytest.raises(ConfigError, match=r"enableChangeDataFeed=true.*\['_change_type'\]"):
        delta.target.check_stream_schema(stream, merge_schema=True)
    # a new table the sink would create with it
    new = str(tmp_path / "new")
    opts = DeltaSinkOptions.parse(
        {"path": new, "checkpointLocation": "/unused", "delta.enableChangeDataFeed": "true"}
    )
    with pytest.raises(ConfigError, match="reserves the column names"):
        opts.target().check_stream_schema(stream, False)
    opts.target().check_stream_schema(SCHEMA, False)  # other names are fine


def test_a_folder_with_other_files_or_a_file_is_not_a_new_target(delta, tmp_path):
    os.makedirs(delta.uri)
    with open(os.path.join(delta.uri, "data.csv"), "w") as f:
        f.write("id\n1\n")
    with pytest.raises(ConfigError, match="not a Delta table.*data.csv"):
        delta.target.check_stream_schema(SCHEMA, False)
    plain = tmp_path / "plain-file"
    plain.write_text("x")
    opts = DeltaSinkOptions.parse({"path": str(plain), "checkpointLocation": "/unused"})
    with pytest.raises(ConfigError, match="is a file"):
        opts.target().check_stream_schema(SCHEMA, False)


def test_merge_schema_adds_not_null_stream_columns_as_nullable(delta):
    """Spark marks derived columns (``'x' AS extra``) NOT NULL; old rows have no value."""
    _table_with(delta.uri, SCHEMA)
    write_deltalake(delta.uri, pa.table({"id": [0], "v": ["old"]}, schema=SCHEMA), mode="append")
    wider = SCHEMA.append(pa.field("extra", pa.string(), nullable=False))
    delta.target.check_stream_schema(wider, merge_schema=True)
    tok = new_token()
    arrays = [pa.array([7]), pa.array(["7"]), pa.array(["x"])]
    txns = stage_partition([pa.record_batch(arrays, schema=wider)], delta.staging, 0, tok, 0, wider)
    rec = delta.record(0, tok, 0, txns)
    rec = SnapshotRecord(
        **{
            **rec.__dict__,
            "target": {**rec.target, "arrow_schema": schema_to_b64(wider), "merge_schema": True},
        }
    )
    delta.target.preflight(rec)
    delta.target.commit(rec)
    table = DeltaTable(delta.uri)
    assert table.schema().to_arrow().field("extra").nullable
    rows = sorted(table.to_pyarrow_table().to_pylist(), key=lambda r: r["id"])
    assert rows == [{"id": 0, "v": "old", "extra": None}, {"id": 7, "v": "7", "extra": "x"}]


def test_created_table_carries_properties_name_description_and_user_metadata(tmp_path):
    uri = str(tmp_path / "t")
    opts = DeltaSinkOptions.parse(
        {
            "path": uri,
            "checkpointLocation": "/unused",
            "delta.appendOnly": "true",
            "delta.logRetentionDuration": "interval 30 days",
            "tableName": "orders",
            "tableDescription": "orders, exactly once",
            "userMetadata": "pipeline v2",
        }
    )
    stager = Stager("delta", tmp_path)
    stager.target = opts.target()
    stager.staging = opts.staging()
    tok = new_token()
    stager.target.commit(stager.record(0, tok, 0, stager.stage(0, tok, [1])))
    table = DeltaTable(uri)
    meta = table.metadata()
    assert meta.configuration["delta.appendOnly"] == "true"
    assert meta.configuration["delta.logRetentionDuration"] == "interval 30 days"
    assert (meta.name, meta.description) == ("orders", "orders, exactly once")
    assert table.history(1)[0]["userMetadata"] == "pipeline v2"
    # an existing table whose properties differ from the options is refused up front
    other = DeltaSinkOptions.parse(
        {"path": uri, "checkpointLocation": "/unused", "delta.appendOnly": "false"}
    )
    with pytest.raises(ConfigError, match="delta.appendOnly='true'.*ALTER TABLE"):
        other.target().check_stream_schema(SCHEMA, False)


def test_a_column_differing_only_by_case_is_named_as_such(delta):
    _table_with(delta.uri, pa.schema([("ID", pa.int64()), ("v", pa.string())]))
    with pytest.raises(ConfigError, match="'id' of the stream differs only by case.*'ID'"):
        delta.target.check_stream_schema(SCHEMA, False)


def test_partitioned_files_live_in_hive_folders_plain_readers_understand(tmp_path):
    uri = str(tmp_path / "table")
    schema = pa.schema([("id", pa.int64()), ("p", pa.string())])
    opts = DeltaSinkOptions.parse(
        {"path": uri, "checkpointLocation": str(tmp_path / "chk"), "partitionBy": "p"}
    )
    committer = opts.committer()
    opts.record_store().log.create_if_missing()
    values = ["a b", "x/y", "50%", "ü:ñ", None, "k=v"]
    batch = pa.record_batch([pa.array(range(6), pa.int64()), pa.array(values)], schema=schema)
    sid, tok = committer.allocate()
    txns = stage_partition([batch], opts.staging(), sid, tok, 0, schema)
    committer.commit(
        0,
        sid,
        tok,
        txns,
        run_id="r",
        query_id="q",
        target_meta={"arrow_schema": schema_to_b64(schema), "uri": uri, "base_version": None},
    )
    folders = sorted(os.path.dirname(t.handle) for t in txns)
    assert folders == sorted(
        [
            "p=a%20b",
            "p=x%2Fy",
            "p=50%25",
            "p=%C3%BC%3A%C3%B1",
            "p=__HIVE_DEFAULT_PARTITION__",
            "p=k%3Dv",
        ]
    )
    assert all(not t.handle.startswith("txn-staged") for t in txns)
    got = DeltaTable(uri).to_pyarrow_table().sort_by("id")
    assert got.column("p").to_pylist() == values
    # a plain parquet reader with hive partitioning sees the partition column too
    import pyarrow.dataset as ds

    plain = ds.dataset(
        uri,
        format="parquet",
        partitioning="hive",
        exclude_invalid_files=True,
        ignore_prefixes=["_", ".", "txn-staged"],
    ).to_table()
    assert plain.num_rows == 6 and "p" in plain.column_names


def test_the_staging_area_keeps_only_recent_attempts(tmp_path):
    """Markers of attempts whose tasks are long over are forgotten by the periodic sweep;
    committed data stays in the table."""
    uri = str(tmp_path / "table")
    opts = DeltaSinkOptions.parse({"path": uri, "checkpointLocation": str(tmp_path / "chk")})
    committer = opts.committer()
    opts.record_store().log.create_if_missing()
    meta = {"arrow_schema": schema_to_b64(SCHEMA), "uri": uri}
    for b in range(80):
        sid, tok = committer.allocate()
        arrays = [pa.array([b], pa.int64()), pa.array([str(b)])]
        txns = stage_partition(
            [pa.record_batch(arrays, schema=SCHEMA)], opts.staging(), sid, tok, 0, SCHEMA
        )
        base = committer.target.base()
        committer.commit(b, sid, tok, txns, run_id="r", query_id="q", target_meta={**meta, **base})
    attempts = committer.target.staged_attempts()
    assert 0 < len(attempts) <= 2 * 32 + 1
    assert min(sid for sid, _ in attempts) >= 80 - 2 * 32 - 1
    assert sorted(DeltaTable(uri).to_pyarrow_table().column("id").to_pylist()) == list(range(80))


def test_a_created_table_is_nullable_like_sparks_and_empty_partition_strings_are_null(tmp_path):
    """Spark marks derived columns NOT NULL; the table must still take nulls later."""
    uri = str(tmp_path / "table")
    strict = pa.schema(
        [
            pa.field("id", pa.int64(), nullable=False),
            pa.field("p", pa.string()),
            pa.field("st", pa.struct([pa.field("a", pa.int64(), nullable=False)])),
        ]
    )
    opts = DeltaSinkOptions.parse(
        {"path": uri, "checkpointLocation": str(tmp_path / "chk"), "partitionBy": "p"}
    )
    committer = opts.committer()
    opts.record_store().log.create_if_missing()
    meta = {"arrow_schema": schema_to_b64(strict), "uri": uri}
    for b, p in enumerate(["", "x"]):
        arrays = [pa.array([b]), pa.array([p]), pa.array([{"a": b}], strict.field("st").type)]
        sid, tok = committer.allocate()
        opts.target().check_stream_schema(strict, False)  # nested NOT NULL is no drift
        txns = stage_partition(
            [pa.record_batch(arrays, schema=strict)], opts.staging(), sid, tok, 0, strict
        )
        base = committer.target.base()
        committer.commit(b, sid, tok, txns, run_id="r", query_id="q", target_meta={**meta, **base})
    table = DeltaTable(uri)
    assert all(f.nullable for f in table.schema().to_arrow())
    rows = sorted(table.to_pyarrow_table().to_pylist(), key=lambda r: r["id"])
    assert [r["p"] for r in rows] == [None, "x"]


def test_a_failed_spark_write_in_the_attempt_folder_is_found_discarded_and_forgotten(delta):
    """The fast path's layout: Spark writes into ``<attempt folder>/spark/`` and a failed
    job leaves files and empty task folders there. ``staged_attempts`` lists the
    attempt, ``discard`` removes every file, ``forget`` leaves no folder behind."""
    import pathlib

    from pyspark_txn.sinks.staging import snapshot_dir

    target = delta.target
    tok = new_token()
    base = pathlib.Path(delta.uri) / snapshot_dir(SINK, 7, tok)
    (base / "spark" / "_temporary" / "0" / "task_1").mkdir(parents=True)
    (base / "00000-abcdef01-0000.dir").write_text("")
    (base / "spark" / "_temporary" / "0" / "task_1" / "part-00000-x.snappy.parquet").write_bytes(
        b"x"
    )
    (base / "spark" / ".part-00001-y.snappy.parquet.crc").write_bytes(b"c")
    renamed = pathlib.Path(delta.uri) / f"part-{SINK}-{7:012d}-{tok}-00000-abcdef01-0000.parquet"
    renamed.write_bytes(b"p")
    assert (7, tok) in target.staged_attempts()
    target.discard(7, tok)
    left = [p for p in pathlib.Path(delta.uri).rglob("*") if p.is_file()]
    assert left == [base / "00000-abcdef01-0000.dir"]
    target.forget(7, tok)
    assert not base.exists()
    assert (7, tok) not in target.staged_attempts()


def test_the_fast_path_s_own_folder_in_the_table_is_found_whole(delta):
    """The fast path's in-place layout: Spark writes into the attempt's own folder of
    the table, ``part-<sink>-<snapshot>-<token>-00000-<attempt>/``, which its marker
    names. Uncommitted, ``discard`` removes the folder whole (data files in c=v/
    folders, a lost task's file under _temporary/, _SUCCESS); committed, the kept
    files stay and the folder is not even listed; a first attempt's folder is the
    sink's own for the new-table check."""
    import pathlib

    from pyspark_txn.sinks.fast import spark_folder
    from pyspark_txn.sinks.staging import snapshot_dir

    target, root = delta.target, pathlib.Path(delta.uri)
    tok = new_token()
    folder = spark_folder(SINK, 7, tok, "abcdef01")
    base = root / snapshot_dir(SINK, 7, tok)
    base.mkdir(parents=True)
    (base / "00000-abcdef01-0000.dir").write_text(folder)
    out = root / folder
    files = [
        out / "p=va" / "part-00000-x.c000.snappy.parquet",
        out / "p=vb" / "part-00001-y.c000.snappy.parquet",
    ]
    for f in files:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"p")
    task = out / "_temporary" / "0" / "_temporary" / "attempt_1_0001_m_000002_3"
    task.mkdir(parents=True)
    (task / "part-00002-z.c000.snappy.parquet").write_bytes(b"t")
    (out / "_SUCCESS").write_bytes(b"")
    other = root / f"part-{SINK}-{7:012d}-{tok}-00000-abcdef02-0000.parquet"  # not marked
    other.write_bytes(b"o")
    target._check_no_foreign_files()  # the attempt's folder is the sink's own
    kept = [str(f.relative_to(root)) for f in files]
    target.discard(7, tok, keep=kept)  # committed: nothing of it goes
    assert all(f.exists() for f in files) and (out / "_SUCCESS").exists()
    target.discard(7, tok)
    assert not out.exists()
    assert other.exists()  # only what the markers name is the attempt's
    left = sorted(p for p in root.rglob("*") if p.is_file())
    assert left == sorted([base / "00000-abcdef01-0000.dir", other])
    target.forget(7, tok)
    assert not base.exists()


@pytest.mark.parametrize("where", ["proc", "under-a-file"])
def test_an_unwritable_path_or_record_table_is_named(tmp_path, where):
    """Not a bare OSError of a write task, nor delta-rs' TableNotFoundError inside
    Spark's pickling (issue 23 item 13)."""
    from pyspark_txn.state.backends.delta_log import DeltaEventLog

    (tmp_path / "a-file").write_text("x")
    base = "/proc/pyspark-txn-test" if where == "proc" else str(tmp_path / "a-file")
    opts = DeltaSinkOptions.parse(
        {"path": f"{base}/t", "checkpointLocation": str(tmp_path / "c")}
    ).with_checkpoint_sink_id()
    with pytest.raises(ConfigError, match=r"option path='.*/t': cannot create or write"):
        opts.target().check_stream_schema(SCHEMA, False)
    with pytest.raises(ConfigError, match="record table at .* cannot be created"):
        DeltaEventLog(f"{base}/records").create_if_missing()
