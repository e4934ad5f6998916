"""The txn-delta source over a corpus of tables "written by other engines" (tests/corpus).

Each table is streamed through the reader without Spark (initialOffset, latestOffset,
partitions, read) and must equal what deltalake reads from it, as a multiset of rows, with
every batch exactly of the declared Arrow schema; or be refused with a SourceError that
names the reason. Never silently different.
"""

from __future__ import annotations

import datetime as dt
import glob
import json
import math
import os
from collections import Counter
from decimal import Decimal
from urllib.parse import quote

import numpy as np
import pyarrow as pa
import pytest
from corpus import TABLES
from corpus import handmade as hm
from deltalake import DeltaTable, QueryBuilder, WriterProperties, write_deltalake
from pyspark.sql.types import StringType, StructField, StructType

from pyspark_txn.errors import ConfigError, SourceError
from pyspark_txn.sources import _deletion_vectors as deletion_vectors
from pyspark_txn.sources import _partition_values as partition_values
from pyspark_txn.sources import delta as source
from pyspark_txn.sources.delta import DeltaSourceOptions, DeltaStreamReader


def reader(path, **options):
    opts = DeltaSourceOptions.parse({"path": path, **options})
    return DeltaStreamReader(opts, opts.spark_schema_ddl())


def stream(r, start=None):
    """Every row the reader serves from ``start`` until it has nothing new, batch by batch."""
    rows, start = [], start or r.initialOffset()
    while (end := r.latestOffset(start, None)) != start:
        for part in r.partitions(start, end):
            for batch in r.read(part):
                assert batch.schema == r.arrow_schema  # PySpark 4.2+ wants it exactly
                assert batch.schema.metadata == r.arrow_schema.metadata
                rows += batch.to_pylist()
        start = end
    return rows


def rows_between(r, start, end):
    return [x for p in r.partitions(start, end) for b in r.read(p) for x in b.to_pylist()]


