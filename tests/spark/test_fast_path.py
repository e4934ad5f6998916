"""The fast path (``delta_batch_writer`` in ``foreachBatch``): exactly-once under a
fault at every protocol step and a failed Spark write job, replays that write
nothing, and a JVM source. Real Spark, real Delta tables read back with delta-rs.

``exit`` faults would kill this test process (the callback runs in the driver),
so in-process cases use ``raise``; ``tests/e2e`` kills whole drivers.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable
from pipeline_checks import PipelineRunner

import pyspark_txn
from pyspark_txn.errors import ConfigError

pytestmark = pytest.mark.spark


class FastRunner(PipelineRunner):
    """PipelineRunner's source and checks, the fast path as the sink."""

    fail_at_id: int | None = None  # a row id whose batch's Spark write job fails

    def writer(self, faults: str | None = None, width: int = 0, **options):
        from pyspark.sql import functions as F

        df = (
            self.spark.readStream.format("txn-sequence")
            .option("rowsPerBatch", self.per_batch)
            .option("totalRows", self.total)
            .option("width", width)
            .option("start", self.start)
            .load()
        )
        if faults:
            options["faultInjection"] = faults
        sink = pyspark_txn.delta_batch_writer(
            path=self.target, checkpoint=self.checkpoint, **options
        )
        fail_at = self.fail_at_id

        def batch(bdf, batch_id):
            if fail_at is not None:  # fails inside the executors' write tasks
                bdf = bdf.filter(F.assert_true(F.col("id") != F.lit(fail_at)).isNull())
            sink(bdf, batch_id)

        return df.writeStream.foreachBatch(batch).option("checkpointLocation", self.checkpoint)


@pytest.fixture
def fast(spark, tmp_path):
    return FastRunner(spark, tmp_path)


def _check(runner: PipelineRunner) -> None:
    runner.assert_exactly_once()
    runner.assert_no_orphans()
    runner.assert_records_consistent()


def test_several_batches_exactly_once(fast):
    assert fast.run() is None
    _check(fast)
    state = fast.sink_state()
    assert len(state.records) == 5
    assert [r.batch_id for r in sorted(state.records.values(), key=lambda r: r.batch_id)] == [
        0,
        1,
        2,
        3,
        4,
    ]
    # every record carries Spark's offsets of its batch and the run that wrote it
    rec = state.records[4]
    assert rec.source_offsets and rec.run_id == state.epoch_owner
    # staged by Spark's writer: the committed files are the staging layout's names
    files = [os.path.basename(u) for u in DeltaTable(fast.target).file_uris()]
    assert files and all(f.startswith(f"part-{state.sink_id}-") for f in files)
    assert not (Path(fast.target) / "txn-staged" / state.sink_id / "spark").exists()


CASES = [
    "allocate:raise",  # (allocation knows no batch id)
    "phase1:raise@snapshot=2",
    "before_record:raise@batch=1",
    "after_record:raise@batch=1",
    "after_phase2:raise@batch=2",
    "after_commit:raise@batch=3",
]


@pytest.mark.parametrize("fault", CASES)
def test_fault_then_restart_is_exactly_once(fast, fault):
    failure = fast.run(fault)
    assert failure is not None, "the injected fault must fail the query"
    assert "injected fault" in str(failure)
    assert fast.run() is None
    _check(fast)


def test_a_failed_spark_write_job_then_restart_is_exactly_once(fast):
    fast.fail_at_id = 2500  # in batch 2
    failure = fast.run()
    assert failure is not None
    fast.fail_at_id = None
    assert fast.run() is None
    _check(fast)
    state = fast.sink_state()
    assert state.abandoned, "the failed attempt was abandoned"


def test_a_fault_at_every_step_in_one_pipeline(fast):
    fast.total = 7000
    for fault in [
        "after_record:raise@batch=0",
        "after_phase2:raise@batch=1",
        "phase1:raise@snapshot=4",
        "before_record:raise@batch=3",
        "after_commit:raise@batch=4",
    ]:
        assert fast.run(fault) is not None, fault
    fast.fail_at_id = 5500
    assert fast.run() is not None
    fast.fail_at_id = None
    assert fast.run() is None
    _check(fast)


def test_a_replayed_batch_writes_nothing(fast):
    assert fast.run() is None
    version = DeltaTable(fast.target).version()
    events = len(fast.record_store().events(fast.sink_state().sink_id))
    commits = Path(fast.checkpoint) / "commits"
    last = max(int(p.name) for p in commits.iterdir() if p.name.isdigit())
    os.remove(commits / str(last))  # Spark replays batch `last` on restart
    crc = commits / f".{last}.crc"  # Hadoop's checksum of it would block the rewrite
    if crc.exists():
        os.remove(crc)
    before = set(fast.data_files())
    assert fast.run() is None
    assert DeltaTable(fast.target).version() == version
    assert set(fast.data_files()) == before
    after = fast.record_store().events(fast.sink_state().sink_id)
    # the replay allocated an id and confirmed phase 2: no new record
    assert len(fast.sink_state().records) == 5
    assert len(after) <= events + 3
    assert (commits / str(last)).exists()
    _check(fast)


def test_a_new_run_takes_the_epoch(fast):
    fast.total = 2000
    assert fast.run() is None
    first = fast.sink_state()
    fast.total = 4000
    assert fast.run() is None
    second = fast.sink_state()
    assert second.epoch > first.epoch and second.epoch_owner != first.epoch_owner
    _check(fast)


