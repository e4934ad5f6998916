"""The fast path (``delta_batch_writer`` in ``foreachBatch``): exactly-once under a
fault at every protocol step and a failed Spark write job, replays that write
nothing, and a JVM source. Real Spark, real Delta tables read back with delta-rs.

``exit`` faults would kill this test process (the callback runs in the driver),
so in-process cases use ``raise``; ``tests/e2e`` kills whole drivers.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable
from datetime import date
from pathlib import Path
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable
from pipeline_checks import PipelineRunner
from test_sink import drop_commit_log

import pyspark_txn
from pyspark_txn.errors import ConfigError
from pyspark_txn.sinks.staging import STAGING_ROOT

pytestmark = pytest.mark.spark


class FastRunner(PipelineRunner):
    """PipelineRunner's source and checks, the fast path as the sink."""

    fail_at_id: int | None = None  # a row id whose batch's Spark write job fails
    on_batch: Callable[[int], None] | None = None  # called before the sink, per batch

    def writer(self, faults: str | None = None, width: int = 0, **options):
        from pyspark.sql import functions as F

        # Spark's writer for every batch: the small-batch route has test_fast_small.py
        options.setdefault("smallBatchRows", 0)
        sink = pyspark_txn.delta_batch_writer(
            path=self.target, checkpoint=self.checkpoint, **self.sink_options(faults, options)
        )
        fail_at, on_batch = self.fail_at_id, self.on_batch

        def batch(bdf, batch_id):
            if on_batch is not None:
                on_batch(batch_id)
            if fail_at is not None:  # fails inside the executors' write tasks
                bdf = bdf.filter(F.assert_true(F.col("id") != F.lit(fail_at)).isNull())
            sink(bdf, batch_id)

        w = self.source(width).writeStream.foreachBatch(batch)
        return w.option("checkpointLocation", self.checkpoint)


# Partition columns of the partitioned runs: a string column with the values Spark's
# folder names cannot tell apart by themselves ('' and the text of Hive's null folder
# name, besides null), escaped characters and unicode; a negative integer.
_S = [None, None, "a/b=%c?#", "é 日本 😀", "__HIVE_DEFAULT_PARTITION__"]
PARTITIONS = {
    "s": (
        "CASE id % 5 WHEN 0 THEN '' WHEN 1 THEN NULL WHEN 2 THEN 'a/b=%c?#' "
        "WHEN 3 THEN 'é 日本 😀' ELSE '__HIVE_DEFAULT_PARTITION__' END",
        lambda i: _S[i % 5],
    ),
    "n": ("CAST(id % 3 - 1 AS INT)", lambda i: i % 3 - 1),
}


@pytest.fixture
def fast(spark, tmp_path):
    return FastRunner(spark, tmp_path)


@pytest.fixture(params=[False, True], ids=["flat", "partitioned"])
def layout(request, fast):
    """The fast path runner, unpartitioned and partitioned by PARTITIONS."""
    if request.param:
        fast.partitions = PARTITIONS
    return fast


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
    # written in place by Spark's writer: each batch's files in a folder of the table
    # named after its attempt (nothing renamed), nothing but data files there
    root = Path(fast.target)
    files = [
        Path(u.removeprefix("file://")).relative_to(root)
        for u in DeltaTable(fast.target).file_uris()
    ]
    assert files and all(f.parts[0].startswith(f"part-{state.sink_id}-") for f in files)
    assert all(f.name.startswith("part-0") and len(f.parts) == 2 for f in files)
    assert {f.parts[0] for f in files} == {
        p.name for p in root.iterdir() if p.name not in ("_delta_log", STAGING_ROOT)
    }
    assert len({f.parts[0] for f in files}) == 5  # one folder per batch
    assert not any(p.name.endswith(".crc") for p in root.rglob("*"))


CASES = [
    "allocate:raise",  # (allocation knows no batch id)
    "phase1:raise@snapshot=2",
    "mid_phase1:raise@batch=1",  # some of Spark's files in the table, the rest not yet
    "before_record:raise@batch=1",
    "after_record:raise@batch=1",
    "after_phase2:raise@batch=2",
    "after_commit:raise@batch=3",
]


