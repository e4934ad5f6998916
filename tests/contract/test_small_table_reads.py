"""Small tables this package wrote (backup catalogs, manifests) are read file by file
(pyspark_txn.storage.delta_tables.read_rows), never through delta-rs' pyarrow
filesystem, whose threads can abort a short script as it exits."""

import subprocess
import sys

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from pyspark_txn.storage.delta_tables import count_rows, read_rows

_READ_ONLY = """
import sys
from pyspark_txn.storage.delta_tables import read_rows

assert read_rows(sys.argv[1]) == [{"a": 1, "b": "x"}]
assert sorted(r["a"] for r in read_rows(sys.argv[2])) == [1, 2]  # through delta-rs
"""


def test_a_short_script_that_reads_a_small_table_exits_cleanly(tmp_path):
    # The script only reads, then ends: DeltaTable.to_pyarrow_table() (also for a
    # partitioned table, which delta-rs reads) or pq.read_table(file object) there ended in "terminate called without an active
    # exception" (rc 134) in 3-13 of 20 runs (pyarrow 26, deltalake 1.6.6).
    uri, parted = str(tmp_path / "t"), str(tmp_path / "p")
    write_deltalake(uri, pa.table({"a": [1], "b": ["x"]}))
    write_deltalake(parted, pa.table({"a": [1, 2], "p": ["x y", "z"]}), partition_by=["p"])
    failures = []
    for _ in range(16):
        done = subprocess.run(
            [sys.executable, "-c", _READ_ONLY, uri, parted],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            failures.append((done.returncode, done.stderr[-500:]))
    assert failures == []


def test_rows_are_those_of_the_latest_version_or_of_the_table_given(tmp_path):
    uri = str(tmp_path / "t")
    write_deltalake(uri, pa.table({"a": [1, 2]}))
    old = DeltaTable(uri)
    write_deltalake(uri, pa.table({"a": [3]}), mode="append")
    write_deltalake(uri, pa.table({"a": [9]}), mode="overwrite")
    assert read_rows(uri) == [{"a": 9}]
    assert count_rows(uri) == 1
    assert sorted(r["a"] for r in read_rows(old)) == [1, 2]  # at the version it was read
    assert count_rows(old) == 2


def test_a_partitioned_table_is_read_through_delta_rs_with_its_partition_values(tmp_path):
    uri = str(tmp_path / "p")
    write_deltalake(uri, pa.table({"a": [1, 2], "p": ["x y", "z"]}), partition_by=["p"])
    assert sorted((r["a"], r["p"]) for r in read_rows(uri)) == [(1, "x y"), (2, "z")]
    assert count_rows(uri) == 2


def test_a_missing_or_truncated_file_fails_the_count(tmp_path):
    uri = tmp_path / "t"
    write_deltalake(str(uri), pa.table({"a": list(range(100))}))
    (data,) = [p for p in uri.iterdir() if p.suffix == ".parquet"]
    data.write_bytes(data.read_bytes()[:50])
    with pytest.raises(pa.ArrowInvalid):
        count_rows(str(uri))
    data.unlink()
    with pytest.raises(FileNotFoundError):
        count_rows(str(uri))


def test_no_table_is_delta_rs_own_error(tmp_path):
    from deltalake.exceptions import TableNotFoundError

    with pytest.raises(TableNotFoundError):
        read_rows(str(tmp_path / "none"))


@pytest.mark.parametrize("name", ["a b", "ü", "x#y"])
def test_a_table_given_as_an_object_reads_where_its_path_needs_quoting(tmp_path, name):
    uri = str(tmp_path / name / "t")
    write_deltalake(uri, pa.table({"a": [1, 2]}))
    assert sorted(r["a"] for r in read_rows(DeltaTable(uri))) == [1, 2]
    assert count_rows(DeltaTable(uri)) == 2
    assert sorted(r["a"] for r in read_rows(f"file://localhost{uri}")) == [1, 2]


def test_rows_of_files_older_than_a_column_have_it_as_none(tmp_path):
    uri = str(tmp_path / "t")
    write_deltalake(uri, pa.table({"a": [1]}))
    write_deltalake(uri, pa.table({"a": [2], "b": ["x"]}), mode="append", schema_mode="merge")
    rows = sorted(read_rows(uri), key=lambda r: r["a"])
    assert rows == [{"a": 1, "b": None}, {"a": 2, "b": "x"}]


def test_a_file_swapped_for_one_with_fewer_rows_is_refused(tmp_path):
    import pyarrow.parquet as pq

    from pyspark_txn.errors import CorruptSnapshotError

    uri = tmp_path / "t"
    write_deltalake(str(uri), pa.table({"a": list(range(100))}))
    (data,) = [p for p in uri.iterdir() if p.suffix == ".parquet"]
    pq.write_table(pa.table({"a": [1]}), data)
    with pytest.raises(CorruptSnapshotError, match="1 rows in the file, 100 in the table's log"):
        read_rows(str(uri))
    with pytest.raises(CorruptSnapshotError, match="100 in the table's log"):
        count_rows(str(uri))
