"""The txn-delta source reader over real Delta tables, driven directly (no Spark query)."""

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from pyspark_txn.errors import ConfigError, SourceError
from pyspark_txn.sources.delta import DeltaSourceOptions, DeltaStreamReader


def append(path, lo, hi):
    write_deltalake(path, pa.table({"id": pa.array(range(lo, hi), pa.int64())}), mode="append")


def reader(path, **options):
    opts = DeltaSourceOptions.parse({"path": path, **options})
    return DeltaStreamReader(opts, opts.spark_schema_ddl())


def rows(r, start, end):
    out = []
    for part in r.partitions(start, end):
        for batch in r.read(part):
            out += batch.column("id").to_pylist()
    return out


def drain(r):
    """All micro-batches until no new offset: list of (start, end, ids)."""
    batches, start = [], r.initialOffset()
    while True:
        end = r.latestOffset(start, None)
        if end == start:
            return batches
        batches.append((start, end, rows(r, start, end)))
        start = end


@pytest.fixture
def table(tmp_path):
    path = str(tmp_path / "src")
    for k in range(3):
        append(path, k * 10, k * 10 + 10)
    return path


def test_snapshot_then_appends_each_row_once(table):
    r = reader(table, maxFilesPerBatch="2")
    first = drain(r)
    assert [len(ids) for *_, ids in first] == [20, 10]
    append(table, 30, 35)
    start = first[-1][1]
    end = r.latestOffset(start, None)
    assert rows(r, start, end) == list(range(30, 35))
    assert sorted(i for *_, ids in first for i in ids) == list(range(30))


def test_same_offsets_same_rows_after_compaction(table):
    r = reader(table, maxFilesPerBatch="1")
    batches = drain(r)
    DeltaTable(table).optimize.compact()
    append(table, 30, 40)
    replay = reader(table, maxFilesPerBatch="1")
    for start, end, ids in batches:
        assert rows(replay, start, end) == ids
    # the compaction (dataChange=false) adds no rows to the stream
    tail = drain_from(replay, batches[-1][1])
    assert sorted(i for ids in tail for i in ids) == list(range(30, 40))


def drain_from(r, start):
    out = []
    while (end := r.latestOffset(start, None)) != start:
        out.append(rows(r, start, end))
        start = end
    return out


def test_starting_version_latest_and_number(table):
    assert drain(reader(table, startingVersion="latest")) == []
    got = drain(reader(table, startingVersion="1"))
    assert sorted(i for *_, ids in got for i in ids) == list(range(10, 30))


def test_non_append_commit_is_refused_unless_ignored(table):
    r = reader(table, startingVersion="0")
    DeltaTable(table).delete("id < 5")
    with pytest.raises(SourceError, match="ignoreChanges"):
        drain(r)
    ok = drain(reader(table, startingVersion="0", ignoreChanges="true"))
    assert len([i for *_, ids in ok for i in ids]) >= 30


def test_cleaned_up_log_is_a_clear_error(table, tmp_path):
    import os

    DeltaTable(table).create_checkpoint()  # as log retention does: checkpoint, then drop old
    for version in (0, 1):
        os.remove(os.path.join(table, "_delta_log", f"{version:020d}.json"))
    with pytest.raises(SourceError, match="no longer in the Delta log"):
        drain(reader(table, startingVersion="1"))


def test_a_data_file_vacuumed_before_its_batch_is_read_is_a_clear_error(table):
    """A replay (or a lagging reader) names files VACUUM has since removed: the read
    says which file, of which table, why, and what to do, not a bare FileNotFoundError."""
    r = reader(table, maxFilesPerBatch="1")
    start = r.initialOffset()
    end = r.latestOffset(start, None)
    dt = DeltaTable(table)
    dt.optimize.compact()
    dt.vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)
    with pytest.raises(SourceError, match=r"is gone \(VACUUM.*startingVersion"):
        rows(r, start, end)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"bogus": "x"}, "unknown option"),
        ({"startingVersion": "yesterday"}, "startingVersion"),
        ({"maxFilesPerBatch": "0"}, "maxFilesPerBatch"),
        ({"ignoreChanges": "perhaps"}, "ignoreChanges"),
    ],
)
def test_bad_options(table, options, message):
    with pytest.raises(ConfigError, match=message):
        DeltaSourceOptions.parse({"path": table, **options})
    with pytest.raises(ConfigError, match="path"):
        DeltaSourceOptions.parse({})