# Flat, the steps test_a_fault_at_every_step_in_one_pipeline (bounded, flat) fails are
# slow-only here; every step keeps its own partitioned case in the bounded set.
_COVERED_FLAT = {"phase1", "before_record", "after_record", "after_phase2", "after_commit"}


def _layout_cases():
    for fault in CASES:
        for partitioned in (False, True):
            slow = not partitioned and fault.partition(":")[0] in _COVERED_FLAT
            yield pytest.param(
                partitioned,
                fault,
                id=f"{'partitioned' if partitioned else 'flat'}-{fault}",
                marks=[pytest.mark.slow] if slow else [],
            )


@pytest.mark.parametrize(("layout", "fault"), list(_layout_cases()), indirect=["layout"])
def test_fault_then_restart_is_exactly_once(layout, fault):
    failure = layout.run(fault)
    assert failure is not None, "the injected fault must fail the query"
    assert "injected fault" in str(failure)
    assert layout.run() is None
    _check(layout)


def test_a_failed_spark_write_job_then_restart_is_exactly_once(layout):
    layout.fail_at_id = 2500  # in batch 2
    failure = layout.run()
    assert failure is not None
    layout.fail_at_id = None
    assert layout.run() is None
    _check(layout)
    state = layout.sink_state()
    assert state.abandoned, "the failed attempt was abandoned"


def test_a_fault_at_every_step_in_one_pipeline(fast):
    fast.total = 7000
    for fault in [
        "after_record:raise@batch=0",
        "after_phase2:raise@batch=1",
        "phase1:raise@batch=2",  # not a snapshot id: those depend on timing
        "before_record:raise@batch=3",
        "after_commit:raise@batch=4",
    ]:
        assert fast.run(fault) is not None, fault
    fast.fail_at_id = 5500
    assert fast.run() is not None
    fast.fail_at_id = None
    assert fast.run() is None
    _check(fast)


def _replay_last_batch(runner: FastRunner, **options) -> None:
    """Run the last batch again (Spark forgot it finished it): its Spark write job would
    fail, so the run passes only if the write never runs."""
    drop_commit_log(runner.checkpoint, runner.total // runner.per_batch - 1)
    runner.fail_at_id = runner.total - 1
    try:
        assert runner.run(**options) is None
    finally:
        runner.fail_at_id = None


def test_a_replayed_batch_writes_nothing(fast):
    assert fast.run() is None
    version = DeltaTable(fast.target).version()
    events = len(fast.record_store().events(fast.sink_state().sink_id))
    commits = Path(fast.checkpoint) / "commits"
    last = max(int(p.name) for p in commits.iterdir() if p.name.isdigit())
    before = set(fast.data_files())
    _replay_last_batch(fast)
    assert DeltaTable(fast.target).version() == version
    assert set(fast.data_files()) == before
    after = fast.record_store().events(fast.sink_state().sink_id)
    # the replay allocated an id and confirmed phase 2: no new record
    assert len(fast.sink_state().records) == 5
    assert len(after) <= events + 3
    assert (commits / str(last)).exists()
    _check(fast)


def test_a_new_run_takes_the_epoch(fast):
    _a_new_run_takes_the_epoch(fast)


def _a_new_run_takes_the_epoch(runner: FastRunner) -> None:
    runner.total = 2000
    assert runner.run() is None
    first = runner.sink_state()
    runner.total = 4000
    assert runner.run() is None
    second = runner.sink_state()
    assert second.epoch > first.epoch and second.epoch_owner != first.epoch_owner
    _check(runner)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"rowGroupRows": "10"}, "rowGroupRows"),
        ({"checkpointLocation": "x"}, "checkpoint="),
        ({"noSuchOption": "1"}, "unknown option"),
        ({"partitionBy": "a,a"}, "repeats a column"),
        # as txn-delta refuses them
        ({"mode": "light", "recordTable": "/r"}, "recordTable applies to mode=snapshots only"),
        ({"mode": "light", "retainSnapshots": "3"}, "retainSnapshots applies to mode=snapshots"),
        ({"mode": "fast"}, "expected one of snapshots, light"),
    ],
)
def test_unsupported_options_are_refused_by_name(tmp_path, options, message):
    with pytest.raises(ConfigError, match=message):
        pyspark_txn.delta_batch_writer(
            path=str(tmp_path / "t"), checkpoint=str(tmp_path / "c"), **options
        )