def canon(value):
    """A hashable, NaN-equal form of a row value, for multiset comparison."""
    if isinstance(value, float):
        return "NaN" if math.isnan(value) else value
    if isinstance(value, dict):
        return tuple(sorted((k, canon(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(canon(v) for v in value)
    if isinstance(value, tuple):
        return tuple(canon(v) for v in value)
    if isinstance(value, dt.datetime) and value.tzinfo is not None:
        return value.astimezone(dt.timezone.utc)
    if isinstance(value, Decimal):
        return value.normalize() if value.is_finite() else str(value)
    return value


def multiset(rows):
    return Counter(canon(row) for row in rows)


def deltalake_rows(path, oracle):
    table = DeltaTable(path)
    if oracle == "pyarrow":
        return table.to_pyarrow_table().to_pylist()
    data = QueryBuilder().register("t", table).execute("select * from t").read_all()
    return pa.table(data).to_pylist()


@pytest.fixture(params=sorted(TABLES))
def corpus(request, tmp_path):
    path = str(tmp_path / request.param)
    return TABLES[request.param](path)


def test_corpus_snapshot(corpus):
    """The default (snapshot, then appends) read of every table: its content, or a refusal."""
    if corpus.refuse:
        with pytest.raises(SourceError, match=corpus.refuse):
            stream(reader(corpus.path, maxFilesPerBatch="2"))
        return
    got = multiset(stream(reader(corpus.path, maxFilesPerBatch="2")))
    if corpus.rows is not None:
        assert got == multiset(corpus.rows)
    if corpus.oracle:
        assert got == multiset(deltalake_rows(corpus.path, corpus.oracle))


def test_corpus_appends_from_version_zero(corpus):
    """startingVersion=0 reads the history commit by commit (partition values parsed from the
    log's strings): an append-only history gives the same rows as the snapshot."""
    if isinstance(corpus.from_zero, str):
        with pytest.raises(SourceError, match=corpus.from_zero):
            stream(reader(corpus.path, startingVersion="0", maxFilesPerBatch="3"))
        return
    got = multiset(stream(reader(corpus.path, startingVersion="0", maxFilesPerBatch="3")))
    assert got == multiset(stream(reader(corpus.path)))


def test_corpus_replay_is_exact(corpus):
    """A fresh reader (a restarted query) serves the same rows for the same offsets."""
    if corpus.refuse:
        pytest.skip("refused")
    first = reader(corpus.path, maxFilesPerBatch="1")
    start = first.initialOffset()
    batches = []
    while (end := first.latestOffset(start, None)) != start:
        batches.append((start, end))
        start = end
    again = reader(corpus.path, maxFilesPerBatch="1")
    for start, end in batches:
        a = [b.to_pylist() for p in first.partitions(start, end) for b in first.read(p)]
        b = [b.to_pylist() for p in again.partitions(start, end) for b in again.read(p)]
        assert [canon(r) for x in a for r in x] == [canon(r) for x in b for r in x]


# --- what the corpus tables show one by one ----------------------------------------------


def test_deleted_commit_streams_with_ignore_changes(tmp_path):
    t = TABLES["deleted"](str(tmp_path / "t"))
    rows = stream(reader(t.path, startingVersion="0", ignoreChanges="true"))
    # everything once, then the rewritten files' surviving rows again (Delta's ignoreChanges)
    ids = Counter(r["id"] for r in rows)
    again = set(range(0, 5)) | set(range(15, 20))
    assert ids == Counter({i: 2 if i in again else 1 for i in range(30)})


def test_deletion_vectors_with_ignore_changes_read_the_new_vector(tmp_path):
    t = TABLES["deletion_vectors"](str(tmp_path / "t"))
    rows = stream(reader(t.path, startingVersion="0", ignoreChanges="true"))
    ids = Counter(r["id"] for r in rows)
    # first the files whole, then again without their deleted rows
    assert ids[0] == 1 and ids[1] == 2 and ids[110] == 1 and ids[5100] == 2


def test_schema_change_stops_the_stream_at_that_version(tmp_path):
    path = str(tmp_path / "t")
    write_deltalake(path, pa.table({"id": pa.array([1, 2], pa.int64())}))
    r = reader(path)
    start = r.initialOffset()
    end = r.latestOffset(start, None)
    assert [x["id"] for x in rows_between(r, start, end)] == [1, 2]
    write_deltalake(path, pa.table({"id": pa.array([3], pa.int64())}), mode="append")
    t = pa.table({"id": pa.array([4], pa.int64()), "extra": ["e"]})
    write_deltalake(path, t, mode="append", schema_mode="merge")
    # the append before the change is served, then the stream stops at the change
    nxt = r.latestOffset(end, None)
    table_id = str(DeltaTable(path).metadata().id)
    assert nxt == {"index": 0, "snapshot": False, "version": 2, "tableId": table_id}
    with pytest.raises(SourceError, match="'extra' is not in the stream's schema.*Restart"):
        r.latestOffset(nxt, None)
    # a restarted query (new schema) goes on from the same offset
    again = reader(path)
    last = {"index": 0, "snapshot": False, "version": 3, "tableId": table_id}
    assert rows_between(again, nxt, last) == [{"id": 4, "extra": "e"}]
    assert rows_between(again, end, nxt) == [{"id": 3, "extra": None}]


def test_column_mapping_rename_stops_a_running_stream(tmp_path):
    path = str(tmp_path / "t")
    write_deltalake(
        path,
        pa.table({"id": pa.array([1], pa.int64())}),
        configuration={"delta.columnMapping.mode": "name"},
    )
    r = reader(path)
    start = r.initialOffset()
    end = r.latestOffset(start, None)
    meta = hm.current_metadata(path)
    schema = json.loads(meta["schemaString"])
    schema["fields"][0]["name"] = "renamed"
    hm.commit(path, [{"metaData": {**meta, "schemaString": json.dumps(schema)}}])
    write_deltalake(path, pa.table({"renamed": pa.array([2], pa.int64())}), mode="append")
    with pytest.raises(SourceError, match="'renamed' is not in the stream's schema"):
        r.latestOffset(end, None)
    assert sorted(x["renamed"] for x in stream(reader(path))) == [1, 2]


def test_restart_after_rename_replays_a_snapshot_offset(tmp_path):
    """A query that planned a snapshot batch before a rename and restarts after it (new
    schema) reads that batch's partition and data values under the new names."""
    path = str(tmp_path / "t")
    t = pa.table({"id": pa.array([1, 2], pa.int64()), "p": ["x", "y"]})
    write_deltalake(path, t, partition_by=["p"], configuration={"delta.columnMapping.mode": "name"})
    before = reader(path)
    start = before.initialOffset()
    end = before.latestOffset(start, None)
    meta = hm.current_metadata(path)
    schema = json.loads(meta["schemaString"])
    for f in schema["fields"]:
        f["name"] = {"id": "key", "p": "part"}[f["name"]]
    hm.commit(
        path,
        [{"metaData": {**meta, "schemaString": json.dumps(schema), "partitionColumns": ["part"]}}],
    )
    after = reader(path)
    assert sorted(rows_between(after, start, end), key=str) == [
        {"key": 1, "part": "x"},
        {"key": 2, "part": "y"},
    ]


def test_schema_merged_old_reader_refuses_new_column(tmp_path):
    path = str(tmp_path / "t")
    write_deltalake(path, pa.table({"id": pa.array([1], pa.int64())}))
    old = reader(path, startingVersion="0")
    write_deltalake(
        path,
        pa.table({"id": pa.array([2], pa.int64()), "x": [1.5]}),
        mode="append",
        schema_mode="merge",
    )
    with pytest.raises(SourceError, match="'x'"):
        stream(old)


def test_large_file_is_read_in_bounded_batches(tmp_path, monkeypatch):
    path = str(tmp_path / "t")
    n = 50_000
    write_deltalake(
        path,
        pa.table({"id": pa.array(range(n), pa.int64()), "s": pa.array(["x" * 20] * n)}),
        writer_properties=WriterProperties(max_row_group_size=8192),
    )
    monkeypatch.setattr(source, "READ_BATCH_ROWS", 4096)
    r = reader(path)
    start = r.initialOffset()
    end = r.latestOffset(start, None)
    (part,) = r.partitions(start, end)
    sizes = [b.num_rows for b in r.read(part)]
    assert max(sizes) <= 4096 and sum(sizes) == n and len(sizes) >= n // 4096


def test_a_projected_schema_reads_only_its_columns(tmp_path):
    t = TABLES["partitioned_by_types"](str(tmp_path / "t"))
    opts = DeltaSourceOptions.parse({"path": t.path})
    only_s = StructType([StructField("s", StringType())])
    rows = stream(DeltaStreamReader(opts, only_s))
    assert multiset(rows) == multiset({"s": r["s"]} for r in t.rows)
    with pytest.raises(SourceError, match="'nope' of the stream's schema is not in"):
        DeltaStreamReader(opts, StructType([StructField("nope", StringType())]))


def test_bad_storage_options_are_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="storageOptions is not valid JSON"):
        DeltaSourceOptions.parse({"path": str(tmp_path), "storageOptions": "{not json"})
    with pytest.raises(ConfigError, match="JSON object of string values"):
        DeltaSourceOptions.parse({"path": str(tmp_path), "storageOptions": '["a"]'})
    with pytest.raises(ConfigError, match="unknown key 'a'"):
        DeltaSourceOptions.parse({"path": str(tmp_path), "storageOptions": '{"a": "b"}'})
    ok = DeltaSourceOptions.parse({"path": str(tmp_path), "storageOptions": '{"AWS_REGION": "b"}'})
    assert ok.storage_options == (("AWS_REGION", "b"),)


def test_missing_table_is_a_source_error(tmp_path):
    with pytest.raises(SourceError, match="cannot open the Delta table"):
        DeltaSourceOptions.parse({"path": str(tmp_path / "nothing")}).spark_schema_ddl()


def test_a_folder_that_is_not_a_delta_table_is_named_so(tmp_path):
    (tmp_path / "data.parquet").write_bytes(b"x")
    with pytest.raises(SourceError, match=r"path='.*' is not a Delta table \(no commits") as e:
        DeltaSourceOptions.parse({"path": str(tmp_path)}).spark_schema_ddl()
    assert str(e.value).index("not a Delta table") < str(e.value).index("No files in log")


def test_snapshot_offset_of_a_cleaned_version_is_a_clear_error(tmp_path):
    t = TABLES["appends_basic"](str(tmp_path / "t"))
    r = reader(t.path)
    start = {"index": 0, "snapshot": True, "version": 0}
    DeltaTable(t.path).create_checkpoint()
    os.remove(os.path.join(t.path, "_delta_log", f"{0:020d}.json"))
    with pytest.raises(SourceError, match="version 0"):
        r.latestOffset(start, None)


# --- the deletion vector codec against the spec's and deltalake's readings ---------------


@pytest.mark.parametrize(
    "rows",
    [
        [],
        [0],
        [3, 4, 7, 11, 18, 29],
        list(range(0, 10000, 2)),  # a bitmap container
        list(range(100, 70000)),  # runs over several containers
        [1, 2**32 + 5, 2**33],  # several 64-bit buckets
    ],
)
@pytest.mark.parametrize("runs", [False, True])
def test_deletion_vector_round_trip(rows, runs):
    data = hm.roaring_bitmap_array(rows, runs=runs)
    assert deletion_vectors.decode_deletion_vector(data).tolist() == sorted(set(rows))
    dv = hm.inline_dv(rows, runs=runs)
    if rows:
        assert deletion_vectors.load_deletion_vector("/nowhere", dv).tolist() == sorted(set(rows))


def test_deletion_vector_file_checksum_is_checked(tmp_path):
    path = str(tmp_path)
    (dv,) = hm.dv_file(path, [[1, 2, 3]])
    assert deletion_vectors.load_deletion_vector(path, dv).tolist() == [1, 2, 3]
    with pytest.raises(SourceError, match="holds 3 rows"):
        deletion_vectors.load_deletion_vector(path, {**dv, "cardinality": 4})
    (f,) = glob.glob(f"{path}/deletion_vector_*.bin")
    absolute = {**dv, "storageType": "p", "pathOrInlineDv": "file://" + quote(f)}
    assert deletion_vectors.load_deletion_vector("/elsewhere", absolute).tolist() == [1, 2, 3]
    raw = bytearray(open(f, "rb").read())
    raw[-5] ^= 0xFF
    open(f, "wb").write(bytes(raw))
    with pytest.raises(SourceError, match="checksum"):
        deletion_vectors.load_deletion_vector(path, dv)


def test_deletion_vectors_agree_with_deltalake(tmp_path):
    """Our decoding of every DV of a table = deltalake's selection vectors."""
    t = TABLES["deletion_vectors_checkpointed"](str(tmp_path / "t"))
    theirs = pa.table(DeltaTable(t.path).deletion_vectors()).to_pylist()
    r = reader(t.path)
    files = r._change_set(r.initialOffset()["version"], True).files
    by_uri = {f.uri: f for f in files}
    assert len(theirs) == 2
    for entry in theirs:
        f = by_uri[entry["filepath"].removeprefix("file://")]
        ours = deletion_vectors.load_deletion_vector(t.path, dict(f.deletion_vector)).tolist()
        assert ours == np.flatnonzero(~np.array(entry["selection_vector"])).tolist()


# --- partition values --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "typ", "value"),
    [
        ("", "string", None),
        ("", "integer", None),
        (None, "date", None),
        ("ü/ x", "string", "ü/ x"),
        ("-5", "byte", -5),
        ("Infinity", "double", math.inf),
        ("-Infinity", "float", -math.inf),
        ("true", "boolean", True),
        ("FALSE", "boolean", False),
        ("2021-3-4", "date", dt.date(2021, 3, 4)),
        ("-1.50", "decimal(10,2)", Decimal("-1.50")),
        ("2021-01-01 00:00:00", "timestamp", dt.datetime(2021, 1, 1, tzinfo=dt.timezone.utc)),
        (
            "2021-01-01T01:00:00.5+01:00",
            "timestamp",
            dt.datetime(2021, 1, 1, 0, 0, 0, 500000, tzinfo=dt.timezone.utc),
        ),
        ("2021-01-01 00:00:00.000001", "timestamp_ntz", dt.datetime(2021, 1, 1, 0, 0, 0, 1)),
        ("\u0001\u0002", "binary", b"\x01\x02"),
    ],
)
def test_partition_value_parsing(raw, typ, value):
    got = partition_values.parse_partition_value(raw, typ)
    assert got == value and type(got) is type(value)


def test_bad_partition_value_is_a_source_error():
    with pytest.raises(SourceError, match="not a valid boolean"):
        partition_values.parse_partition_value("yes", "boolean")


def test_offsets_name_their_table_and_another_table_is_refused(tmp_path):
    """An offset is a version *of one table* (Delta's reservoirId): a checkpoint started
    on another table at the same or another path is refused, naming both ids; offsets
    written before ids were (no tableId) are still read."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for path, first in ((a, 1), (b, 100)):
        write_deltalake(path, pa.table({"id": pa.array([first, first + 1], pa.int64())}))
        write_deltalake(path, pa.table({"id": pa.array([first + 2], pa.int64())}), mode="append")
    ra, rb = reader(a), reader(b)
    id_a, id_b = (str(DeltaTable(p).metadata().id) for p in (a, b))
    start = ra.initialOffset()
    assert start["tableId"] == id_a
    end = ra.latestOffset(start, None)
    assert end["tableId"] == id_a
    # b's reader given a's offsets: refused in planning and in partitions, naming both
    for call in (lambda: rb.latestOffset(end, None), lambda: rb.partitions(start, end)):
        with pytest.raises(SourceError, match=f"{id_a}.*path=.*{id_b}"):
            call()
    # a legacy offset (no tableId) reads as before, and the next offset carries the id
    legacy = {"index": 0, "snapshot": False, "version": 1}
    nxt = rb.latestOffset(legacy, None)
    assert nxt == {"index": 0, "snapshot": False, "version": 2, "tableId": id_b}
    assert [r["id"] for r in rows_between(rb, legacy, nxt)] == [102]
    # a table re-created at a's path is another table
    import shutil

    shutil.rmtree(a)
    write_deltalake(a, pa.table({"id": pa.array([7, 8, 9, 10], pa.int64())}))
    with pytest.raises(SourceError, match="another table's versions"):
        ra.latestOffset(end, None)
