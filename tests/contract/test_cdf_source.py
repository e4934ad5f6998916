"""The txn-delta source's change data feed (``readChangeFeed=true``) and ``skipChangeCommits``,
driven without Spark (initialOffset, latestOffset, partitions, read).

The oracle is delta-rs's ``load_cdf`` over the same versions: tables written here with
delta-rs (appends, MERGE, UPDATE, DELETE, overwrite, OPTIMIZE; partitioned and not) and
delta-rs's own test tables with change data (tests/corpus/delta-rs, written by Delta Spark)
must give the same rows, row for row. Where ``load_cdf`` cannot read a table
(``checkpoint-cdf-table`` from version 0: its first commits were cleaned up), the rows come
from the files the log names.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from corpus import handmade as hm
from deltalake import DeltaTable, write_deltalake

from pyspark_txn.errors import ConfigError, SourceError
from pyspark_txn.sources.delta import DeltaSourceOptions, DeltaStreamReader

CORPUS = Path(__file__).resolve().parents[1] / "corpus" / "delta-rs"
CDF = {"delta.enableChangeDataFeed": "true"}
UTC = dt.timezone.utc


def reader(path, **options):
    opts = DeltaSourceOptions.parse({"path": str(path), **options})
    return DeltaStreamReader(opts, opts.spark_schema_ddl())


def batches(r, start=None):
    """(start, end, rows) of every micro-batch the reader plans until nothing is new."""
    out, start = [], start or r.initialOffset()
    while (end := r.latestOffset(start, None)) != start:
        rows = []
        for part in r.partitions(start, end):
            for batch in r.read(part):
                assert batch.schema == r.arrow_schema
                rows += batch.to_pylist()
        out.append((start, end, rows))
        start = end
    return out


def stream(r, start=None):
    return [row for *_, rows in batches(r, start) for row in rows]


def rows_between(r, start, end):
    return [x for p in r.partitions(start, end) for b in r.read(p) for x in b.to_pylist()]


def canon(row: dict) -> tuple:
    """A row as a sorted, hashable tuple; ``_commit_timestamp`` as naive UTC (load_cdf's
    ``timestamp[ms]`` has no zone, ours is Spark's UTC instant)."""
    out = []
    for k, v in row.items():
        if isinstance(v, dt.datetime) and v.tzinfo is not None:
            v = v.astimezone(UTC).replace(tzinfo=None)
        out.append((k, v))
    return tuple(sorted(out))


def rows_of(rows) -> list[tuple]:
    return sorted((canon(r) for r in rows), key=repr)


def load_cdf(path, start=0, end=None) -> list[tuple]:
    """delta-rs's change feed, string_view cast to string (DESIGN.md), as sorted rows."""
    data = pa.table(
        DeltaTable(str(path)).load_cdf(starting_version=start, ending_version=end).read_all()
    )
    schema = pa.schema(
        [f.with_type(pa.string()) if pa.types.is_string_view(f.type) else f for f in data.schema]
    )
    return rows_of(data.cast(schema).to_pylist())


def versions_of(rows) -> set[int]:
    return {r["_commit_version"] for r in rows}


def log(path, version):
    return hm.log_actions(str(path), version)


# --- tables written here with delta-rs ---------------------------------------------------


def _t(ids, part=None, value=None):
    ids = list(ids)
    cols = {
        "id": pa.array(ids, pa.int64()),
        "name": pa.array([f"n{i}" for i in ids], pa.string()),
        "value": pa.array([value if value is not None else i * 10 for i in ids], pa.int64()),
    }
    if part is not None:
        cols["p"] = pa.array([part(i) for i in ids], pa.string())
    return pa.table(cols)


def history(path, partitioned: bool) -> str:
    """A CDF table's life: appends, UPDATE, MERGE (update, insert, delete), DELETE of some
    rows and (partitioned) of a whole partition, OPTIMIZE, an overwrite, more appends."""
    path = str(path)
    part = (lambda i: "even" if i % 2 == 0 else "odd") if partitioned else None
    by = ["p"] if partitioned else None
    write_deltalake(path, _t(range(0, 10), part), partition_by=by, configuration=CDF)  # v0
    write_deltalake(path, _t(range(10, 20), part), mode="append")  # v1
    DeltaTable(path).update(updates={"value": "value + 1"}, predicate="id < 3")  # v2
    src = pa.table(
        {
            "id": pa.array([3, 4, 30, 31], pa.int64()),
            "name": ["m3", "m4", "m30", "m31"],
            "value": pa.array([-3, -4, 300, 310], pa.int64()),
            "gone": [False, True, False, False],
        }
    )
    if partitioned:
        src = src.append_column("p", pa.array([part(i) for i in (3, 4, 30, 31)]))
    (
        DeltaTable(path)
        .merge(src, "t.id = s.id", source_alias="s", target_alias="t")
        .when_matched_delete("s.gone")
        .when_matched_update_all()
        .when_not_matched_insert_all()
        .execute()
    )  # v3 (MERGE: update, delete, inserts)
    DeltaTable(path).delete("id >= 15 AND id < 18")  # v4
    if partitioned:
        DeltaTable(path).delete("p = 'odd'")  # v5: whole files, no cdc files (removes only)
    else:
        DeltaTable(path).delete("id = 19")
    write_deltalake(path, _t(range(40, 45), part), mode="append")  # v6
    DeltaTable(path).optimize.compact()  # v7: dataChange=false, no rows
    write_deltalake(path, _t(range(50, 53), part), mode="append")  # v8
    return path


@pytest.fixture(params=[False, True], ids=["flat", "partitioned"])
def table(request, tmp_path):
    return history(tmp_path / "t", request.param)


def test_history_equals_load_cdf(table):
    got = stream(reader(table, readChangeFeed="true", startingVersion="0"))
    expected = load_cdf(table)
    assert rows_of(got) == expected
    kinds = Counter(r["_change_type"] for r in got)
    assert set(kinds) == {"insert", "delete", "update_preimage", "update_postimage"}
    assert 7 not in versions_of(got)  # the OPTIMIZE adds nothing


def test_from_a_version_equals_load_cdf_from_it(table):
    for start in (3, 5, 8):
        got = stream(reader(table, readChangeFeed="true", startingVersion=str(start)))
        assert rows_of(got) == load_cdf(table, start), start


def test_columns_and_types_are_delta_sparks(table):
    r = reader(table, readChangeFeed="true", startingVersion="0")
    schema = r.arrow_schema
    assert schema.names[-3:] == ["_change_type", "_commit_version", "_commit_timestamp"]
    assert schema.field("_change_type").type == pa.string()
    assert schema.field("_commit_version").type == pa.int64()
    ts = schema.field("_commit_timestamp").type
    assert pa.types.is_timestamp(ts) and ts.tz is not None and ts.unit == "us"
    ddl = DeltaSourceOptions.parse({"path": table, "readChangeFeed": "true"}).spark_schema_ddl()
    assert ddl.simpleString().endswith(
        "_change_type:string,_commit_version:bigint,_commit_timestamp:timestamp>"
    )


def test_commit_timestamp_is_the_commit_infos(table):
    """_commit_timestamp: the commitInfo's inCommitTimestamp, else its timestamp, as
    load_cdf (checked on a table with in-commit timestamps below)."""
    got = stream(reader(table, readChangeFeed="true", startingVersion="0"))
    for row in got:
        info = next(
            a["commitInfo"] for a in log(table, row["_commit_version"]) if "commitInfo" in a
        )
        assert row["_commit_timestamp"] == dt.datetime.fromtimestamp(info["timestamp"] / 1000, UTC)


def test_default_start_is_the_snapshot_as_inserts_then_the_changes(table):
    """Without startingVersion (as Delta's Spark source): the table's rows at the start
    version as inserts of that version, then the changes after it."""
    r = reader(table, readChangeFeed="true")
    version = DeltaTable(table).version()
    first = batches(r)
    got = [row for *_, rows in first for row in rows]
    assert versions_of(got) == {version} and {x["_change_type"] for x in got} == {"insert"}
    data = [{k: v for k, v in x.items() if not k.startswith("_")} for x in got]
    assert rows_of(data) == rows_of(DeltaTable(table).to_pyarrow_table().to_pylist())
    DeltaTable(table).update(updates={"value": "0"}, predicate="id = 50")
    DeltaTable(table).delete("id = 51")
    assert rows_of(stream(r, first[-1][1])) == load_cdf(table, version + 1)


def test_starting_version_latest_reads_only_new_changes(table):
    r = reader(table, readChangeFeed="true", startingVersion="latest")
    start = r.initialOffset()
    assert r.latestOffset(start, None) == start
    DeltaTable(table).delete("id = 50")
    version = DeltaTable(table).version()
    assert rows_of(stream(r, start)) == load_cdf(table, version)


def test_replay_of_the_same_offsets_gives_the_same_rows(table):
    first = batches(reader(table, readChangeFeed="true", startingVersion="0", maxFilesPerBatch="1"))
    assert len(first) > 5
    again = reader(table, readChangeFeed="true", startingVersion="0", maxFilesPerBatch="1")
    for start, end, rows in first:
        assert rows_between(again, start, end) == rows
    # and after the table moved on (a compaction, more changes), still the same
    DeltaTable(table).optimize.compact()
    DeltaTable(table).delete("id = 51")
    later = reader(table, readChangeFeed="true", startingVersion="0", maxFilesPerBatch="1")
    for start, end, rows in reversed(first):
        assert rows_between(later, start, end) == rows


@pytest.mark.parametrize("limit", [{"maxFilesPerBatch": "1"}, {"maxFilesPerBatch": "3"}])
def test_max_files_per_batch_batches_add_up_to_the_whole(table, limit):
    r = reader(table, readChangeFeed="true", startingVersion="0", **limit)
    planned = batches(r)
    n = int(limit["maxFilesPerBatch"])
    for start, end, _rows in planned:
        assert 1 <= len(r.partitions(start, end)) <= n
    assert rows_of(row for *_, rows in planned for row in rows) == load_cdf(table)


def _file_sizes(r, start, end):
    return [f.size for p in r.partitions(start, end) for f in p.files]


@pytest.mark.parametrize("cdf", [True, False], ids=["changeFeed", "appends"])
def test_max_bytes_per_batch_is_a_soft_limit(tmp_path, cdf):
    """As Delta's: files are admitted while the batch holds fewer bytes than the limit, so
    a batch exceeds it by at most its last file, and always holds at least one file."""
    path = str(tmp_path / "t")
    write_deltalake(path, _t(range(0, 5)), configuration=CDF)
    for k in range(1, 12):
        write_deltalake(path, _t(range(k * 100, k * 100 + 5 * k)), mode="append")
    if cdf:
        DeltaTable(path).delete("id % 3 = 0")
    options = {"startingVersion": "0"} | ({"readChangeFeed": "true"} if cdf else {})
    whole = stream(reader(path, **options))
    sizes = [a["add"]["size"] for a in log(path, 3) if "add" in a]
    limit = sizes[0] * 2 + 1
    r = reader(path, maxBytesPerBatch=str(limit), **options)
    planned = batches(r)
    assert len(planned) > 3
    for start, end, _rows in planned:
        got = _file_sizes(r, start, end)
        assert got and (sum(got[:-1]) < limit)
    assert rows_of(row for *_, rows in planned for row in rows) == rows_of(whole)
    # one byte: one file per batch
    one = reader(path, maxBytesPerBatch="1", **options)
    assert all(len(_file_sizes(one, s, e)) == 1 for s, e, _ in batches(one))
    # with both limits, the tighter one wins
    both = reader(path, maxBytesPerBatch="1g", maxFilesPerBatch="2", **options)
    assert all(len(_file_sizes(both, s, e)) <= 2 for s, e, _ in batches(both))


def test_an_append_only_cdf_history_is_inserts_from_the_add_actions(tmp_path):
    path = str(tmp_path / "t")
    write_deltalake(path, _t(range(3)), configuration=CDF)
    write_deltalake(path, _t(range(3, 5)), mode="append")
    got = stream(reader(path, readChangeFeed="true", startingVersion="0"))
    assert rows_of(got) == load_cdf(path)
    assert [r["_change_type"] for r in got] == ["insert"] * 5


# --- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"readChangeFeed": "yes"}, r"readChangeFeed='yes': expected true or false"),
        ({"skipChangeCommits": "1"}, r"skipChangeCommits='1': expected true or false"),
        (
            {"readChangeFeed": "true", "ignoreChanges": "true"},
            r"readChangeFeed=true and ignoreChanges=true exclude each other",
        ),
        (
            {"ignoreChanges": "true", "skipChangeCommits": "true"},
            r"ignoreChanges=true and skipChangeCommits=true exclude each other",
        ),
        (
            {"readChangeFeed": "true", "skipChangeCommits": "true"},
            r"readChangeFeed=true and skipChangeCommits=true exclude each other",
        ),
        ({"maxBytesPerBatch": "0"}, r"maxBytesPerBatch='0': expected a size"),
        ({"maxBytesPerBatch": "lots"}, r"maxBytesPerBatch='lots': expected a size"),
        ({"maxBytesPerBatch": "-1k"}, r"maxBytesPerBatch='-1k': expected a size"),
    ],
)
def test_bad_option_combinations_are_config_errors(tmp_path, options, message):
    with pytest.raises(ConfigError, match=message):
        DeltaSourceOptions.parse({"path": str(tmp_path), **options})