@pytest.mark.parametrize(
    ("partition_by", "message"),
    [("nope", "columns ['nope'] are not in the stream"), ("id,value", "at least one column")],
)
def test_bad_partition_columns_fail_before_anything_is_written(fast, partition_by, message):
    failure = fast.run(partitionBy=partition_by)
    assert failure is not None and message in str(failure)
    assert not os.path.exists(fast.target)
    assert not os.path.exists(os.path.join(fast.checkpoint, "pyspark_txn"))


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


@pytest.mark.parametrize("partition_by", [None, "p"])
def test_an_empty_batch_commits_nothing_and_leaves_no_file(spark, tmp_path, partition_by):
    """Spark writes a schema-only file for an empty batch (none if partitioned): it is
    never committed and never left behind; the first (empty) batch still creates the
    table."""
    src = tmp_path / "src"
    src.mkdir()

    def rows(ids):
        ids = pa.array(ids, pa.int64())
        return pa.table({"id": ids, "p": pc.cast(pc.bit_wise_and(ids, 1), pa.string())})

    pq.write_table(rows([]), src / "a.parquet")
    target, chk = str(tmp_path / "t"), str(tmp_path / "c")
    options = {"partitionBy": partition_by} if partition_by else {}

    def run():
        df = spark.readStream.schema("id long, p string").option("maxFilesPerTrigger", 1)
        sink = pyspark_txn.delta_batch_writer(path=target, checkpoint=chk, **options)
        pyspark_txn.process_available(
            df.parquet(str(src)).writeStream.foreachBatch(sink).option("checkpointLocation", chk)
        )

    run()
    assert DeltaTable(target).to_pyarrow_table().num_rows == 0
    assert DeltaTable(target).metadata().partition_columns == ([partition_by] if options else [])
    pq.write_table(rows(range(5)), src / "b.parquet")
    run()
    runner = PipelineRunner(spark, tmp_path)
    runner.target, runner.checkpoint = target, chk
    got = DeltaTable(target).to_pyarrow_table().sort_by("id")
    assert got.select(["id", "p"]).equals(rows(range(5)))
    runner.assert_no_orphans()
    runner.assert_records_consistent()


# --- partitioned tables ----------------------------------------------------------------

# Every character Spark escapes in folder names, others it does not, unicode, the empty
# string, null, and texts that look like escapes or Hive's null (not NUL: Spark cannot
# make a folder with it, and fails the batch).
STRINGS = [
    *"/:%=?#' \"\\{[]^*", "a b", "%41", "x=y/z", "C:\\t", "é", "日本", "😀", "\t\n\x01\x7f",
    "~!@$&()+,;<>|`", "", None, "__HIVE_DEFAULT_PARTITION__", "null", ".", "..", "-",
]  # fmt: skip


def _log_adds(target: str) -> list[dict]:
    """Every add action in the table's log, as written."""
    log_dir = Path(target) / "_delta_log"
    return [
        action["add"]
        for f in sorted(log_dir.glob("*.json"))
        for line in f.read_text().splitlines()
        if "add" in (action := json.loads(line))
    ]


def _folders(target: str) -> set[str]:
    root = Path(target)
    return {
        str(p.parent.relative_to(root))
        for p in root.rglob("*.parquet")
        if p.relative_to(root).parts[0] not in ("_delta_log", STAGING_ROOT)
    }


