"""Exporting a named snapshot while the query runs: the cut is a committed batch."""

import os
import time

import pytest
from deltalake import DeltaTable

from pyspark_txn import admin, snapshots
from pyspark_txn.errors import ConfigError

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


def _sequence(spark, **options):
    reader = spark.readStream.format("txn-sequence")
    for k, v in {"rowsPerBatch": 40, "totalRows": 400, "width": 2, **options}.items():
        reader = reader.option(k, v)
    return reader.load()


def _rows(path):
    table = DeltaTable(path).to_pyarrow_table()
    return sorted(tuple(r.values()) for r in table.to_pylist())


def _staged_attempts(handle):
    """(snapshot id, token) of every attempt with files in the staging area."""
    return handle.target().staged_attempts()


def _wait_for_batch(q, batch, timeout=180):
    deadline = time.time() + timeout
    while not (q.lastProgress and q.lastProgress["batchId"] >= batch):
        assert time.time() < deadline and q.isActive, q.exception()
        time.sleep(0.2)


def test_requested_export_runs_at_the_next_commit_of_the_running_query(spark, tmp_path):
    chk, target = str(tmp_path / "chk"), str(tmp_path / "target")
    q = (
        _sequence(spark, rowsPerSecond=150, totalRows=100_000)
        .writeStream.format("txn-delta")
        .option("checkpointLocation", chk)
        .option("path", target)
        .trigger(processingTime="300 milliseconds")
        .start()
    )
    try:
        _wait_for_batch(q, 1)
        before = admin.open_sink(chk).load().last_record.batch_id
        snapshots.request_export(chk, "next", str(tmp_path / "next"))
        named = snapshots.wait_for_export(chk, "next", timeout=120, query=q)
    finally:
        q.stop()
    assert named.batch_id > before
    (offset,) = named.details["source_offsets"]
    got = DeltaTable(f"{named.location}/data").to_pyarrow_table().column("id").to_pylist()
    assert sorted(got) == list(range(offset["index"]))
    assert snapshots.verify(chk, "next").ok


def test_stop_and_export_then_start_from_it_equals_an_uninterrupted_run(spark, tmp_path):
    # the reference: one uninterrupted run to the end
    whole = str(tmp_path / "whole")
    _sequence(spark).writeStream.format("txn-delta").option(
        "checkpointLocation", str(tmp_path / "whole-chk")
    ).option("path", whole).trigger(availableNow=True).start().awaitTermination()
    expected = _rows(whole)
    assert len(expected) == 400

    # the same query, stopped mid-stream into a terminal snapshot
    chk, target = str(tmp_path / "chk"), str(tmp_path / "target")
    q = (
        _sequence(spark, rowsPerSecond=200)
        .writeStream.format("txn-delta")
        .option("checkpointLocation", chk)
        .option("path", target)
        .trigger(processingTime="200 milliseconds")
        .start()
    )
    _wait_for_batch(q, 2)
    named = snapshots.stop_and_export(q, "cut", str(tmp_path / "cut"))
    assert not q.isActive and named.details["terminal"] is True
    handle = admin.open_sink(chk)
    state = handle.load()
    # the cut is the query's last committed batch, and nothing unrecorded is staged
    assert named.batch_id == state.last_record.batch_id
    recorded = {(r.snapshot_id, r.token) for r in state.records.values()}
    assert _staged_attempts(handle) <= recorded
    assert _rows(f"{named.location}/data") == _rows(target)
    (offset,) = named.details["source_offsets"]
    assert 0 < offset["index"] < 400 and len(_rows(target)) == offset["index"]

    # a new query from the snapshot, run to the end: the same table, row by row
    prepared = snapshots.prepare_query(
        chk, "cut", str(tmp_path / "resumed-chk"), str(tmp_path / "resumed")
    )
    _sequence(spark).writeStream.format("txn-delta").option(
        "checkpointLocation", prepared.checkpoint
    ).option("path", prepared.path).trigger(availableNow=True).start().awaitTermination()
    assert _rows(prepared.path) == expected
    # and the stopped query itself, restarted from its checkpoint, also ends exactly once
    _sequence(spark).writeStream.format("txn-delta").option("checkpointLocation", chk).option(
        "path", target
    ).trigger(availableNow=True).start().awaitTermination()
    assert _rows(target) == expected


def _stateful_counts(spark, **options):
    """A windowed count over the sequence: one stateful operator, one row per window."""
    from pyspark.sql import functions as F

    return (
        _sequence(spark, **options)
        .withColumn("ts", F.timestamp_seconds(F.col("id")))
        .withWatermark("ts", "1 hour")
        .groupBy(F.window("ts", "100 seconds"))
        .agg(F.count("*").alias("n"))
    )