def test_unsupported_options_are_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match="partitionBy"):
        pyspark_txn.delta_batch_writer(
            path=str(tmp_path / "t"), checkpoint=str(tmp_path / "c"), partitionBy="x"
        )
    with pytest.raises(ConfigError, match="checkpoint="):
        pyspark_txn.delta_batch_writer(
            path=str(tmp_path / "t"), checkpoint=str(tmp_path / "c"), checkpointLocation="x"
        )
    with pytest.raises(ConfigError, match="unknown option"):
        pyspark_txn.delta_batch_writer(
            path=str(tmp_path / "t"), checkpoint=str(tmp_path / "c"), noSuchOption="1"
        )


def test_a_wrong_checkpoint_is_refused(spark, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    pq.write_table(pa.table({"id": pa.array(range(10), pa.int64())}), src / "a.parquet")
    other = tmp_path / "other"
    df = spark.readStream.schema("id long").parquet(str(src))
    pyspark_txn.process_available(
        df.writeStream.format("noop").option("checkpointLocation", str(other))
    )
    sink = pyspark_txn.delta_batch_writer(path=str(tmp_path / "t"), checkpoint=str(other))
    w = df.writeStream.foreachBatch(sink).option("checkpointLocation", str(tmp_path / "c"))
    with pytest.raises(Exception, match="belongs to query"):
        pyspark_txn.process_available(w)
    # a location Spark never wrote to (a typo): refused, nothing written there
    sink = pyspark_txn.delta_batch_writer(path=str(tmp_path / "t"), checkpoint=str(tmp_path / "x"))
    w = df.writeStream.foreachBatch(sink).option("checkpointLocation", str(tmp_path / "c2"))
    with pytest.raises(Exception, match="has no Spark metadata"):
        pyspark_txn.process_available(w)
    assert not (tmp_path / "t").exists() and not (tmp_path / "x").exists()


def test_a_jvm_file_source_exactly_once_through_a_fault(spark, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        ids = pa.array(range(i * 1000, (i + 1) * 1000), pa.int64())
        pq.write_table(pa.table({"id": ids, "v": pc.multiply(ids, 3)}), src / f"f{i}.parquet")
    target, chk = str(tmp_path / "t"), str(tmp_path / "c")

    def run(faults=None):
        df = (
            spark.readStream.schema("id long, v long")
            .option("maxFilesPerTrigger", 1)
            .parquet(str(src))
        )
        opts = {"faultInjection": faults} if faults else {}
        sink = pyspark_txn.delta_batch_writer(path=target, checkpoint=chk, **opts)
        w = df.writeStream.foreachBatch(sink).option("checkpointLocation", chk)
        pyspark_txn.process_available(w)

    with pytest.raises(Exception, match="injected fault"):
        run("after_record:raise@batch=2")
    run()
    got = DeltaTable(target).to_pyarrow_table().sort_by("id")
    assert got.column("id").to_pylist() == list(range(4000))
    assert got.column("v").to_pylist() == [3 * i for i in range(4000)]
    runner = PipelineRunner(spark, tmp_path)
    runner.target, runner.checkpoint = target, chk
    runner.assert_no_orphans()
    assert DeltaTable(target).transaction_version(runner.sink_state().sink_id) == 3


def test_every_type_round_trips_through_the_fast_path(spark, tmp_path):
    """test_types.py's matrix (extremes, NaN, -0.0, nulls, nested types) through Spark's
    parquet writer: delta-rs reads the same rows, and the stats take a filtered read."""
    from test_types import ROWS, assert_rows_equal, input_table

    src, target, chk = tmp_path / "in", str(tmp_path / "t"), str(tmp_path / "chk")
    os.makedirs(src)
    table = input_table()
    pq.write_table(table, src / "part-0.parquet")
    spark_schema = spark.read.parquet(str(src)).schema
    sink = pyspark_txn.delta_batch_writer(path=target, checkpoint=chk)
    pyspark_txn.process_available(
        spark.readStream.schema(spark_schema)
        .parquet(str(src))
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", chk)
    )
    delta = DeltaTable(target)
    got = delta.to_pyarrow_table()
    assert got.num_rows == len(ROWS)
    assert_rows_equal(got, table)
    filtered = delta.to_pyarrow_table(filters=[("f64", ">", 0.0)])
    assert filtered.column("id").to_pylist() == [1]
    back = spark.read.parquet(*delta.file_uris()).toArrow()
    assert_rows_equal(back.cast(got.schema) if back.schema != got.schema else back, table)


def test_an_empty_batch_commits_nothing_and_leaves_no_file(spark, tmp_path):
    """Spark writes a schema-only file for an empty batch: it is never committed and
    never left behind; the first (empty) batch still creates the table."""
    src = tmp_path / "src"
    src.mkdir()
    schema = pa.schema([pa.field("id", pa.int64())])
    pq.write_table(pa.table({"id": pa.array([], pa.int64())}, schema=schema), src / "a.parquet")
    target, chk = str(tmp_path / "t"), str(tmp_path / "c")

    def run():
        df = spark.readStream.schema("id long").option("maxFilesPerTrigger", 1).parquet(str(src))
        sink = pyspark_txn.delta_batch_writer(path=target, checkpoint=chk)
        pyspark_txn.process_available(
            df.writeStream.foreachBatch(sink).option("checkpointLocation", chk)
        )

    run()
    assert DeltaTable(target).to_pyarrow_table().num_rows == 0
    pq.write_table(pa.table({"id": pa.array(range(5), pa.int64())}), src / "b.parquet")
    run()
    runner = PipelineRunner(spark, tmp_path)
    runner.target, runner.checkpoint = target, chk
    assert sorted(DeltaTable(target).to_pyarrow_table().column("id").to_pylist()) == [0, 1, 2, 3, 4]
    runner.assert_no_orphans()
    runner.assert_records_consistent()