def test_partition_values_and_folders_are_txn_delta_s(spark, tmp_path):
    """The same rows through txn-delta and the fast path: the same partitionValues in
    the log, a folder per partition on disk, the same rows read back."""
    n = len(STRINGS)
    longs = [-(2**63), -1, 0, 7, 2**40, None]
    dates = [date(1, 1, 1), date(2024, 2, 29), date(9999, 12, 31), date(1582, 10, 4), None]
    bools = [True, False, None]
    table = pa.table(
        {
            "id": pa.array(range(n), pa.int64()),
            "s": pa.array(STRINGS, pa.string()),
            "n": pa.array([longs[i % len(longs)] for i in range(n)], pa.int64()),
            "d": pa.array([dates[i % len(dates)] for i in range(n)], pa.date32()),
            "b": pa.array([bools[i % len(bools)] for i in range(n)], pa.bool_()),
            "i": pa.array([-i for i in range(n)], pa.int32()),
        }
    )
    src = tmp_path / "src"
    src.mkdir()
    pq.write_table(table, src / "a.parquet")
    schema = spark.read.parquet(str(src)).schema
    parts = "s,n,d,b,i"
    targets = {}
    for kind in ("fast", "txn"):
        target, chk = str(tmp_path / kind), str(tmp_path / f"chk-{kind}")
        w = spark.readStream.schema(schema).parquet(str(src)).writeStream
        if kind == "fast":
            w = w.foreachBatch(
                pyspark_txn.delta_batch_writer(
                    path=target, checkpoint=chk, partitionBy=parts, smallBatchRows=0
                )
            )
        else:
            w = w.format("txn-delta").option("path", target).option("partitionBy", parts)
        pyspark_txn.process_available(w.option("checkpointLocation", chk))
        targets[kind] = target
    fast_adds, txn_adds = _log_adds(targets["fast"]), _log_adds(targets["txn"])
    parts_list = parts.split(",")

    def values(adds):
        return sorted(json.dumps(a["partitionValues"], sort_keys=True) for a in adds)

    assert values(fast_adds) == values(txn_adds)
    assert len(set(values(fast_adds))) == n  # a folder per row (i is unique)
    # Spark wrote the files in place: in the attempt's folder, one c=v/ folder per
    # partition column below it (Spark's names: the values come from the log)
    tops = {unquote(a["path"]).split("/", 1)[0] for a in fast_adds}
    assert len(tops) == 1 and next(iter(tops)).startswith("part-")
    folders = _folders(targets["fast"])
    assert len(folders) == n
    for folder in folders:
        top, *sub = folder.split("/")
        assert top in tops and [p.split("=", 1)[0] for p in sub] == parts_list
    assert len(_folders(targets["txn"])) == n
    got = DeltaTable(targets["fast"]).to_pyarrow_table().sort_by("id")
    want = DeltaTable(targets["txn"]).to_pyarrow_table().sort_by("id")
    assert got.select(want.column_names).equals(want)
    assert got.column("s").to_pylist() == [v or None for v in STRINGS]  # '' is null
    assert got.select(["n", "d", "b", "i"]).equals(table.select(["n", "d", "b", "i"]))
    for add in fast_adds:  # stats of the file's columns only; the files are the fast path's
        stats = json.loads(add["stats"])
        assert set(stats["nullCount"]) == {"id"} and set(stats["minValues"]) == {"id"}
        assert pq.read_schema(os.path.join(targets["fast"], unquote(add["path"]))).names == ["id"]
    runner = PipelineRunner(spark, tmp_path)
    runner.target, runner.checkpoint = targets["fast"], str(tmp_path / "chk-fast")
    runner.assert_no_orphans()
    runner.assert_records_consistent()
    (record,) = runner.sink_state().records.values()
    assert record.target["partition_by"] == parts.split(",")
    assert all(t.meta["partition_values"] for t in record.txns)


# --- light mode ----------------------------------------------------------------------


def _check_light(runner: FastRunner) -> None:
    runner.assert_exactly_once()
    runner.assert_no_orphans()
    assert not os.path.exists(os.path.join(runner.checkpoint, "pyspark_txn", "records"))
    history = DeltaTable(runner.target).history()
    assert {h.get("pyspark_txn.mode") for h in history if "pyspark_txn.sink_id" in h} == {"light"}


