"""Exporting a named snapshot while the query runs: the cut is a committed batch."""

import time

import pytest
from deltalake import DeltaTable

from pyspark_txn import admin, snapshots

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
