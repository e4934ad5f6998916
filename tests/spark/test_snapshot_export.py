"""Exporting a named snapshot while the query runs: the cut is a committed batch."""

import time

import pytest
from deltalake import DeltaTable

from pyspark_txn import snapshots

pytestmark = pytest.mark.spark


def test_export_while_the_query_runs_cuts_at_a_committed_batch(spark, tmp_path):
    df = (
        spark.readStream.format("txn-sequence")
        .option("rowsPerBatch", 50)
        .option("rowsPerSecond", 200)
        .load()
    )
    chk, target = str(tmp_path / "chk"), str(tmp_path / "target")
    q = (
        df.writeStream.format("txn-delta")
        .option("checkpointLocation", chk)
        .option("path", target)
        .trigger(processingTime="300 milliseconds")
        .start()
    )
    exports = []
    try:
        deadline = time.time() + 180
        while len(exports) < 2:
            assert time.time() < deadline and q.isActive, q.exception()
            progress = q.lastProgress
            if progress and progress["batchId"] >= 2 * (len(exports) + 1):
                name = f"live{len(exports)}"
                exports.append(snapshots.export(chk, name, str(tmp_path / name)))
            time.sleep(0.5)
    finally:
        q.stop()
    assert exports[0].batch_id < exports[1].batch_id
    for named in exports:
        got = DeltaTable(f"{named.location}/data").to_pyarrow_table().column("id").to_pylist()
        # exactly the rows of batches 0..batch_id: Spark's offset of that batch says how many
        (offset,) = named.details["source_offsets"]
        assert sorted(got) == list(range(offset["index"])) and named.details["rows"] == len(got)
        pinned = DeltaTable(target, version=named.target_version).to_pyarrow_table()
        assert pinned.num_rows == len(got)
        assert snapshots.verify(chk, named.name).ok
    # the query's own table kept going and holds every row once
    ids = DeltaTable(target).to_pyarrow_table().column("id").to_pylist()
    assert sorted(ids) == list(range(len(ids))) and len(ids) > exports[1].details["rows"]