@pytest.mark.parametrize(
    ("fault", "partitioned"),
    [
        ("phase1:raise@batch=2", False),
        ("mid_phase1:raise@batch=1", True),
        ("after_phase2:raise@batch=1", True),  # the table holds the batch: files stay
        ("after_commit:raise@batch=3", False),
    ],
)
def test_light_mode_fault_then_restart_is_exactly_once(fast, fault, partitioned):
    if partitioned:
        fast.partitions = PARTITIONS
    failure = fast.run(fault, mode="light")
    assert failure is not None and "injected fault" in str(failure)
    assert fast.run(mode="light") is None
    _check_light(fast)


def test_light_mode_failed_spark_write_job_then_restart(fast):
    fast.partitions = PARTITIONS
    fast.fail_at_id = 2500
    assert fast.run(mode="light") is not None
    fast.fail_at_id = None
    assert fast.run(mode="light") is None
    _check_light(fast)


def test_light_mode_replayed_batch_writes_nothing(fast):
    fast.partitions = PARTITIONS
    assert fast.run(mode="light") is None
    version = DeltaTable(fast.target).version()
    before = set(fast.data_files())
    _replay_last_batch(fast, mode="light")
    assert DeltaTable(fast.target).version() == version
    assert set(fast.data_files()) == before
    _check_light(fast)


def test_a_checkpoint_keeps_its_mode(fast):
    fast.total = 1000
    assert fast.run(mode="light") is None
    fast.total = 2000
    failure = fast.run()
    assert failure is not None and "ran with mode=light" in str(failure)
    fast.assert_exactly_once(1000)
    assert fast.run(mode="light") is None
    _check_light(fast)


# --- several queries in one driver --------------------------------------------------------


def _run_together(*runners: PipelineRunner) -> None:
    """Start every query from this thread, as a driver does (a txn-delta query started
    from another Python thread does not find its data source), then wait for all."""
    queries = [r.writer().trigger(availableNow=True).start() for r in runners]
    for q in queries:
        q.awaitTermination()


def _check_one_run(runner: PipelineRunner) -> None:
    """Exactly once, and written by one run from start to end: nothing fenced it."""
    _check(runner)
    state = runner.sink_state()
    assert state.epoch == 1
    assert {r.run_id for r in state.records.values()} == {state.epoch_owner}


def test_two_fast_path_queries_in_one_driver(spark, tmp_path):
    """Both callbacks run at the same moment (twice): each reads its own run and batch
    from its own thread's job description, and neither fences the other."""
    a = FastRunner(spark, tmp_path / "a", total=2000, per_batch=500)
    b = FastRunner(spark, tmp_path / "b", total=2000, per_batch=500)
    b.partitions = PARTITIONS
    meet = threading.Barrier(2, timeout=300)

    def both_in_a_callback(batch_id: int) -> None:
        if batch_id in (0, 2):
            meet.wait()

    a.on_batch = b.on_batch = both_in_a_callback
    _run_together(a, b)
    _check_one_run(a)
    _check_one_run(b)
    assert a.sink_state().sink_id != b.sink_state().sink_id


def test_a_fast_path_and_a_txn_delta_query_in_one_driver(spark, tmp_path):
    a = FastRunner(spark, tmp_path / "fast", total=2000, per_batch=500)
    b = PipelineRunner(spark, tmp_path / "txn", total=2000, per_batch=500)
    a.partitions = b.partitions = PARTITIONS
    _run_together(a, b)
    _check_one_run(a)
    _check_one_run(b)


# --- misuse a user can fall into (found by a new-user trial) ---------------------------


def _file_source(spark, tmp_path, files: int = 3, rows: int = 100, extra: str = ""):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(files):
        ids = pa.array(range(i * rows, (i + 1) * rows), pa.int64())
        pq.write_table(pa.table({"id": ids}), src / f"f{i}.parquet")
    return spark.readStream.schema("id long").option("maxFilesPerTrigger", 1).parquet(str(src))


def test_unknown_options_name_the_fast_path_s_own_options(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"delta_batch_writer: unknown option 'partitonBy' \(did you mean partitionBy\?\)",
    ) as e:
        pyspark_txn.delta_batch_writer(
            path=str(tmp_path / "t"), checkpoint=str(tmp_path / "c"), partitonBy="a"
        )
    listed = str(e.value).split("allowed", 1)[1]
    assert (
        "rowGroupRows" not in listed
        and "checkpointLocation" not in listed
        and "path," not in listed
    )


