"""Ordinary mistakes a user makes with checkpoints and options, end to end with real
Spark and Delta: each used to skip, duplicate or silently misplace data."""

import json
import os
import shutil

import pytest
from deltalake import DeltaTable

from pyspark_txn.storage.checkpoint import SINK_FILE

pytestmark = pytest.mark.spark


def test_reset_offsets_are_not_taken_for_replays(pipeline):
    """offsets/ and commits/ deleted, metadata kept, restarted from another start offset:
    batches 0-2 have records, but Spark's offsets for them differ. Refused, not skipped."""
    pipeline.total = 3000
    assert pipeline.run() is None
    for folder in ("offsets", "commits"):
        shutil.rmtree(os.path.join(pipeline.checkpoint, folder))
    pipeline.start = 100_000
    failure = pipeline.run()
    assert failure is not None and "CheckpointMismatchError" in str(failure)
    assert "reset or replaced" in str(failure) and "{'index': 1000}" in str(failure)
    pipeline.assert_exactly_once(3000)


def test_reset_offsets_with_the_same_offsets_are_replays(pipeline):
    """The same reset with the same source: every batch is a true replay, nothing twice."""
    pipeline.total = 3000
    assert pipeline.run() is None
    version = DeltaTable(pipeline.target).version()
    for folder in ("offsets", "commits"):
        shutil.rmtree(os.path.join(pipeline.checkpoint, folder))
    assert pipeline.run() is None
    assert DeltaTable(pipeline.target).version() == version
    pipeline.assert_exactly_once(3000)


def test_a_copied_checkpoint_keeps_its_sink_and_history(pipeline, tmp_path):
    pipeline.total = 3000
    assert pipeline.run() is None
    with open(os.path.join(pipeline.checkpoint, *SINK_FILE)) as f:
        sink_id = json.load(f)["sink_id"]
    copy = str(tmp_path / "moved" / "chk")
    shutil.copytree(pipeline.checkpoint, copy)
    pipeline.checkpoint = copy
    pipeline.total = 5000
    assert pipeline.run() is None
    pipeline.assert_exactly_once(5000)
    pipeline.assert_records_consistent()
    assert pipeline.sink_state().sink_id == sink_id


def test_a_moved_checkpoint_without_its_records_is_refused(pipeline, tmp_path):
    """Spark's files moved, pyspark_txn's left behind: a new sink with no history finds
    commits of the same query by another sink in the target."""
    pipeline.total = 2000
    assert pipeline.run() is None
    moved = str(tmp_path / "moved")
    shutil.copytree(pipeline.checkpoint, moved, ignore=shutil.ignore_patterns("pyspark_txn"))
    pipeline.checkpoint = moved
    pipeline.total = 4000
    failure = pipeline.run()
    assert failure is not None and "made by sink" in str(failure)
    pipeline.assert_exactly_once(2000)


def test_an_explicit_sink_id_must_match_the_checkpoint(pipeline):
    pipeline.total = 1000
    assert pipeline.run() is None
    pipeline.total = 2000
    failure = pipeline.run(sinkId="renamed")
    assert failure is not None and "sinkId='renamed'" in str(failure)


def test_two_queries_sharing_a_sink_id_are_refused(pipeline, tmp_path):
    pipeline.total = 2000
    assert pipeline.run(sinkId="shared") is None
    pipeline.checkpoint = str(tmp_path / "other-chk")
    failure = pipeline.run(sinkId="shared")
    assert failure is not None and "CheckpointMismatchError" in str(failure)
    pipeline.assert_exactly_once(2000)


@pytest.mark.parametrize(
    "expr, message",
    [
        ("make_dt_interval(0, 0, 0, id) AS gap", "'gap'.*Spark interval.*cannot store"),
        ("array() AS arr", "'arr'.*array<void>"),
        ("parse_json('{\"a\": 1}') AS doc", "'doc'.*VARIANT"),
        ("id AS ID", "'id' and 'ID' differ only by case"),
    ],
    ids=["interval", "array-of-void", "variant", "case"],
)
def test_a_type_delta_cannot_store_fails_before_anything_is_written(spark, tmp_path, expr, message):
    target, chk = str(tmp_path / "t"), str(tmp_path / "chk")
    df = (
        spark.readStream.format("txn-sequence")
        .option("rowsPerBatch", 10)
        .option("totalRows", 20)
        .load()
        .selectExpr("id", expr)
    )
    q = (
        df.writeStream.format("txn-delta")
        .option("path", target)
        .option("checkpointLocation", chk)
        .trigger(availableNow=True)
        .start()
    )
    with pytest.raises(Exception, match=message):
        q.awaitTermination()
    assert not os.path.exists(target)


def test_checkpoint_from_the_session_conf_gets_a_clear_message(spark, tmp_path):
    spark.conf.set("spark.sql.streaming.checkpointLocation", str(tmp_path / "conf-chk"))
    try:
        q = (
            spark.readStream.format("txn-sequence")
            .option("rowsPerBatch", 10)
            .option("totalRows", 20)
            .load()
            .writeStream.format("txn-delta")
            .option("path", str(tmp_path / "t"))
            .queryName("from_conf")
            .trigger(availableNow=True)
            .start()
        )
        with pytest.raises(Exception, match="option\\('checkpointLocation'"):
            q.awaitTermination()
    finally:
        spark.conf.unset("spark.sql.streaming.checkpointLocation")
    assert not os.path.exists(tmp_path / "t")


def test_record_table_inside_the_target_is_refused(pipeline):
    failure = pipeline.run(recordTable=os.path.join(pipeline.target, "records"))
    assert failure is not None and "overlap" in str(failure)
    assert not os.path.exists(pipeline.target)


def test_a_table_recreated_empty_is_refused_not_written(pipeline):
    """Issue 23 trial, bug E: the target deleted and re-created empty between runs. The
    restart used to land the next batches in the new table (batches 0-2 silently gone)
    and record a false commit; it fails with TargetGoneError, nothing staged or written."""
    from deltalake import write_deltalake

    from pyspark_txn.sinks.staging import STAGING_ROOT

    pipeline.total = 3000
    assert pipeline.run() is None
    empty = DeltaTable(pipeline.target).to_pyarrow_table().slice(0, 0)
    shutil.rmtree(pipeline.target)
    write_deltalake(pipeline.target, empty)
    pipeline.total = 5000
    failure = pipeline.run()
    assert failure is not None and "TargetGoneError" in str(failure)
    assert "no longer holds this sink's batches up to 1" in str(failure)
    dt = DeltaTable(pipeline.target)
    assert dt.version() == 0 and dt.to_pyarrow_table().num_rows == 0
    assert not os.path.exists(os.path.join(pipeline.target, STAGING_ROOT))
    state = pipeline.sink_state()  # nothing recorded, no false "committed" of batch 2
    assert state.last_record.batch_id == 2 and state.last_record.snapshot_id not in state.committed
