"""The fast path's small-batch route (issue 36 goal 2): a batch of at most
``smallBatchRows`` rows is collected to the driver (``toArrow``) and staged there with
txn-delta's own staging, then committed by the same protocol. Exactly-once under a fault
at every step and a failed probe job, replays that run nothing, light mode, batches that
switch between the two routes, stateful queries whose plan runs once per attempt, and the
tables kept open across batches. Real Spark, real Delta tables read back with delta-rs.

The crash cases of Spark's route are tests/spark/test_fast_path.py; kill -9 and driver
exits of this route: tests/e2e/test_fast_small_kill.py.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable
from pipeline_checks import PipelineRunner
from test_fast_path import (
    PARTITIONS,
    FastRunner,
    _a_new_run_takes_the_epoch,
    _check,
    _check_light,
    _replay_last_batch,
)

import pyspark_txn
from pyspark_txn import cli
from pyspark_txn.errors import ConfigError
from pyspark_txn.operations.handle import kept_sink_id
from pyspark_txn.storage import delta_tables

pytestmark = pytest.mark.spark

SMALL = 5000  # smallBatchRows of these tests: the runners' 1000-row batches are small


class SmallRunner(FastRunner):
    """The fast path with batches below ``smallBatchRows``."""

    def writer(self, faults: str | None = None, width: int = 0, **options):
        options.setdefault("smallBatchRows", SMALL)
        return super().writer(faults, width, **options)


@pytest.fixture
def small(spark, tmp_path):
    return SmallRunner(spark, tmp_path)


def _routes(target: str, sink_id: str) -> list[str]:
    """How each file of the table was staged: ``driver`` (txn-delta's layout: the file in
    the root or its ``c=v/`` folders, named after the attempt) or ``spark`` (in a folder
    of its own attempt, named by Spark)."""
    root = Path(target)
    routes = []
    for uri in DeltaTable(target).file_uris():
        *folders, name = Path(uri.removeprefix("file://")).relative_to(root).parts
        if any(f.startswith("part-") for f in folders):
            routes.append("spark")
        else:
            assert name.startswith(f"part-{sink_id}-") and all("=" in f for f in folders)
            routes.append("driver")
    return routes


def _assert_driver_staged(runner: PipelineRunner) -> None:
    routes = _routes(runner.target, runner.sink_state().sink_id)
    assert routes and set(routes) == {"driver"}, routes


def _record_routes(runner: PipelineRunner) -> list[str]:
    """The route of each recorded batch, in batch order (from its records' files)."""
    state = runner.sink_state()
    out = []
    for rec in sorted(state.records.values(), key=lambda r: r.batch_id):
        spark = {
            t.handle.split("/", 1)[0].startswith("part-") and "/" in t.handle for t in rec.txns
        }
        assert len(spark) <= 1, rec
        out.append("spark" if spark == {True} else "driver")
    return out


def test_small_batches_are_staged_from_the_driver_and_verify(small):
    assert small.run() is None
    _check(small)
    _assert_driver_staged(small)
    state = small.sink_state()
    assert [r.batch_id for r in sorted(state.records.values(), key=lambda r: r.batch_id)] == [
        0,
        1,
        2,
        3,
        4,
    ]
    assert all(r.run_id == state.epoch_owner and r.source_offsets for r in state.records.values())
    # every file a record names is there with its size and CRC32
    assert cli.main(["verify", small.checkpoint]) == 0


def test_a_new_run_takes_the_epoch(small):
    _a_new_run_takes_the_epoch(small)


def test_a_fault_at_every_step_in_one_pipeline(small):
    small.total = 8000
    for fault in [
        "allocate:raise",
        "after_record:raise@batch=0",
        "after_phase2:raise@batch=1",
        "phase1:raise@batch=2",  # not a snapshot id: those depend on timing
        "before_record:raise@batch=3",
        "after_commit:raise@batch=4",
        "mid_phase1:raise@batch=5",
    ]:
        failure = small.run(fault)
        assert failure is not None and "injected fault" in str(failure), fault
    small.fail_at_id = 6500  # a task of batch 6's probe job fails
    assert small.run() is not None
    small.fail_at_id = None
    assert small.run() is None
    _check(small)
    _assert_driver_staged(small)
    assert small.sink_state().abandoned, "the failed attempts were abandoned"


CASES = [
    "allocate:raise",
    "phase1:raise@snapshot=2",
    "mid_phase1:raise@batch=1",  # collected and staged, nothing returned
    "before_record:raise@batch=1",
    "after_record:raise@batch=1",
    "after_phase2:raise@batch=2",
    "after_commit:raise@batch=3",
]


@pytest.mark.parametrize(
    "fault",
    [
        pytest.param(f, marks=[] if f.startswith("mid_phase1") else [pytest.mark.slow])
        for f in CASES
    ],
)
def test_partitioned_fault_then_restart_is_exactly_once(small, fault):
    """Partitioned by a string column with '', null, escaped characters, unicode and
    Hive's null text, and a negative integer: the driver writes txn-delta's folders."""
    small.partitions = PARTITIONS
    failure = small.run(fault)
    assert failure is not None and "injected fault" in str(failure)
    assert small.run() is None
    _check(small)
    _assert_driver_staged(small)


@pytest.mark.slow
def test_partitioned_failed_probe_job_then_restart(small):
    small.partitions = PARTITIONS
    small.fail_at_id = 2500
    assert small.run() is not None
    small.fail_at_id = None
    assert small.run() is None
    _check(small)
    assert small.sink_state().abandoned


def test_a_replayed_batch_writes_nothing(small):
    """The last batch again: its probe job would fail, so the run passes only if no job
    of the batch runs."""
    assert small.run() is None
    version = DeltaTable(small.target).version()
    before = set(small.data_files())
    _replay_last_batch(small, smallBatchRows=SMALL)
    assert DeltaTable(small.target).version() == version
    assert set(small.data_files()) == before
    assert len(small.sink_state().records) == 5
    _check(small)


@pytest.mark.parametrize(
    ("fault", "partitioned"),
    [
        ("mid_phase1:raise@batch=1", True),
        pytest.param("phase1:raise@batch=2", False, marks=pytest.mark.slow),
        pytest.param("after_phase2:raise@batch=1", True, marks=pytest.mark.slow),
        pytest.param("after_commit:raise@batch=3", False, marks=pytest.mark.slow),
    ],
)
def test_light_mode_fault_then_restart_is_exactly_once(small, fault, partitioned):
    if partitioned:
        small.partitions = PARTITIONS
    failure = small.run(fault, mode="light")
    assert failure is not None and "injected fault" in str(failure)
    assert small.run(mode="light") is None
    _check_light(small)
    assert set(_routes(small.target, _light_sink_id(small))) == {"driver"}


def _light_sink_id(runner: PipelineRunner) -> str:
    (sink,) = {
        h["pyspark_txn.sink_id"]
        for h in DeltaTable(runner.target).history()
        if "pyspark_txn.sink_id" in h
    }
    return str(sink)


@pytest.mark.slow
def test_light_mode_replayed_batch_writes_nothing(small):
    assert small.run(mode="light") is None
    version = DeltaTable(small.target).version()
    before = set(small.data_files())
    _replay_last_batch(small, mode="light", smallBatchRows=SMALL)
    assert DeltaTable(small.target).version() == version
    assert set(small.data_files()) == before
    _check_light(small)


# --- the route of each batch -----------------------------------------------------------


def _sized_files(tmp_path: Path, sizes: list[int]) -> Path:
    """One parquet file per batch (maxFilesPerTrigger=1), of ``sizes`` rows, ids 0..; a
    second apart (the file source takes the oldest first)."""
    src = tmp_path / "src"
    src.mkdir()
    start, now = 0, time.time() - len(sizes)
    for i, n in enumerate(sizes):
        ids = pa.array(range(start, start + n), pa.int64())
        path = src / f"f{i:03d}.parquet"
        pq.write_table(pa.table({"id": ids}), path)
        os.utime(path, (now + i, now + i))
        start += n
    return src


@pytest.mark.parametrize(
    "fault",
    [
        "mid_phase1:raise@batch=1",  # the first large batch, after a small one
        pytest.param(None, marks=pytest.mark.slow),
        pytest.param("after_record:raise@batch=3", marks=pytest.mark.slow),  # small again
    ],
)
def test_batches_switch_routes_by_size(spark, tmp_path, fault):
    """smallBatchRows=100: a batch of 10 rows is collected; one of 500 is probed (101
    rows come to the driver) and written by Spark; the batch after a large one goes to
    Spark's writer unprobed, whatever its size; the next is probed again."""
    sizes = [10, 500, 10, 10, 500, 10]
    src = _sized_files(tmp_path, sizes)
    runner = PipelineRunner(spark, tmp_path, total=sum(sizes))
    target, chk = runner.target, runner.checkpoint

    def run(faults=None):
        options = {"smallBatchRows": 100, **({"faultInjection": faults} if faults else {})}
        sink = pyspark_txn.delta_batch_writer(path=target, checkpoint=chk, **options)
        df = spark.readStream.schema("id long").option("maxFilesPerTrigger", 1).parquet(str(src))
        pyspark_txn.process_available(
            df.writeStream.foreachBatch(sink).option("checkpointLocation", chk)
        )

    if fault is not None:
        with pytest.raises(Exception, match="injected fault"):
            run(fault)
    run()
    got = DeltaTable(target).to_pyarrow_table().sort_by("id")
    assert got.column("id").to_pylist() == list(range(sum(sizes)))
    runner.assert_no_orphans()
    runner.assert_records_consistent()
    # (a restart follows the last record's rows: after batch 0 or 3, 10 rows, the next
    # batch is probed as in a run without the fault)
    assert _record_routes(runner) == ["driver", "spark", "spark", "driver", "spark", "spark"]


# --- stateful queries ------------------------------------------------------------------


def test_a_stateful_batch_runs_once_whichever_route(spark, tmp_path):
    """A deduplication (state per id), batches on both sides of smallBatchRows: the batch's
    plan runs once per batch. A Python UDF after the state store notes every row it is
    run on in a file (a side effect, which a run cut short keeps, where an accumulator's
    updates would be lost with the task's unread output): each row once. A probe cut
    short by its limit, then a Spark write running the plan again, would note rows of a
    large batch twice."""
    from pyspark.sql import functions as F

    sizes = [10, 400, 10, 10, 400]
    src = _sized_files(tmp_path, sizes)
    noted = str(tmp_path / "udf-rows.txt")

    @F.udf("long")
    def counted(v):
        with open(noted, "a") as f:
            f.write(f"{v}\n")
        return v

    runner = PipelineRunner(spark, tmp_path, total=sum(sizes))
    target, chk = runner.target, runner.checkpoint
    sink = pyspark_txn.delta_batch_writer(path=target, checkpoint=chk, smallBatchRows=100)
    df = (
        spark.readStream.schema("id long")
        .option("maxFilesPerTrigger", 1)
        .parquet(str(src))
        .dropDuplicates(["id"])
        .select(counted(F.col("id")).alias("id"))
    )
    pyspark_txn.process_available(
        df.writeStream.foreachBatch(sink).option("checkpointLocation", chk)
    )
    assert os.path.isdir(os.path.join(chk, "state"))
    got = DeltaTable(target).to_pyarrow_table().sort_by("id")
    assert got.column("id").to_pylist() == list(range(sum(sizes)))
    with open(noted) as f:
        assert sorted(int(line) for line in f) == list(range(sum(sizes)))
    assert _record_routes(runner) == ["driver", "spark", "spark", "driver", "spark"]
    runner.assert_no_orphans()
    runner.assert_records_consistent()


def test_a_stateful_batch_spark_cannot_persist_goes_to_spark_s_writer(spark, tmp_path, caplog):
    """Spark 4.3 fails some persisted stateful batches as it plans them (a max() of a
    string by key: "key not found" in InMemoryRelation.withOutput; a new user's trial):
    they worked before the small route, and must still, on every batch and restart."""
    from pyspark.sql import functions as F

    src = tmp_path / "src"
    spark.range(0, 20).withColumn("pad", F.concat(F.lit("p"), F.col("id"))).coalesce(
        1
    ).write.parquet(str(src))
    chk, target = str(tmp_path / "chk"), str(tmp_path / "t")
    for _ in range(2):  # a restart: the new writer finds the same and does the same
        df = (
            spark.readStream.schema("id long, pad string")
            .parquet(str(src))
            .groupBy("id")
            .agg(F.max("pad").alias("m"))
        )
        sink = pyspark_txn.delta_batch_writer(path=target, checkpoint=chk, keys="id")
        with caplog.at_level("WARNING", logger="pyspark_txn.sinks.fast"):
            pyspark_txn.process_available(
                df.writeStream.outputMode("update")
                .foreachBatch(sink)
                .option("checkpointLocation", chk)
            )
        spark.range(20, 25).withColumn("pad", F.concat(F.lit("p"), F.col("id"))).write.mode(
            "append"
        ).parquet(str(src))
    got = {r["id"]: r["m"] for r in DeltaTable(target).to_pyarrow_table().to_pylist()}
    assert got == {i: f"p{i}" for i in range(25)}
    # at most once per writer (run): its later stateful batches are not probed again
    warned = [r for r in caplog.records if "could not be probed" in r.getMessage()]
    assert len(warned) <= 2, [r.getMessage() for r in warned]


def test_a_batch_the_caller_persisted_stays_persisted(spark, tmp_path):
    """The route persists a stateful batch for its probe and unpersists it after: not a
    batch the caller persisted itself (its own second write would run the plan again)."""
    from pyspark.sql import functions as F

    src = _sized_files(tmp_path, [10, 10])
    chk, target = str(tmp_path / "chk"), str(tmp_path / "t")
    other = str(tmp_path / "copy")
    sink = pyspark_txn.delta_batch_writer(path=target, checkpoint=chk)
    cached_after: list[bool] = []

    def persisted(df, batch_id):
        df.persist()
        sink(df, batch_id)
        level = df.storageLevel
        cached_after.append(level.useMemory or level.useDisk)
        df.write.mode("append").parquet(other)
        df.unpersist()

    df = (
        spark.readStream.schema("id long")
        .option("maxFilesPerTrigger", 1)
        .parquet(str(src))
        .groupBy((F.col("id") % 3).alias("k"))
        .count()
    )
    pyspark_txn.process_available(
        df.writeStream.outputMode("complete")
        .foreachBatch(persisted)
        .option("checkpointLocation", chk)
    )
    assert cached_after == [True, True]
    got = {r["k"]: r["count"] for r in DeltaTable(target).to_pyarrow_table().to_pylist()}
    assert got == {0: 7, 1: 7, 2: 6}


def test_rows_too_wide_for_the_driver_go_to_spark_s_writer(spark, tmp_path, caplog):
    """A probe over ``spark.driver.maxResultSize`` (10,000 rows of 100 KB are 1 GB) must
    not fail a batch that Spark's writer takes: it failed, and at every restart again.
    The batch and the writer's later ones go to Spark's writer, each row once."""
    src = _sized_files(tmp_path, [600, 600, 600])
    chk, target = str(tmp_path / "chk"), str(tmp_path / "t")
    sink = pyspark_txn.delta_batch_writer(path=target, checkpoint=chk)
    conf = spark.sparkContext._jsc.sc().conf()  # (the live SparkConf the scheduler reads)
    conf.set("spark.driver.maxResultSize", "1m")  # 600 rows of 2 KB are over it
    try:
        df = (
            spark.readStream.schema("id long")
            .option("maxFilesPerTrigger", 1)
            .parquet(str(src))
            .selectExpr("id", "repeat('x', 2000) AS s")
        )
        with caplog.at_level("WARNING", logger="pyspark_txn.sinks.fast"):
            pyspark_txn.process_available(
                df.writeStream.foreachBatch(sink).option("checkpointLocation", chk)
            )
    finally:
        conf.remove("spark.driver.maxResultSize")
    ids = DeltaTable(target).to_pyarrow_table().column("id").to_pylist()
    assert sorted(ids) == list(range(1800))
    assert set(_routes(target, kept_sink_id(chk) or "")) == {"spark"}
    warned = [r.getMessage() for r in caplog.records if "maxResultSize" in r.getMessage()]
    assert len(warned) == 1 and "lower smallBatchRows" in warned[0], warned  # probed once


# --- the tables stay open ----------------------------------------------------------------


def test_the_tables_stay_open_across_batches(spark, tmp_path):
    """The callback runs on one thread (Spark's stream thread's callback), so this
    thread's cached Delta tables (storage.delta_tables) serve every batch: the target and
    the record table are the same objects from batch to batch, caught up, never
    re-opened from scratch (the hand-written loop opens the table every batch)."""
    runner = SmallRunner(spark, tmp_path, total=8000)
    records = os.path.join(runner.checkpoint, "pyspark_txn", "records")
    seen: list[tuple[int, dict[str, int]]] = []
    sink = pyspark_txn.delta_batch_writer(
        path=runner.target, checkpoint=runner.checkpoint, smallBatchRows=SMALL
    )

    def batch(df, batch_id):
        sink(df, batch_id)
        tables = {
            key[0]: id(entry[0])
            for key, entry in delta_tables._tables().items()
            if key[0] in (runner.target, records)
        }
        seen.append((threading.get_ident(), tables))

    w = runner.source().writeStream.foreachBatch(batch)
    pyspark_txn.process_available(w.option("checkpointLocation", runner.checkpoint))
    runner.assert_exactly_once()
    assert len(seen) == 8 and len({t for t, _ in seen}) == 1
    later = [tables for _, tables in seen[1:]]  # (batch 0 creates the target)
    assert all(set(t) == {runner.target, records} for t in later), later
    assert all(t == later[0] for t in later), later


def test_a_steady_run_builds_each_probe_while_the_driver_checks(spark, tmp_path):
    """From a run's second small batch on, the probe DataFrame is built on another
    thread while the callback's thread checks and allocates (_probe_ahead), and that
    probe is the one collected; the first batch of a run builds its own."""
    runner = SmallRunner(spark, tmp_path, total=6000)
    sink = pyspark_txn.delta_batch_writer(
        path=runner.target, checkpoint=runner.checkpoint, smallBatchRows=SMALL
    )
    ahead: list[bool] = []
    collected: list[bool] = []
    probe_ahead, collect_small = sink._probe_ahead, sink._collect_small

    def spy_ahead(df, batch_id):
        future = probe_ahead(df, batch_id)
        ahead.append(future is not None)
        return future

    def spy_collect(df, stateful, ahead_probe=None):
        collected.append(ahead_probe is not None)
        return collect_small(df, stateful, ahead_probe)

    sink._probe_ahead, sink._collect_small = spy_ahead, spy_collect
    w = runner.source().writeStream.foreachBatch(sink)
    pyspark_txn.process_available(w.option("checkpointLocation", runner.checkpoint))
    _check(runner)
    _assert_driver_staged(runner)
    assert ahead == [False] + [True] * 5, ahead
    assert collected == ahead


# --- the option ----------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["-1", "1.5", "ten", "", "1e3", str(2**31 - 1), "10" * 7])
def test_a_bad_small_batch_rows_is_refused(tmp_path, value):
    with pytest.raises(
        ConfigError, match=r"option smallBatchRows=.*a whole number of rows from 0 to 2147483646"
    ):
        pyspark_txn.delta_batch_writer(
            path=str(tmp_path / "t"), checkpoint=str(tmp_path / "c"), smallBatchRows=value
        )


def test_small_batch_rows_is_a_known_option(tmp_path):
    with pytest.raises(ConfigError, match=r"did you mean smallBatchRows\?"):
        pyspark_txn.delta_batch_writer(
            path=str(tmp_path / "t"), checkpoint=str(tmp_path / "c"), smallBatchRow="10"
        )


def test_zero_sends_every_batch_to_spark_s_writer(spark, tmp_path):
    runner = FastRunner(spark, tmp_path, total=2000)
    assert runner.run(smallBatchRows=0) is None
    _check(runner)
    assert set(_record_routes(runner)) == {"spark"}