def test_two_writers_on_one_checkpoint_are_refused_not_dropped(spark, tmp_path):
    """A foreachBatch writing two tables through two writers of one checkpoint: the second
    would take each batch for a replay of the first's and drop it."""
    chk = str(tmp_path / "c")
    evens = pyspark_txn.delta_batch_writer(path=str(tmp_path / "evens"), checkpoint=chk)
    odds = pyspark_txn.delta_batch_writer(path=str(tmp_path / "odds"), checkpoint=chk)

    def both(df, batch_id):
        evens(df.where("id % 2 = 0"), batch_id)
        odds(df.where("id % 2 = 1"), batch_id)

    w = _file_source(spark, tmp_path).writeStream.foreachBatch(both)
    with pytest.raises(Exception, match="one checkpoint's sink writes one table"):
        pyspark_txn.process_available(w.option("checkpointLocation", chk))
    assert not os.path.exists(tmp_path / "odds" / "_delta_log")


def test_a_second_call_for_one_batch_is_refused_not_dropped(spark, tmp_path):
    chk = str(tmp_path / "c")
    sink = pyspark_txn.delta_batch_writer(path=str(tmp_path / "t"), checkpoint=chk)

    def twice(df, batch_id):
        sink(df.where("id % 2 = 0"), batch_id)
        sink(df.where("id % 2 = 1"), batch_id)

    w = _file_source(spark, tmp_path).writeStream.foreachBatch(twice)
    with pytest.raises(Exception, match="called a second time for batch 0"):
        pyspark_txn.process_available(w.option("checkpointLocation", chk))


def test_a_restart_with_another_path_is_refused(spark, tmp_path):
    chk = str(tmp_path / "c")
    df = _file_source(spark, tmp_path)
    first = pyspark_txn.delta_batch_writer(path=str(tmp_path / "t1"), checkpoint=chk)
    pyspark_txn.process_available(
        df.writeStream.foreachBatch(first).option("checkpointLocation", chk)
    )
    (tmp_path / "src" / "f9.parquet").write_bytes((tmp_path / "src" / "f0.parquet").read_bytes())
    moved = pyspark_txn.delta_batch_writer(path=str(tmp_path / "t2"), checkpoint=chk)
    with pytest.raises(Exception, match=r"writes to .*t1 .*but this writer writes to .*t2"):
        pyspark_txn.process_available(
            df.writeStream.foreachBatch(moved).option("checkpointLocation", chk)
        )
    # refused before phase 1: no markers or files left in the other path (issue 23 item 16)
    assert not (tmp_path / "t2").exists() or list((tmp_path / "t2").rglob("*")) == []


def test_a_job_group_the_callback_sets_is_not_taken_for_the_run(spark, tmp_path):
    """Spark's job group is the run id's fallback only when it is Spark's (a UUID): a group
    of the user's would make every run the same and switch fencing off."""
    chk = str(tmp_path / "c")
    sink = pyspark_txn.delta_batch_writer(path=str(tmp_path / "t"), checkpoint=chk)

    def grouped(df, batch_id):
        df.sparkSession.sparkContext.setJobGroup("nightly", "nightly load")
        df.sparkSession.sparkContext.setJobDescription("my own description")
        sink(df, batch_id)

    w = _file_source(spark, tmp_path).writeStream.foreachBatch(grouped)
    with pytest.raises(Exception, match="run id of this batch is not visible"):
        pyspark_txn.process_available(w.option("checkpointLocation", chk))


