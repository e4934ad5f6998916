"""Every Spark SQL type a Delta table can store, through the sink and back, value by value.

The input is parquet files that a user's other job wrote (Spark's file source
streams them); the target is read back with delta-rs and with Spark's own
parquet reader, and must equal the input row for row.
"""

import datetime as dt
import decimal
import math
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

import pyspark_txn

pytestmark = pytest.mark.spark

UTC = dt.timezone.utc
D = decimal.Decimal

SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        pa.field("i8", pa.int8()),
        pa.field("i16", pa.int16()),
        pa.field("i32", pa.int32()),
        pa.field("i64", pa.int64()),
        pa.field("f32", pa.float32()),
        pa.field("f64", pa.float64()),
        pa.field("dec5", pa.decimal128(5, 2)),
        pa.field("dec18", pa.decimal128(18, 6)),
        pa.field("dec38", pa.decimal128(38, 10)),
        pa.field("s", pa.string()),
        pa.field("b", pa.binary()),
        pa.field("flag", pa.bool_()),
        pa.field("day", pa.date32()),
        pa.field("ts", pa.timestamp("us", tz="UTC")),
        pa.field("ts_ntz", pa.timestamp("us")),
        pa.field(
            "st",
            pa.struct([("a", pa.int32()), ("inner", pa.struct([("c", pa.string())]))]),
        ),
        pa.field("arr", pa.list_(pa.int32())),
        pa.field("arr_st", pa.list_(pa.struct([("k", pa.string()), ("v", pa.float64())]))),
        pa.field("m", pa.map_(pa.string(), pa.int64())),
    ]
)

INF = float("inf")
ROWS = [
    dict(
        i8=-128,
        i16=-32768,
        i32=-(2**31),
        i64=-(2**63),
        f32=-INF,
        f64=-INF,
        dec5=D("-999.99"),
        dec18=D("-999999999999.999999"),
        dec38=D("-" + "9" * 28 + "." + "9" * 10),
        s="",
        b=b"",
        flag=False,
        day=dt.date(1, 1, 1),
        ts=dt.datetime(1, 1, 1, tzinfo=UTC),
        ts_ntz=dt.datetime(1, 1, 1),
        st={"a": 1, "inner": {"c": "x"}},
        arr=[],
        arr_st=[],
        m=[],
    ),
    dict(
        i8=127,
        i16=32767,
        i32=2**31 - 1,
        i64=2**63 - 1,
        f32=INF,
        f64=INF,
        dec5=D("999.99"),
        dec18=D("999999999999.999999"),
        dec38=D("9" * 28 + "." + "9" * 10),
        s="ünïcødé ✓ 日本語 " + "long" * 20,
        b=bytes(range(256)),
        flag=True,
        day=dt.date(9999, 12, 31),
        ts=dt.datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
        ts_ntz=dt.datetime(9999, 12, 31, 23, 59, 59, 999999),
        st={"a": None, "inner": None},
        arr=[1, None, 3],
        arr_st=[{"k": "a", "v": math.nan}],
        m=[("a", 1), ("b", None)],
    ),
    dict(
        i8=0,
        i16=0,
        i32=0,
        i64=0,
        f32=math.nan,
        f64=-0.0,
        dec5=D("0.00"),
        dec18=D("0"),
        dec38=D("0"),
        s="NaN",
        b=b"\x00",
        flag=None,
        day=dt.date(1970, 1, 1),
        ts=dt.datetime(1970, 1, 1, tzinfo=UTC),
        ts_ntz=dt.datetime(2026, 11, 23, 4, 5, 6, 7),
        st=None,
        arr=None,
        arr_st=None,
        m=None,
    ),
    {},  # every nullable column null
]


def input_table() -> pa.Table:
    rows = [{"id": i, **r} for i, r in enumerate(ROWS)]
    return pa.Table.from_pylist(rows, schema=SCHEMA)