@pytest.mark.parametrize(
    ("raw", "size"),
    [
        ("1", 1),
        ("2048", 2048),
        ("4k", 4096),
        ("1kb", 1024),
        ("3m", 3 << 20),
        ("1G", 1 << 30),
        ("2g", 2 << 30),
    ],
)
def test_max_bytes_per_batch_takes_sizes(tmp_path, raw, size):
    assert (
        DeltaSourceOptions.parse(
            {"path": str(tmp_path), "maxBytesPerBatch": raw}
        ).max_bytes_per_batch
        == size
    )


def test_a_table_without_change_data_is_refused_before_any_data_is_read(tmp_path):
    path = str(tmp_path / "plain")
    write_deltalake(path, _t(range(3)))
    write_deltalake(path, _t(range(3, 5)), mode="append")
    for start in ("snapshot", "0", "latest"):
        r = reader(path, readChangeFeed="true", startingVersion=start)
        with pytest.raises(ConfigError) as e:
            r.initialOffset()
        message = str(e.value)
        assert path in message and "delta.enableChangeDataFeed" in message
        assert "\n" not in message
    # a table that enables it later: from that version on is fine, before it is refused
    DeltaTable(path).alter.set_table_properties(CDF)
    write_deltalake(path, _t(range(5, 7)), mode="append")
    with pytest.raises(ConfigError, match="version 1 .*delta.enableChangeDataFeed"):
        reader(path, readChangeFeed="true", startingVersion="1").initialOffset()
    got = stream(reader(path, readChangeFeed="true", startingVersion="2"))
    assert rows_of(got) == load_cdf(path, 2)


