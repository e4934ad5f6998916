"""Delta -> Delta with no JVM Delta jars: txn-delta source into txn-delta sink."""

import datetime as dt
import math
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake
from pipeline_checks import PipelineRunner, run_to_end

pytestmark = pytest.mark.spark


def run(spark, src, dst, chk, faults=None):
    w = (
        spark.readStream.format("txn-delta")
        .option("path", src)
        .option("maxFilesPerBatch", 2)
        .load()
        .writeStream.format("txn-delta")
        .option("path", dst)
        .option("checkpointLocation", chk)
    )
    if faults:
        w = w.option("faultInjection", faults)
    try:
        run_to_end(w)
    except Exception as e:
        return e
    return None


def sink_checks(dst: str, chk: str) -> PipelineRunner:
    """The txn-delta sink's checks of the target ``dst`` and checkpoint ``chk``."""
    runner = PipelineRunner(None, Path(dst).parent)
    runner.target, runner.checkpoint = dst, chk
    return runner


def test_delta_to_delta_exactly_once_across_a_crash(spark, tmp_path, fired_faults):
    src, dst, chk = (str(tmp_path / n) for n in ("src", "dst", "chk"))
    for k in range(5):
        ids = pa.array(range(k * 100, k * 100 + 100), pa.int64())
        write_deltalake(
            src, pa.table({"id": ids, "name": [f"n{i}" for i in range(100)]}), mode="append"
        )
    assert run(spark, src, dst, chk, "after_record:exit@batch=1") is not None
    fired_faults.assert_fired("after_record:exit@batch=1")
    assert run(spark, src, dst, chk) is None
    write_deltalake(
        src,
        pa.table({"id": pa.array(range(500, 550), pa.int64()), "name": ["x"] * 50}),
        mode="append",
    )
    assert run(spark, src, dst, chk) is None
    got = DeltaTable(dst).to_pyarrow_table().sort_by("id")
    assert got.column("id").to_pylist() == list(range(550))
    assert got.schema.field("name").type in (pa.string(), pa.large_string(), pa.string_view())
    sink = sink_checks(dst, chk)
    sink.assert_no_orphans()
    sink.assert_records_consistent()


def _rows(table):
    """Rows as a sorted list, NaN made comparable, for a row-for-row comparison."""

    def canon(v):
        return "NaN" if isinstance(v, float) and math.isnan(v) else v

    rows = [tuple(sorted((k, canon(v)) for k, v in r.items())) for r in table.to_pylist()]
    return sorted(rows, key=repr)


def test_partitioned_typed_source_to_delta(spark, tmp_path):
    """A source partitioned by string (unicode, '/', '=', '%', null), date, timestamp and
    decimal, with NaN/±Infinity doubles in a data and a partition column, through
    txn-delta -> txn-delta: the target holds the same rows, value for value."""
    utc = dt.timezone.utc
    src, dst, chk = (str(tmp_path / n) for n in ("src", "dst", "chk"))
    inf, nan = float("inf"), float("nan")

    def batch(k):
        return pa.table(
            {
                "id": pa.array([k * 4 + i for i in range(4)], pa.int64()),
                "f": pa.array([nan, inf, -inf, None], pa.float64()),
                "name": pa.array(["ünï 日本 🎉", None, "", "x"], pa.string()),
                "s": pa.array(["a", "ü/ x=%", None, "日本"], pa.string()),
                "d": pa.array(
                    [dt.date(2021, 1, 1), None, dt.date(1970, 1, 1), dt.date(2000, 2, 29)]
                ),
                "ts": pa.array(
                    [
                        dt.datetime(2021, 1, 1, 1, 2, 3, 456789, tzinfo=utc),
                        None,
                        dt.datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=utc),
                        dt.datetime(2000, 1, 1, tzinfo=utc),
                    ],
                    pa.timestamp("us", tz="UTC"),
                ),
                "dec": pa.array(
                    [Decimal("1.25"), None, Decimal("3.50"), Decimal("0.00")], pa.decimal128(10, 2)
                ),
                "pf": pa.array([inf, nan, None, -inf], pa.float64()),
                "amount": pa.array(
                    [Decimal("-12345.678901"), None, Decimal("0"), Decimal("1e-6")],
                    pa.decimal128(18, 6),
                ),
            }
        )

    parts = ["s", "d", "ts", "dec", "pf"]
    for k in range(3):
        write_deltalake(src, batch(k), mode="append", partition_by=parts)
    assert run(spark, src, dst, chk) is None
    write_deltalake(src, batch(3), mode="append", partition_by=parts)
    assert run(spark, src, dst, chk) is None

    expected = DeltaTable(src).to_pyarrow_table()
    assert expected.num_rows == 16
    got = DeltaTable(dst).to_pyarrow_table()  # ±Infinity/NaN stats must not stop a reader
    assert got.schema.names == expected.schema.names
    assert _rows(got) == _rows(expected)
    sink = sink_checks(dst, chk)
    sink.assert_no_orphans()
    sink.assert_records_consistent()