def test_legacy_calendar_settings_of_the_session_do_not_reach_the_files(spark, tmp_path):
    """A Spark 2 leftover, datetimeRebaseModeInWrite=LEGACY, would write Julian dates that
    only Spark reads back right."""
    import datetime as dt

    chk, target = str(tmp_path / "c"), str(tmp_path / "t")
    days = [dt.date(1, 1, 1), dt.date(1500, 3, 1), dt.date(2024, 1, 1)]
    src = tmp_path / "src"
    src.mkdir()
    pq.write_table(pa.table({"id": [0, 1, 2], "d": pa.array(days, pa.date32())}), src / "f.parquet")
    sink = pyspark_txn.delta_batch_writer(path=target, checkpoint=chk)

    def legacy(df, batch_id):
        df.sparkSession.conf.set("spark.sql.parquet.datetimeRebaseModeInWrite", "LEGACY")
        sink(df, batch_id)

    df = spark.readStream.schema("id long, d date").parquet(str(src))
    pyspark_txn.process_available(
        df.writeStream.foreachBatch(legacy).option("checkpointLocation", chk)
    )
    got = DeltaTable(target).to_pyarrow_table().sort_by("id")
    assert got.column("d").to_pylist() == days


def test_a_table_recreated_empty_is_refused_not_written(fast):
    """Issue 23 trial, bug E, on the fast path: the target deleted and re-created empty
    between runs is refused (TargetGoneError) before Spark's write job stages anything."""
    from deltalake import write_deltalake

    fast.total = 3000
    assert fast.run() is None
    empty = DeltaTable(fast.target).to_pyarrow_table().slice(0, 0)
    shutil.rmtree(fast.target)
    write_deltalake(fast.target, empty)
    fast.total = 5000
    failure = fast.run()
    assert failure is not None and "TargetGoneError" in str(failure)
    assert "no longer holds this sink's batches up to 1" in str(failure)
    dt = DeltaTable(fast.target)
    assert dt.version() == 0 and dt.to_pyarrow_table().num_rows == 0
    assert not (Path(fast.target) / STAGING_ROOT).exists()


def test_session_settings_reach_no_nested_timestamp_and_are_restored(spark, tmp_path):
    """The fast path switches the session's datetime settings only for a schema with a
    date or timestamp; one nested in a struct counts (INT96 there would have no Delta
    stats and LEGACY would write Julian dates), and every setting the batch switched
    is the session's own again afterwards."""
    import datetime as dt

    chk, target = str(tmp_path / "c"), str(tmp_path / "t")
    stamps = [
        dt.datetime(1500, 3, 1, 12, tzinfo=dt.timezone.utc),
        dt.datetime(2024, 1, 1, 0, 0, 1, tzinfo=dt.timezone.utc),
    ]
    src = tmp_path / "src"
    src.mkdir()
    nested = pa.array([{"ts": t} for t in stamps], pa.struct([("ts", pa.timestamp("us", "UTC"))]))
    pq.write_table(pa.table({"id": [0, 1], "s": nested}), src / "f.parquet")
    sink = pyspark_txn.delta_batch_writer(path=target, checkpoint=chk)
    own = {
        "spark.sql.parquet.outputTimestampType": "INT96",
        "spark.sql.parquet.datetimeRebaseModeInWrite": "LEGACY",
        "spark.sql.parquet.int96RebaseModeInWrite": "LEGACY",
        "spark.sql.sources.commitProtocolClass": (
            "org.apache.spark.internal.io.HadoopMapReduceCommitProtocol"
        ),
    }
    after: dict[str, str | None] = {}

    def with_own_settings(df, batch_id):
        conf = df.sparkSession.conf
        for key, value in own.items():
            conf.set(key, value)
        conf.unset("spark.sql.parquet.output.committer.class")
        sink(df, batch_id)
        after.update({key: conf.get(key, None) for key in own})
        after["committer"] = conf.get("spark.sql.parquet.output.committer.class", None)

    df = spark.readStream.schema("id long, s struct<ts: timestamp>").parquet(str(src))
    pyspark_txn.process_available(
        df.writeStream.foreachBatch(with_own_settings).option("checkpointLocation", chk)
    )
    assert after == {**own, "committer": None}
    files = [f for f in Path(target).rglob("*.parquet")]
    assert files and all(pq.ParquetFile(f).schema.column(1).physical_type == "INT64" for f in files)
    got = DeltaTable(target).to_pyarrow_table().sort_by("id")
    assert [r["ts"] for r in got.column("s").to_pylist()] == stamps