def test_a_version_that_removes_rows_without_change_data_is_refused(tmp_path):
    """After change data is turned off, an append is still inserts (its adds are its
    change data), but a version that removes rows cannot say which: refused at that
    version, with everything before it served."""
    path = str(tmp_path / "t")
    write_deltalake(path, _t(range(5)), configuration=CDF)  # v0
    DeltaTable(path).alter.set_table_properties({"delta.enableChangeDataFeed": "false"})  # v1
    write_deltalake(path, _t(range(5, 8)), mode="append")  # v2
    DeltaTable(path).delete("id = 1")  # v3: no cdc files, change data off
    write_deltalake(path, _t(range(8, 9)), mode="append")  # v4
    assert not any("cdc" in a for a in log(path, 3))
    r = reader(path, readChangeFeed="true", startingVersion="0")
    start = r.initialOffset()
    end = r.latestOffset(start, None)
    assert {x["id"] for x in rows_between(r, start, end)} == set(range(8))
    with pytest.raises(SourceError) as e:
        r.latestOffset(end, None)
    message = str(e.value)
    assert "version 3 of" in message and "removes data" in message
    assert "delta.enableChangeDataFeed" in message and "\n" not in message


def test_a_table_with_a_change_feed_column_is_refused(tmp_path):
    path = str(tmp_path / "t")
    t = _t(range(2)).append_column("_change_type", pa.array(["a", "b"]))
    write_deltalake(path, t, configuration=CDF)
    with pytest.raises(ConfigError, match="column '_change_type'.*readChangeFeed"):
        DeltaSourceOptions.parse({"path": path, "readChangeFeed": "true"}).spark_schema_ddl()
    assert len(stream(reader(path))) == 2  # the plain source reads it


