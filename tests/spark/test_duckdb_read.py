"""The sink's tables read by DuckDB, a reader that shares no code with delta-rs.

DuckDB's ``delta`` extension (``delta_scan``) downloads from the internet, which this
project's machines cannot reach, and the PyPI package ``duckdb-ext-delta`` is built for
DuckDB 1.4.4 only (the venv has 2.x). So the bounded check reads the Parquet files that
the Delta log lists (delta-rs's add actions) with DuckDB's own Parquet reader, partition
values from the hive-style folders: it proves the data files and folders, not DuckDB's
reading of the Delta log. ``delta_scan`` runs in a separate, optional test where the
extension loads.
"""

from __future__ import annotations

import pyarrow as pa
import pytest
from deltalake import DeltaTable
from pipeline_checks import PipelineRunner

from pyspark_txn.sources.sequence import expected_rows

duckdb = pytest.importorskip("duckdb", reason="duckdb missing: pip install 'pyspark-txn[dev]'")

pytestmark = pytest.mark.spark

TOTAL, PER_BATCH, WIDTH = 3000, 1000, 2


class Partitioned(PipelineRunner):
    partitions = {"bucket": ("CAST(id % 3 AS STRING)", lambda i: str(i % 3))}


@pytest.fixture(scope="module")
def written(spark, tmp_path_factory):
    """A partitioned txn-delta target written across a crash (a discarded attempt)."""
    runner = Partitioned(spark, tmp_path_factory.mktemp("duckdb"), TOTAL, PER_BATCH)
    assert runner.run("before_record:raise@batch=1", width=WIDTH) is not None
    assert runner.run(width=WIDTH) is None
    runner.assert_exactly_once(width=WIDTH)
    runner.assert_no_orphans()
    return runner


def live_files(path: str) -> list[str]:
    return [u.removeprefix("file://") for u in DeltaTable(path).file_uris()]


def test_duckdb_reads_the_target_s_files_value_for_value(written):
    files = live_files(written.target)
    got = (
        duckdb.connect()
        .sql(
            "SELECT * FROM read_parquet($files, hive_partitioning = true, "
            "hive_types = {'bucket': 'VARCHAR'}) ORDER BY id",
            params={"files": files},
        )
        .to_arrow_table()
    )
    want = expected_rows(0, TOTAL, WIDTH)
    assert got.num_rows == TOTAL
    assert got.select(want.column_names).equals(want)
    assert got.column("bucket").to_pylist() == [str(i % 3) for i in range(TOTAL)]


def test_duckdb_reads_the_record_table(written):
    path = written.record_store().log.uri
    want = DeltaTable(path).to_pyarrow_table()
    con = duckdb.connect()
    got = con.sql(
        "SELECT * FROM read_parquet($files, hive_partitioning = false)",
        params={"files": live_files(path)},
    ).to_arrow_table()
    assert got.num_rows == want.num_rows > 0
    assert sorted(got.column_names) == sorted(want.column_names)


def _delta_extension(con) -> str | None:
    """None if DuckDB's delta extension loads here, else why not."""
    try:
        con.execute("LOAD delta")
        return None
    except duckdb.Error as first:
        try:
            con.execute("INSTALL delta")
            con.execute("LOAD delta")
            return None
        except duckdb.Error as e:
            return f"{str(first).splitlines()[0]} / {str(e).splitlines()[0]}"


def test_optional_duckdb_delta_scan_reads_the_target(written):
    """Optional: only where DuckDB's delta extension is available (not on this
    project's machines: no internet, and no PyPI build for DuckDB 2.x)."""
    con = duckdb.connect()
    missing = _delta_extension(con)
    if missing:
        pytest.skip(f"optional check: DuckDB's delta extension is unavailable ({missing})")
    got = con.sql(f"SELECT * FROM delta_scan('{written.target}') ORDER BY id").to_arrow_table()
    want = expected_rows(0, TOTAL, WIDTH)
    assert got.select(want.column_names).equals(want)
    assert got.column("bucket").cast(pa.string()).to_pylist() == [str(i % 3) for i in range(TOTAL)]
