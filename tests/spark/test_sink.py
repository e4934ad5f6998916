"""The txn-delta sink end to end: real Spark, real Delta tables read back with delta-rs."""

import json
import os
import shutil

import pytest
from deltalake import DeltaTable
from pipeline_checks import run_to_end

from pyspark_txn.storage.checkpoint import read_query_id

pytestmark = pytest.mark.spark


def drop_commit_log(checkpoint, batch):
    """Make Spark forget it finished ``batch`` (as if it died right after our commit)."""
    for name in (str(batch), f".{batch}.crc"):
        path = os.path.join(checkpoint, "commits", name)
        if os.path.exists(path):
            os.remove(path)


def test_pipeline_writes_every_row_once_and_records_every_batch(pipeline, spark):
    assert pipeline.run() is None
    pipeline.assert_exactly_once()
    pipeline.assert_no_orphans()
    pipeline.assert_records_consistent()
    state = pipeline.sink_state()
    assert len(state.records) == 5
    assert state.query_id == read_query_id(pipeline.checkpoint)
    # the record carries Spark's offsets of the batch and one CRC per staged file
    last = state.records[4]
    assert last.source_offsets == ({"index": 5000},)
    assert all(t.checksum.startswith("crc32:") and t.rows > 0 for t in last.txns)
    # Spark reads the same files as delta-rs and sees the same rows
    files = DeltaTable(pipeline.target).file_uris()
    assert spark.read.parquet(*files).count() == 5000


def test_replayed_batch_is_a_no_op(pipeline):
    assert pipeline.run() is None
    version = DeltaTable(pipeline.target).version()
    drop_commit_log(pipeline.checkpoint, 4)
    assert pipeline.run() is None
    assert DeltaTable(pipeline.target).version() == version
    pipeline.assert_exactly_once()
    pipeline.assert_no_orphans()
    assert len(pipeline.sink_state().records) == 5


def test_restart_continues_where_it_stopped(pipeline):
    pipeline.total = 3000
    assert pipeline.run() is None
    pipeline.total = 6000
    assert pipeline.run() is None
    pipeline.assert_exactly_once(6000)
    pipeline.assert_records_consistent()


def test_partitioned_table(pipeline, spark):
    df = (
        spark.readStream.format("txn-sequence")
        .option("rowsPerBatch", 1000)
        .option("totalRows", 3000)
        .load()
        .selectExpr("id", "value", "cast(id % 3 as string) as bucket")
    )
    run_to_end(
        df.writeStream.format("txn-delta")
        .option("path", pipeline.target)
        .option("checkpointLocation", pipeline.checkpoint)
        .option("partitionBy", "bucket")
    )
    dt = DeltaTable(pipeline.target)
    assert dt.metadata().partition_columns == ["bucket"]
    for bucket in "012":
        part = dt.to_pyarrow_table(filters=[("bucket", "=", bucket)])
        ids = part.column("id").to_pylist()
        assert len(ids) == 1000 and all(i % 3 == int(bucket) for i in ids)
    pipeline.assert_no_orphans()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"bogus": "1"}, "unknown option"),
        ({"partitionBy": "nope"}, "partitionBy"),
        ({"mergeSchema": "maybe"}, "mergeSchema"),
        ({"sinkId": "../escape"}, "sinkId"),
        ({"storageOptions": "{not json"}, "storageOptions"),
        ({"rowGroupRows": "0"}, "rowGroupRows"),
        ({"compression": "brotli9"}, "compression"),
        ({"faultInjection": "nowhere:exit"}, "faultInjection"),
    ],
)
def test_bad_options_fail_before_any_data_is_written(pipeline, options, message):
    failure = pipeline.run(**options)
    assert failure is not None and message in str(failure)
    assert not os.path.exists(pipeline.target)


def test_missing_path_is_a_clear_error(spark, tmp_path):
    q = (
        spark.readStream.format("txn-sequence")
        .option("totalRows", 10)
        .load()
        .writeStream.format("txn-delta")
        .option("checkpointLocation", str(tmp_path / "chk"))
        .trigger(availableNow=True)
        .start()
    )
    with pytest.raises(Exception, match="option path"):
        q.awaitTermination()


def test_schema_drift_is_refused_unless_merge_schema(pipeline, tmp_path):
    pipeline.total = 2000
    assert pipeline.run() is None
    version = DeltaTable(pipeline.target).version()
    # a second query with an extra column into the same table
    pipeline.checkpoint = str(tmp_path / "chk2")
    failure = pipeline.run(width=1)
    assert failure is not None and "adds column 'c1'" in str(failure)
    assert "mergeSchema" in str(failure)
    assert DeltaTable(pipeline.target).version() == version
    assert pipeline.run(width=1, mergeSchema="true") is None
    table = DeltaTable(pipeline.target).to_pyarrow_table()
    assert "c1" in table.column_names and table.num_rows == 4000


def test_replaced_checkpoint_is_refused(pipeline, tmp_path):
    """Records kept elsewhere; the checkpoint is thrown away: a new query id is refused."""
    records = str(tmp_path / "records")
    assert pipeline.run(recordTable=records, sinkId="orders") is None
    shutil.rmtree(pipeline.checkpoint)
    failure = pipeline.run(recordTable=records, sinkId="orders")
    assert failure is not None and "checkpoint was deleted or replaced" in str(failure)
    pipeline.assert_exactly_once()


def test_lost_record_table_is_refused(pipeline):
    """Checkpoint and records thrown away together: the target's txn version gives it away."""
    assert pipeline.run() is None
    shutil.rmtree(pipeline.checkpoint)
    failure = pipeline.run()
    assert failure is not None and "record table" in str(failure)
    pipeline.assert_exactly_once()


def test_record_pointing_at_missing_files_is_a_corrupt_snapshot(pipeline):
    pipeline.total = 2000
    assert pipeline.run("after_record:raise@batch=1") is not None
    state = pipeline.sink_state()
    missing = state.records[1].txns[0].handle
    os.remove(os.path.join(pipeline.target, missing))
    failure = pipeline.run()
    assert failure is not None
    assert "CorruptSnapshotError" in str(failure) and missing in str(failure)
    # nothing half-committed: batch 0 only
    assert DeltaTable(pipeline.target).to_pyarrow_table().num_rows == 1000


def test_record_table_history_is_queryable_with_any_delta_reader(pipeline):
    assert pipeline.run() is None
    rows = (
        DeltaTable(os.path.join(pipeline.checkpoint, "pyspark_txn", "records"))
        .to_pyarrow_table()
        .to_pylist()
    )
    kinds = {r["kind"] for r in rows}
    # (phase 2 is confirmed by the next record, or by `committed` after a recovery)
    assert (
        {"allocated", "epoch", "snapshot"}
        <= kinds
        <= {"allocated", "committed", "epoch", "snapshot"}
    )
    snap = next(r for r in rows if r["kind"] == "snapshot")
    assert json.loads(snap["payload"])["rows"] == 1000