def test_named_export_of_a_stateful_aggregation_holds_readable_state(spark, tmp_path):
    import os

    chk, target = str(tmp_path / "chk"), str(tmp_path / "target")
    q = (
        _stateful_counts(spark)
        .writeStream.format("txn-delta")
        .option("checkpointLocation", chk)
        .option("path", target)
        .trigger(availableNow=True)
        .start()
    )
    q.awaitTermination()
    assert q.exception() is None
    skipped = snapshots.export(chk, "dataonly", str(tmp_path / "dataonly"), state="skip")
    assert skipped.details["state_tables"] == [] and not os.path.exists(tmp_path / "dataonly/state")
    named = snapshots.export(chk, "agg", str(tmp_path / "agg"), spark=spark)
    assert named.details["stateful"] is True
    (table,) = named.details["state_tables"]
    state_uri = f"{named.location}/{table['path']}"
    state_rows = DeltaTable(state_uri).to_pyarrow_table().to_pylist()
    # 400 ids (= seconds) in windows of 100 seconds: four windows, 100 rows each
    assert table["rows"] == len(state_rows) == 4
    from_spark = (
        spark.read.format("statestore")
        .option("batchId", named.batch_id)
        .option("operatorId", table["operator_id"])
        .load(chk)
        .count()
    )
    assert from_spark == 4
    assert snapshots.verify(chk, "agg").ok
    # a state file removed after export is named by verify
    data_files = [
        os.path.join(root, f)
        for root, _, files in os.walk(state_uri)
        for f in files
        if f.endswith(".parquet")
    ]
    # a bit flipped inside a state file (same size, still readable) fails its CRC32
    original = open(data_files[0], "rb").read()
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0x01
    with open(data_files[0], "wb") as f:
        f.write(bytes(flipped))
    check = snapshots.verify(chk, "agg")
    assert not check.ok and any(table["path"] in p and "CRC32" in p for p in check.problems), (
        check.problems
    )
    with open(data_files[0], "wb") as f:
        f.write(original)
    assert snapshots.verify(chk, "agg").ok
    os.remove(data_files[0])
    check = snapshots.verify(chk, "agg")
    assert not check.ok and any(table["path"] in p for p in check.problems), check.problems


def test_stop_and_export_of_a_running_stateful_query(spark, tmp_path):
    chk, target = str(tmp_path / "chk"), str(tmp_path / "target")
    q = (
        _stateful_counts(spark, rowsPerSecond=200)
        .writeStream.format("txn-delta")
        .option("checkpointLocation", chk)
        .option("path", target)
        .trigger(processingTime="200 milliseconds")
        .start()
    )
    _wait_for_batch(q, 2)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "f").write_text("x")
    with pytest.raises(ConfigError, match="is not empty"):  # checked before the stop
        snapshots.stop_and_export(q, "stopped", str(busy))
    assert q.isActive
    named = snapshots.stop_and_export(q, "stopped", str(tmp_path / "stopped"))
    assert not q.isActive and named.details["terminal"] is True
    (table,) = named.details["state_tables"]
    (offset,) = named.details["source_offsets"]
    state = DeltaTable(f"{named.location}/{table['path']}").to_pyarrow_table().to_pylist()
    # the state is the cut's: one row per 100-second window of the ids read up to it
    assert len(state) == -(-offset["index"] // 100) and 0 < offset["index"] < 400, offset
    from_spark = (
        spark.read.format("statestore")
        .option("batchId", named.batch_id)
        .option("operatorId", table["operator_id"])
        .load(chk)
    )
    assert from_spark.count() == len(state)
    assert snapshots.verify(chk, "stopped").ok


def test_a_stop_between_the_sinks_commit_and_sparks_commit_log_exports_the_batch_before(
    spark, tmp_path
):
    """stop() can fall after the sink committed batch k and before Spark's commit-log
    entry for k: Spark's state reader has no batch k then, so the terminal snapshot is
    batch k-1 (at restart Spark replays k, a no-op for the sink). Made deterministic by
    removing the last commit-log entry of a stopped query."""
    chk, target = str(tmp_path / "chk"), str(tmp_path / "target")
    q = (
        _stateful_counts(spark, rowsPerSecond=200)
        .writeStream.format("txn-delta")
        .option("checkpointLocation", chk)
        .option("path", target)
        .trigger(processingTime="200 milliseconds")
        .start()
    )
    _wait_for_batch(q, 2)
    q.stop()
    commits = os.path.join(chk, "commits")
    last = max(int(f) for f in os.listdir(commits) if f.isdigit())
    for name in (str(last), f".{last}.crc"):
        os.remove(os.path.join(commits, name))
    named = snapshots.stop_and_export(q, "cut", str(tmp_path / "cut"), checkpoint=chk)
    assert named.batch_id == last - 1
    (table,) = named.details["state_tables"]
    state = DeltaTable(f"{named.location}/{table['path']}").to_pyarrow_table()
    from_spark = (
        spark.read.format("statestore")
        .option("batchId", named.batch_id)
        .option("operatorId", table["operator_id"])
        .load(chk)
    )
    assert from_spark.count() == state.num_rows
    assert snapshots.verify(chk, "cut").ok
