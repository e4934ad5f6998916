"""Delta -> Delta with no JVM Delta jars: txn-delta source into txn-delta sink."""

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

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
        .trigger(availableNow=True)
    )
    if faults:
        w = w.option("faultInjection", faults)
    try:
        w.start().awaitTermination()
    except Exception as e:
        return e
    return None


def test_delta_to_delta_exactly_once_across_a_crash(spark, tmp_path):
    src, dst, chk = (str(tmp_path / n) for n in ("src", "dst", "chk"))
    for k in range(5):
        ids = pa.array(range(k * 100, k * 100 + 100), pa.int64())
        write_deltalake(
            src, pa.table({"id": ids, "name": [f"n{i}" for i in range(100)]}), mode="append"
        )
    assert run(spark, src, dst, chk, "after_record:exit@batch=1") is not None
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