def test_timestamp_columns_and_partitioned_snapshot(tmp_path):
    """Issue "Real data" 1 and 5: a TIMESTAMP column crashed the reader, and the default
    snapshot mode could not read a partitioned table (partition values are not in files)."""
    import datetime as dt

    path = str(tmp_path / "t")
    ts = dt.datetime(2021, 1, 1, 1, 2, 3, 456789, tzinfo=dt.timezone.utc)
    t = pa.table(
        {
            "id": pa.array([1, 2], pa.int64()),
            "ts": pa.array([ts, None], pa.timestamp("us", tz="UTC")),
            "p": ["x", None],
        }
    )
    write_deltalake(path, t, partition_by=["p"])
    r = reader(path)
    start = r.initialOffset()
    end = r.latestOffset(start, None)
    got = [row for part in r.partitions(start, end) for b in r.read(part) for row in b.to_pylist()]
    assert sorted(got, key=lambda row: row["id"]) == t.to_pylist()


def test_commit_forgets_file_lists_before_the_committed_offset(table):
    r = reader(table, startingVersion="0", maxFilesPerBatch="1")
    batches = drain(r)
    assert len(r._changes) == 3
    r.commit(batches[1][1])
    assert sorted(r._changes) == [(2, False)]


def test_a_starting_version_beyond_the_table_is_refused(tmp_path):
    import pyarrow as pa
    from deltalake import write_deltalake

    from pyspark_txn.errors import SourceError
    from pyspark_txn.sources.delta import DeltaSourceOptions, DeltaStreamReader

    uri = str(tmp_path / "t")
    write_deltalake(uri, pa.table({"id": [1]}))
    opts = DeltaSourceOptions.parse({"path": uri, "startingVersion": "99"})
    reader = DeltaStreamReader(opts, opts.spark_schema_ddl())
    with pytest.raises(SourceError, match="startingVersion=99.*at version 0"):
        reader.initialOffset()


def test_a_first_batch_re_planned_after_a_restart_starts_where_its_end_says(tmp_path):
    """Trial of issue 35, finding 3: killed in its first batch while the table moved on,
    the query re-plans batch 0 with initialOffset() asked again (the table's version now)
    and the batch's logged end: start past end, refused on every restart for good."""
    import pyarrow as pa
    from deltalake import write_deltalake

    from pyspark_txn.sources.delta import DeltaSourceOptions, DeltaStreamReader

    path = str(tmp_path / "t")
    for v in range(4):
        write_deltalake(path, pa.table({"id": pa.array([v], pa.int64())}), mode="append")

    def reader(**options):
        opts = DeltaSourceOptions.parse({"path": path, **options})
        return DeltaStreamReader(opts, opts.spark_schema_ddl())

    def ids(r, start, end):
        return sorted(
            i
            for p in r.partitions(start, end)
            for b in r.read(p)
            for i in b.column("id").to_pylist()
        )

    first = reader(maxFilesPerBatch="2")
    start = first.initialOffset()
    inside = first.latestOffset(start, None)  # inside the snapshot of version 3
    assert inside["snapshot"] and inside["index"] == 2
    whole = reader()
    whole_start = whole.initialOffset()
    past = whole.latestOffset(whole_start, None)  # the whole snapshot
    write_deltalake(path, pa.table({"id": pa.array([4], pa.int64())}), mode="append")
    # the restart: a new reader, its initial offset is version 4's snapshot
    for end, expected in ((inside, ids(first, start, inside)), (past, [0, 1, 2, 3])):
        again = reader(maxFilesPerBatch="2")
        restarted = again.initialOffset()
        assert restarted["version"] == 4
        assert ids(again, restarted, end) == expected