def test_offsets_of_the_other_mode_are_refused(table):
    """A change-feed offset counts the files of a version's change set, an append offset
    its adds: a checkpoint made in one mode is refused in the other."""
    plain = reader(table, startingVersion="0")
    cdf = reader(table, readChangeFeed="true", startingVersion="0")
    p0, c0 = plain.initialOffset(), cdf.initialOffset()
    assert "changeFeed" not in p0 and c0["changeFeed"] is True
    with pytest.raises(SourceError, match="readChangeFeed=true.*readChangeFeed=false"):
        plain.latestOffset(c0, None)
    with pytest.raises(SourceError, match="readChangeFeed=false.*readChangeFeed=true"):
        cdf.partitions(p0, {**p0, "version": 1})


def test_a_cleaned_version_is_an_error_not_a_skip(table):
    DeltaTable(table).create_checkpoint()
    for version in (0, 1, 2):
        os.remove(os.path.join(table, "_delta_log", f"{version:020d}.json"))
    with pytest.raises(SourceError, match="commit 2 of .* no longer in the Delta log"):
        stream(reader(table, readChangeFeed="true", startingVersion="2"))


# --- skipChangeCommits ---------------------------------------------------------------------


def _rewrites(path) -> set[int]:
    """Versions that remove rows (remove actions with dataChange)."""
    last = DeltaTable(str(path)).version()
    return {
        v
        for v in range(last + 1)
        if any(a.get("remove", {}).get("dataChange") for a in log(path, v))
    }


