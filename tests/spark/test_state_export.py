"""Exporting the operator state of stateful queries as Delta tables (``state/`` of a snapshot).

Real Spark queries into the ``txn-delta`` sink; the exported tables are read
back with delta-rs (and their files with Spark's plain parquet reader, no
Delta jars) and compared with what is expected from the generated input and
with what Spark's ``statestore`` reader returns.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections import Counter
from datetime import datetime, timezone

import pytest
from deltalake import DeltaTable
from pyspark.sql import functions as F

from pyspark_txn.errors import ConfigError
from pyspark_txn.operations import state_export
from pyspark_txn.operations.state_export import StateTable, export_state, has_state

pytestmark = pytest.mark.spark

ROWS_PER_BATCH = 20
TOTAL_ROWS = 80
FIRST_ID = 20  # batch 0 is filtered out entirely: its state is empty


def _sequence(spark, rows_per_batch=ROWS_PER_BATCH, total=TOTAL_ROWS):
    return (
        spark.readStream.format("txn-sequence")
        .option("rowsPerBatch", rows_per_batch)
        .option("totalRows", total)
        .load()
    )


def _run(df, chk, target):
    q = (
        df.writeStream.format("txn-delta")
        .option("checkpointLocation", chk)
        .option("path", target)
        .trigger(availableNow=True)
        .start()
    )
    q.awaitTermination()
    assert q.exception() is None
    return q


def _end_index(q) -> dict[int, int]:
    """Batch id -> the sequence index the batch read up to (Spark's end offset)."""
    ends = {}
    for p in q.recentProgress:
        offset = p["sources"][0]["endOffset"]
        ends[p["batchId"]] = (json.loads(offset) if isinstance(offset, str) else offset)["index"]
    return ends


def _keys(end: int) -> list[int]:
    return sorted({i // 3 for i in range(FIRST_ID, end)})


def _window_state(end: int) -> dict[datetime, tuple[int, int]]:
    """Window start -> (rows, sum of keys) of the deduplicated rows up to ``end``."""
    out: dict[datetime, tuple[int, int]] = {}
    for k in _keys(end):
        start = datetime.fromtimestamp(3 * k // 30 * 30, tz=timezone.utc)
        n, s = out.get(start, (0, 0))
        out[start] = (n + 1, s + k)
    return out


def _rows(uri: str) -> list[dict]:
    return DeltaTable(uri).to_pyarrow_table().to_pylist()


def _spark_state(spark, chk, batch, table: StateTable) -> list[dict]:
    """Spark's own reader, as a user would call it, in the exported columns."""
    df = (
        spark.read.format("statestore")
        .option("batchId", batch)
        .option("operatorId", table.operator_id)
        .option("storeName", table.store_name)
        .load(chk)
    )
    return df.toArrow().to_pylist()


def _canon(rows, columns):
    return sorted(json.dumps([r[c] for c in columns], default=str, sort_keys=True) for r in rows)


@pytest.fixture(scope="module")
def stateful(spark, tmp_path_factory):
    """dropDuplicates, then a windowed aggregation: two stateful operators, several batches.

    The watermark delay (an hour) never evicts anything, so the state after a
    batch is exactly what the input up to it determines.
    """
    base = tmp_path_factory.mktemp("stateful")
    chk, target = str(base / "chk"), str(base / "target")
    df = (
        _sequence(spark)
        .where(F.col("id") >= FIRST_ID)
        .withColumn("key", (F.col("id") / 3).cast("long"))
        .withColumn("ts", F.timestamp_seconds(F.col("key") * 3))  # the same for a key's rows
        .withWatermark("ts", "1 hour")
        .dropDuplicates(["key"])
        .groupBy(F.window("ts", "30 seconds"))
        .agg(F.count("*").alias("n"), F.sum("key").alias("keys"))
    )
    q = _run(df, chk, target)
    ends = _end_index(q)
    assert ends[max(ends)] == TOTAL_ROWS and len(ends) >= 4, ends
    return chk, ends


def _by_name(tables: list[StateTable]) -> dict[str, StateTable]:
    return {t.operator_name: t for t in tables}


def test_export_of_a_stateful_aggregation_holds_each_operators_state(spark, stateful, tmp_path):
    chk, ends = stateful
    last = max(ends)
    to = str(tmp_path / "export")
    seen = []
    tables = export_state(spark, chk, last, to, progress=lambda d, t: seen.append((d, t)))
    assert seen == [(1, 2), (2, 2)]
    assert has_state(chk)
    by_name = _by_name(tables)
    assert set(by_name) == {"dedupe", "stateStoreSave"}
    dedupe, agg = by_name["dedupe"], by_name["stateStoreSave"]
    assert dedupe.path == f"state/{dedupe.operator_id}/default" and dedupe.store_name == "default"
    assert {t.operator_id for t in tables} == {0, 1} and all(t.partitions == 2 for t in tables)
    assert [StateTable.from_json(json.loads(json.dumps(t.to_json()))) for t in tables] == tables

    # dropDuplicates: exactly the distinct keys seen; its value (struct<__dummy__: void>)
    # has no Delta type and is dropped
    rows = _rows(os.path.join(to, dedupe.path))
    assert sorted(r["key"]["key"] for r in rows) == _keys(TOTAL_ROWS) and dedupe.rows == len(rows)
    assert set(rows[0]) == {"key", "partition_id"}
    spark_rows = _spark_state(spark, chk, last, dedupe)
    assert _canon(rows, ["key", "partition_id"]) == _canon(spark_rows, ["key", "partition_id"])

    # the windowed aggregation: per window the count and sum of its deduplicated rows,
    # the window as a struct of UTC timestamps
    rows = _rows(os.path.join(to, agg.path))
    got = {r["key"]["window"]["start"]: (r["value"]["count"], r["value"]["sum"]) for r in rows}
    assert got == _window_state(TOTAL_ROWS) and agg.rows == len(rows) == 3
    spark_rows = _spark_state(spark, chk, last, agg)
    columns = ["key", "value", "partition_id"]
    assert _canon(rows, columns) == _canon(spark_rows, columns)
    schema = DeltaTable(os.path.join(to, agg.path)).schema().to_arrow()
    assert [f.name for f in schema] == columns

    # Spark without any Delta package reads the files of both tables
    for t in tables:
        files = DeltaTable(os.path.join(to, t.path)).file_uris()
        df = spark.read.parquet(*files)
        assert df.count() == t.rows
        assert df.columns == (["key", "partition_id"] if t is dedupe else columns)


def test_an_earlier_batch_exports_that_batchs_state_row_by_row(spark, stateful, tmp_path):
    chk, ends = stateful
    for batch in (1, 2):
        to = str(tmp_path / f"b{batch}")
        by_name = _by_name(export_state(spark, chk, batch, to))
        keys = _keys(ends[batch])
        assert 0 < len(keys) < len(_keys(TOTAL_ROWS))
        dedupe = _rows(os.path.join(to, by_name["dedupe"].path))
        assert sorted(r["key"]["key"] for r in dedupe) == keys
        assert _canon(dedupe, ["key", "partition_id"]) == _canon(
            _spark_state(spark, chk, batch, by_name["dedupe"]), ["key", "partition_id"]
        )
        agg = _rows(os.path.join(to, by_name["stateStoreSave"].path))
        got = {r["key"]["window"]["start"]: (r["value"]["count"], r["value"]["sum"]) for r in agg}
        assert got == _window_state(ends[batch])

    # batch 0 read only filtered-out rows: empty state still gives readable tables
    to = str(tmp_path / "b0")
    tables = export_state(spark, chk, 0, to)
    assert [t.rows for t in tables] == [0, 0]
    for t in tables:
        dt = DeltaTable(os.path.join(to, t.path))
        assert dt.to_pyarrow_table().num_rows == 0
        assert "key" in [f.name for f in dt.schema().to_arrow()]


def test_refusals_name_the_batch_and_write_nothing(spark, stateful, tmp_path):
    chk, ends = stateful
    last = max(ends)
    to = str(tmp_path / "refused")
    with pytest.raises(
        ConfigError, match=rf"batch {last + 5} is not committed.*last committed batch is {last}"
    ):
        export_state(spark, chk, last + 5, to)
    # the batch right after the last committed one is waited for, then refused
    with pytest.raises(ConfigError, match=rf"has not finished batch {last + 1}"):
        export_state(spark, chk, last + 1, to, wait_s=0.3)
    with pytest.raises(ConfigError, match="batch id -1"):
        export_state(spark, chk, -1, to)
    # a stateful checkpoint needs Spark
    with pytest.raises(ConfigError, match="stateful.*needs a SparkSession"):
        export_state(None, chk, last, to)
    assert not os.path.exists(to)
    # an export never overwrites
    export_state(spark, chk, last, to)
    with pytest.raises(ConfigError, match="exists already"):
        export_state(spark, chk, last, to)


def test_stateless_query_has_no_state_to_export(spark, tmp_path):
    chk = str(tmp_path / "chk")
    _run(_sequence(spark, total=20), chk, str(tmp_path / "target"))
    assert os.path.isdir(os.path.join(chk, "commits"))
    assert not has_state(chk)
    for session in (spark, None):
        with pytest.raises(ConfigError, match="holds no operator state"):
            export_state(session, chk, 0, str(tmp_path / "export"))
    assert not has_state(str(tmp_path / "nowhere"))


def test_a_checkpoint_path_spark_cannot_read_state_from_is_refused_by_name(spark, tmp_path):
    """Spark's statestore reader looks for a checkpoint with a space in its path under
    the path percent-encoded and finds no committed batch; the package said the state
    "looked cleaned up" (helper trial, 2026-11-28)."""
    chk = str(tmp_path / "a b" / "chk")
    q = _run(_sequence(spark, total=40).dropDuplicates(["value"]), chk, str(tmp_path / "t"))
    to = str(tmp_path / "export")
    with pytest.raises(ConfigError, match="statestore reader does not find the state") as e:
        export_state(spark, chk, q.lastProgress["batchId"], to)
    assert "' '" in str(e.value) and "state='skip'" in str(e.value)
    assert not os.path.exists(to)


def test_state_older_than_the_retained_batches_is_refused(spark, tmp_path):
    chk = str(tmp_path / "chk")
    df = _sequence(spark, rows_per_batch=10, total=60).dropDuplicates(["value"])
    spark.conf.set("spark.sql.streaming.minBatchesToRetain", "2")
    try:
        q = _run(df, chk, str(tmp_path / "target"))
    finally:
        spark.conf.unset("spark.sql.streaming.minBatchesToRetain")
    last = max(_end_index(q))
    assert last == 5
    with pytest.raises(
        ConfigError, match=r"state of batch 0 is no longer retained.*minBatchesToRetain"
    ):
        export_state(spark, chk, 0, str(tmp_path / "old"))
    (table,) = export_state(spark, chk, last, str(tmp_path / "new"))
    assert table.rows == 60
    assert has_state(chk) and has_state(f"file://{chk}")
    # state files cleaned up under a committed batch (Spark's maintenance runs on its own
    # schedule): the read fails, and the error names the operator, the batch, the setting
    for partition in os.listdir(os.path.join(chk, "state", "0")):
        for version in range(1, 5):
            path = os.path.join(chk, "state", "0", partition, f"{version}.delta")
            if os.path.exists(path):
                os.remove(path)
    with pytest.raises(
        ConfigError,
        match=r"state of operator 0 \(dedupe\), store 'default' at batch 3 .*minBatchesToRetain",
    ):
        export_state(spark, chk, 3, str(tmp_path / "cleaned"))


def test_stream_stream_join_exports_its_four_stores(spark, tmp_path):
    total = 40
    left = _sequence(spark, total=total).select(
        F.col("id").alias("lid"), (F.col("id") % 5).alias("lk")
    )
    right = _sequence(spark, total=total).select(
        F.col("id").alias("rid"), F.col("id").alias("rk"), F.col("value").alias("rv")
    )
    chk = str(tmp_path / "chk")
    q = _run(left.join(right, F.expr("lk = rk")), chk, str(tmp_path / "target"))
    assert DeltaTable(str(tmp_path / "target")).to_pyarrow_table().num_rows == total
    last = max(_end_index(q))
    to = str(tmp_path / "export")
    tables = export_state(spark, chk, last, to)
    assert [t.store_name for t in tables] == [
        "left-keyToNumValues",
        "left-keyWithIndexToValue",
        "right-keyToNumValues",
        "right-keyWithIndexToValue",
    ]
    assert {t.operator_name for t in tables} == {"symmetricHashJoin"}
    got = {t.store_name: _rows(os.path.join(to, t.path)) for t in tables}
    # left: 5 join keys of 8 rows each; right: 40 keys of one row
    assert {r["key"]["field0"]: r["value"]["value"] for r in got["left-keyToNumValues"]} == {
        k: total // 5 for k in range(5)
    }
    left_rows = got["left-keyWithIndexToValue"]
    assert sorted(r["value"]["lid"] for r in left_rows) == list(range(total))
    assert Counter(r["key"]["index"] for r in left_rows) == {i: 5 for i in range(total // 5)}
    assert all(r["value"]["matched"] for r in left_rows)
    assert {r["key"]["field0"]: r["value"]["value"] for r in got["right-keyToNumValues"]} == {
        k: 1 for k in range(total)
    }
    assert sorted(r["value"]["rid"] for r in got["right-keyWithIndexToValue"]) == list(range(total))
    for t in tables:
        columns = ["key", "value", "partition_id"]
        assert _canon(got[t.store_name], columns) == _canon(
            _spark_state(spark, chk, last, t), columns
        )
    # Spark's joinSide view of the same state agrees with the exported stores
    side = spark.read.format("statestore").option("joinSide", "left").load(chk).toArrow()
    assert sorted(r["value"]["lid"] for r in side.to_pylist()) == list(range(total))


def test_types_without_a_delta_type_are_made_storable(spark, tmp_path):
    """void fields are dropped, intervals become strings: delta-rs writes what remains."""
    df = spark.sql(
        """SELECT named_struct('k', id) AS key,
                  named_struct('__dummy__', NULL) AS only_void,
                  named_struct('d', make_dt_interval(0, 0, 0, id), 'y', make_ym_interval(1, 2),
                               'c', make_interval(0, 0, 0, 1), 'gone', NULL,
                               'ts', timestamp_ntz'2024-01-02 03:04:05',
                               'm', map('a', make_ym_interval(0, 1))) AS value,
                  array(NULL) AS nulls,
                  CAST(id AS INT) AS partition_id
           FROM range(2)"""
    )
    columns = []
    for f in df.schema.fields:
        converted = state_export._delta_safe(df[f.name], f.dataType)
        if converted is not None:
            columns.append(converted.alias(f.name))
    data = df.select(*columns).toArrow()
    uri = str(tmp_path / "t")
    from deltalake import write_deltalake

    write_deltalake(uri, data, mode="error")
    rows = sorted(_rows(uri), key=lambda r: r["partition_id"])
    assert [f.name for f in DeltaTable(uri).schema().to_arrow()] == [
        "key",
        "value",
        "nulls",
        "partition_id",
    ]
    value = rows[1]["value"]
    assert set(value) == {"d", "y", "c", "ts", "m"}
    assert value["d"] == "INTERVAL '0 00:00:01' DAY TO SECOND"
    assert value["y"] == "INTERVAL '1-2' YEAR TO MONTH"
    assert value["ts"] == datetime(2024, 1, 2, 3, 4, 5)
    assert dict(value["m"]) == {"a": "INTERVAL '0-1' YEAR TO MONTH"}
    assert rows[0]["nulls"] == [None]


def test_two_aggregates_of_one_name_are_exported(spark, tmp_path):
    """Trial of issue 35: an aggregation with two sum()s keeps its state as
    value struct<sum, sum>, which Arrow and Delta refuse (DUPLICATED_FIELD_NAME_IN_ARROW_
    STRUCT): the second field is exported as sum_2."""
    chk, target = str(tmp_path / "chk"), str(tmp_path / "t")
    df = _sequence(spark).groupBy((F.col("id") % 3).alias("b"))
    df = df.agg(F.sum("id"), F.sum(F.col("id") * 2).alias("twice"))
    q = (
        df.writeStream.format("txn-delta")
        .outputMode("complete")
        .option("checkpointLocation", chk)
        .option("path", target)
        .trigger(availableNow=True)
        .start()
    )
    q.awaitTermination()
    assert q.exception() is None
    batch = max(int(n) for n in os.listdir(os.path.join(chk, "commits")) if n.isdigit())
    (table,) = export_state(spark, chk, batch, str(tmp_path / "exp"))
    rows = _rows(str(tmp_path / "exp" / table.path))
    assert sorted(rows[0]["value"]) == ["sum", "sum_2"]
    assert {r["key"]["_groupingexpression"]: r["value"]["sum_2"] for r in rows} == {
        b: 2 * sum(i for i in range(TOTAL_ROWS) if i % 3 == b) for b in range(3)
    }


@pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("pandas", "google.protobuf")),
    reason="transformWithState needs pandas and protobuf",
)
def test_transform_with_state_exports_one_table_per_state_variable(spark, tmp_path):
    from pyspark.sql import Row
    from pyspark.sql.streaming import StatefulProcessor
    from pyspark.sql.types import LongType, StructField, StructType

    class Counts(StatefulProcessor):
        def init(self, handle):
            long_of = lambda name: StructType([StructField(name, LongType())])  # noqa: E731
            self.count = handle.getValueState("count", long_of("n"))
            self.ids = handle.getListState("ids", long_of("id"))
            self.handle = handle

        def handleInputRows(self, key, rows, timerValues):
            n = self.count.get()[0] if self.count.exists() else 0
            for r in rows:
                n += 1
                self.ids.appendValue((r.id,))
            self.count.update((n,))
            self.handle.registerTimer(4_000_000_000_000 + key[0])
            yield Row(key=key[0], n=n)

        def close(self):
            pass

    provider = "spark.sql.streaming.stateStore.providerClass"
    spark.conf.set(
        provider, "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
    )
    try:
        df = (
            _sequence(spark, total=40)
            .withColumn("key", F.col("id") % 3)
            # not at 0: event time <= the watermark (initially 0) is late and dropped
            .withColumn("ts", F.timestamp_seconds(F.col("id") + 1000))
            .withWatermark("ts", "1 hour")
            .groupBy("key")
            # event time: a processing-time timer would keep availableNow running for ever
            .transformWithState(Counts(), "key long, n long", "Append", "EventTime")
        )
        chk = str(tmp_path / "chk")
        q = _run(df, chk, str(tmp_path / "target"))
    finally:
        spark.conf.unset(provider)
    last = max(_end_index(q))
    to = str(tmp_path / "export")
    tables = export_state(spark, chk, last, to)
    assert [(t.state_var, t.path) for t in tables] == [
        ("count", "state/0/default/count"),
        ("ids", "state/0/default/ids"),
        (state_export.TIMERS, "state/0/default/_timers"),
    ]
    count, ids, timers = (_rows(os.path.join(to, t.path)) for t in tables)
    expected = Counter(i % 3 for i in range(40))
    assert {r["key"]["key"]: r["value"]["n"] for r in count} == expected
    assert sorted(r["list_element"]["id"] for r in ids) == list(range(40))
    assert {r["key"]["key"]: r["expiration_timestamp_ms"] for r in timers} == {
        k: 4_000_000_000_000 + k for k in range(3)
    }