def same(a, b) -> bool:
    """Equality with NaN == NaN and -0.0 kept apart from 0.0."""
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def assert_rows_equal(got: pa.Table, want: pa.Table) -> None:
    got = got.sort_by("id").to_pylist()
    want = want.sort_by("id").to_pylist()
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        for col in w:
            assert same(g[col], w[col]), f"row {w['id']} column {col}: {g[col]!r} != {w[col]!r}"


def test_every_type_round_trips_through_the_sink(spark, tmp_path):
    src, target, chk = tmp_path / "in", str(tmp_path / "t"), str(tmp_path / "chk")
    os.makedirs(src)
    table = input_table()
    pq.write_table(table, src / "part-0.parquet")
    spark_schema = spark.read.parquet(str(src)).schema
    q = (
        spark.readStream.schema(spark_schema)
        .parquet(str(src))
        .writeStream.format("txn-delta")
        .option("path", target)
        .option("checkpointLocation", chk)
        .trigger(availableNow=True)
        .start()
    )
    q.awaitTermination()
    delta = DeltaTable(target)
    got = delta.to_pyarrow_table()
    assert_rows_equal(got, table)
    # stats are strict JSON that delta-rs accepts, and a filtered read uses them correctly
    filtered = delta.to_pyarrow_table(filters=[("f64", ">", 0.0)])
    assert filtered.column("id").to_pylist() == [1]
    # Spark's own parquet reader reads the committed files to the same rows
    back = spark.read.parquet(*delta.file_uris()).toArrow()
    assert_rows_equal(back.cast(got.schema) if back.schema != got.schema else back, table)
    # and polars, another delta-rs based reader that refuses non-JSON stats
    pl = pytest.importorskip("polars")
    frame = pl.read_delta(target)
    assert frame.height == len(ROWS) and sorted(frame["id"].to_list()) == list(range(len(ROWS)))


def test_not_null_fields_of_null_structs_round_trip(spark, tmp_path):
    """``when(c, struct(...))``: a nullable struct whose fields Spark marks NOT NULL (and
    arrays and maps of them), the way pipelines build optional nested records."""
    from pyspark.sql import functions as F

    target, chk = str(tmp_path / "t"), str(tmp_path / "chk")
    df = (
        spark.readStream.format("txn-sequence")
        .option("rowsPerBatch", 50)
        .option("totalRows", 100)
        .load()
    )
    n = F.coalesce(F.col("id"), F.lit(-1))  # NOT NULL
    rec = F.struct(
        n.alias("n"),
        F.lit("x").alias("s"),
        F.struct(n.alias("c")).alias("inner"),
        F.array(n).alias("xs"),
        F.lit(dt.date(2026, 11, 24)).alias("day"),
    )
    out = df.select(
        "id",
        F.when(F.col("id") % 3 == 0, rec).alias("st"),
        F.array(F.when(F.col("id") % 2 == 0, rec), rec).alias("arr"),
        F.create_map(F.lit("k"), F.when(F.col("id") % 5 == 0, rec)).alias("m"),
    )
    fields = {f.name: f for f in out.schema["st"].dataType.fields}
    assert not fields["n"].nullable and not fields["inner"].nullable  # as pipelines get them
    pyspark_txn.process_available(  # (before 4.2 availableNow reads one batch of it)
        out.writeStream.format("txn-delta").option("path", target).option("checkpointLocation", chk)
    )
    rows = {r["id"]: r for r in DeltaTable(target).to_pyarrow_table().to_pylist()}
    assert sorted(rows) == list(range(100))

    def want(i):
        return {"n": i, "s": "x", "inner": {"c": i}, "xs": [i], "day": dt.date(2026, 11, 24)}

    for i, r in rows.items():
        assert r["st"] == (want(i) if i % 3 == 0 else None), r
        assert r["arr"] == [want(i) if i % 2 == 0 else None, want(i)], r
        assert r["m"] == [("k", want(i) if i % 5 == 0 else None)], r