def test_skip_change_commits_skips_exactly_the_rewrite_versions(table):
    rewrites = _rewrites(table)
    assert rewrites >= {2, 3, 4, 5}
    got = stream(reader(table, startingVersion="0", skipChangeCommits="true"))
    cdf = stream(reader(table, readChangeFeed="true", startingVersion="0"))
    appended = [
        {k: v for k, v in r.items() if not k.startswith("_")}
        for r in cdf
        if r["_commit_version"] not in rewrites
    ]
    assert all(r["_change_type"] == "insert" for r in cdf if r["_commit_version"] not in rewrites)
    assert rows_of(got) == rows_of(appended)
    # without it, the first rewrite stops the stream
    with pytest.raises(SourceError, match="version 2 .*removes data"):
        stream(reader(table, startingVersion="0"))


# --- delta-rs's test tables with change data ----------------------------------------------

LOAD_CDF_READS = [
    "cdf-table",
    "cdf-table-non-partitioned",
    "cdf-table-with-cdc-and-dvs",
    "simple_table_with_cdc",
    "cdc_ict_table",
]


@pytest.mark.parametrize("name", LOAD_CDF_READS)
def test_delta_rs_tables_equal_load_cdf(name):
    path = CORPUS / name
    got = stream(reader(path, readChangeFeed="true", startingVersion="0", maxFilesPerBatch="2"))
    assert got and rows_of(got) == load_cdf(path)


@pytest.mark.parametrize("name", LOAD_CDF_READS)
def test_delta_rs_tables_replay_exactly(name):
    path = CORPUS / name
    first = batches(reader(path, readChangeFeed="true", startingVersion="0", maxFilesPerBatch="1"))
    again = reader(path, readChangeFeed="true", startingVersion="0", maxFilesPerBatch="1")
    for start, end, rows in first:
        assert rows_between(again, start, end) == rows


def test_deletion_vector_deletes_are_the_difference_of_the_two_vectors():
    """cdf-table-with-cdc-and-dvs: Delta Spark's DELETE with deletion vectors writes no
    cdc files, only the file removed and added back with a larger vector: the deleted
    rows are those the new vector has and the old one has not."""
    path = CORPUS / "cdf-table-with-cdc-and-dvs"
    got = stream(reader(path, readChangeFeed="true", startingVersion="2"))
    at2 = [(r["id"], r["_change_type"]) for r in got if r["_commit_version"] == 2]
    assert at2 == [(3, "delete")]
    at16 = sorted((r["id"], r["_change_type"]) for r in got if r["_commit_version"] == 16)
    assert at16 == [(7, "delete"), (8, "delete")]


def test_in_commit_timestamps_are_the_commit_timestamp():
    """cdc_ict_table's version 1 has inCommitTimestamp 1683874206883 and timestamp
    1783874206883: the in-commit timestamp is the commit's time (Delta's rule, load_cdf's)."""
    got = stream(reader(CORPUS / "cdc_ict_table", readChangeFeed="true", startingVersion="0"))
    at1 = {r["_commit_timestamp"] for r in got if r["_commit_version"] == 1}
    assert at1 == {dt.datetime.fromtimestamp(1683874206883 / 1000, UTC)}


def test_skip_change_commits_on_a_delta_spark_table():
    path = CORPUS / "cdf-table-with-cdc-and-dvs"
    got = stream(reader(path, startingVersion="0", skipChangeCommits="true"))
    cdf = stream(reader(path, readChangeFeed="true", startingVersion="0"))
    rewrites = _rewrites(path)
    expected = [
        {"id": r["id"], "comment": r["comment"]}
        for r in cdf
        if r["_commit_version"] not in rewrites
    ]
    assert rows_of(got) == rows_of(expected) and len(got) == 15


def _known_rows(path, version) -> list[dict]:
    """The change rows of one version, from the files its commit names: cdc files as they
    are, else adds as inserts (partition values from the action, typed as dates here)."""
    actions = log(path, version)
    info = next(a["commitInfo"] for a in actions if "commitInfo" in a)
    ts = dt.datetime.fromtimestamp(info.get("inCommitTimestamp", info["timestamp"]) / 1000, UTC)
    cdc = [a["cdc"] for a in actions if "cdc" in a]
    files = cdc or [a["add"] for a in actions if "add" in a and a["add"]["dataChange"]]
    assert not any("remove" in a for a in actions) or cdc
    out = []
    for f in files:
        for row in pq.read_table(os.path.join(path, f["path"])).to_pylist():
            for k, v in f["partitionValues"].items():
                row[k] = dt.date.fromisoformat(v)
            row.setdefault("_change_type", "insert")
            out.append(row | {"_commit_version": version, "_commit_timestamp": ts})
    return out


def test_checkpoint_cdf_table_from_the_files_the_log_names():
    """checkpoint-cdf-table keeps commits 3 to 5 and a checkpoint at 3: load_cdf fails from
    version 0 (and so does this source, by name); from 3 on both read it, and the rows are
    the ones the log's files hold."""
    path = CORPUS / "checkpoint-cdf-table"
    with pytest.raises(SourceError, match="commit 0 of .* no longer in the Delta log"):
        stream(reader(path, readChangeFeed="true", startingVersion="0"))
    got = stream(reader(path, readChangeFeed="true", startingVersion="3"))
    known = [row for v in (3, 4, 5) for row in _known_rows(path, v)]
    assert rows_of(got) == rows_of(known) == load_cdf(path, 3)
    # the default start: the table at version 5, as inserts of version 5
    snapshot = stream(reader(path, readChangeFeed="true"))
    info = next(a["commitInfo"] for a in log(path, 5) if "commitInfo" in a)
    ts = dt.datetime.fromtimestamp(info["timestamp"] / 1000, UTC)
    table = DeltaTable(str(path)).to_pyarrow_table().to_pylist()
    assert len(table) == 13
    assert rows_of(snapshot) == rows_of(
        r | {"_change_type": "insert", "_commit_version": 5, "_commit_timestamp": ts} for r in table
    )


def test_the_corpus_readme_names_its_source():
    readme = (CORPUS / "README.md").read_text()
    assert "delta-io/delta-rs" in readme and "Apache" in readme
    for name in [*LOAD_CDF_READS, "checkpoint-cdf-table"]:
        assert name in readme and (CORPUS / name / "_delta_log").is_dir()


# --- deletion vectors on adds, partition values of cdc files --------------------------------


def test_inserts_from_adds_honour_deletion_vectors(tmp_path):
    """An append whose add carries a deletion vector (as another engine may write): the
    deleted rows are not inserts."""
    path = str(tmp_path / "t")
    write_deltalake(path, _t(range(3)), configuration=CDF)
    hm.commit(
        path,
        [
            {
                "protocol": {
                    "minReaderVersion": 3,
                    "minWriterVersion": 7,
                    "readerFeatures": ["deletionVectors"],
                    "writerFeatures": ["deletionVectors", "changeDataFeed"],
                }
            }
        ],
    )
    name = "extra.parquet"
    pq.write_table(_t(range(10, 16)), os.path.join(path, name))
    from corpus.tables import add_action

    add = hm.with_dv(add_action(path, name, 6)["add"], hm.inline_dv([1, 4]))
    hm.commit(path, [add])
    got = stream(reader(path, readChangeFeed="true", startingVersion="2"))
    assert sorted(r["id"] for r in got) == [10, 12, 13, 15]


def test_cdc_partition_values_come_from_the_action(tmp_path):
    """The partition values of a cdc file are its action's, not its folder's."""
    path = str(tmp_path / "t")
    part = lambda i: "a"  # noqa: E731
    write_deltalake(path, _t(range(3), part), partition_by=["p"], configuration=CDF)
    DeltaTable(path).delete("id = 1")
    (cdc,) = [a for a in log(path, 1) if "cdc" in a]
    assert cdc["cdc"]["partitionValues"] == {"p": "a"}
    # rewrite the commit with the cdc file moved to another folder name
    moved = "_change_data/elsewhere/" + cdc["cdc"]["path"].rsplit("/", 1)[-1]
    os.makedirs(os.path.join(path, "_change_data", "elsewhere"))
    shutil.move(os.path.join(path, cdc["cdc"]["path"]), os.path.join(path, moved))
    file = os.path.join(path, "_delta_log", f"{1:020d}.json")
    actions = log(path, 1)
    for a in actions:
        if "cdc" in a:
            a["cdc"]["path"] = moved
    Path(file).write_text("".join(json.dumps(a) + "\n" for a in actions))
    got = stream(reader(path, readChangeFeed="true", startingVersion="1"))
    assert [(r["id"], r["p"], r["_change_type"]) for r in got] == [(1, "a", "delete")]


def test_a_commit_without_commit_info_is_at_the_epoch_as_load_cdf_says(tmp_path):
    """commitInfo is optional in the protocol: without one, load_cdf's time is 0, and so is
    ours (a modification time would change when the log is copied: not replayable)."""
    path = str(tmp_path / "t")
    write_deltalake(path, _t(range(2)), configuration=CDF)
    name = "bare.parquet"
    pq.write_table(_t(range(5, 7)), os.path.join(path, name))
    from corpus.tables import add_action

    Path(path, "_delta_log", f"{1:020d}.json").write_text(
        json.dumps(add_action(path, name, 2)) + "\n"
    )
    got = stream(reader(path, readChangeFeed="true", startingVersion="1"))
    epoch = dt.datetime(1970, 1, 1, tzinfo=UTC)
    assert [(r["id"], r["_commit_timestamp"]) for r in got] == [(5, epoch), (6, epoch)]
    assert rows_of(got) == load_cdf(path, 1)
