"""A Delta table's change data feed through Spark: ``txn-delta`` with ``readChangeFeed=true``
into a ``txn-delta`` sink (append), while the source table gets merges, updates and
deletes; run to the end twice, the target holds exactly delta-rs's ``load_cdf``."""

import datetime as dt
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake
from pipeline_checks import PipelineRunner, run_to_end

pytestmark = pytest.mark.spark

UTC = dt.timezone.utc


def rows_of(rows):
    out = []
    for row in rows:
        items = []
        for k, v in row.items():
            if isinstance(v, dt.datetime) and v.tzinfo is not None:
                v = v.astimezone(UTC).replace(tzinfo=None)
            items.append((k, v))
        out.append(tuple(sorted(items)))
    return sorted(out, key=repr)


def load_cdf(path):
    data = pa.table(DeltaTable(path).load_cdf(starting_version=0).read_all())
    schema = pa.schema(
        [f.with_type(pa.string()) if pa.types.is_string_view(f.type) else f for f in data.schema]
    )
    return rows_of(data.cast(schema).to_pylist())


def people(ids, city, age=30):
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "name": [f"p{i}" for i in ids],
            "age": pa.array([age + i for i in ids], pa.int32()),
            "city": [city] * len(ids),
        }
    )


def run(spark, src, dst, chk):
    run_to_end(
        spark.readStream.format("txn-delta")
        .option("path", src)
        .option("readChangeFeed", "true")
        .option("startingVersion", 0)
        .option("maxFilesPerBatch", 2)
        .load()
        .writeStream.format("txn-delta")
        .option("path", dst)
        .option("checkpointLocation", chk)
    )


def test_change_feed_into_delta_equals_load_cdf(spark, tmp_path):
    src, dst, chk = (str(tmp_path / n) for n in ("src", "dst", "chk"))
    write_deltalake(
        src,
        people(range(0, 6), "oslo"),
        partition_by=["city"],
        configuration={"delta.enableChangeDataFeed": "true"},
    )
    write_deltalake(src, people(range(6, 10), "rome"), mode="append")
    changes = pa.table(
        {
            "id": pa.array([1, 7, 20], pa.int64()),
            "name": ["new1", "new7", "p20"],
            "age": pa.array([99, 98, 20], pa.int32()),
            "city": ["oslo", "rome", "rome"],
        }
    )
    (
        DeltaTable(src)
        .merge(changes, "t.id = s.id", source_alias="s", target_alias="t")
        .when_matched_update_all()
        .when_not_matched_insert_all()
        .execute()
    )
    DeltaTable(src).delete("id = 2")
    run(spark, src, dst, chk)
    assert rows_of(DeltaTable(dst).to_pyarrow_table().to_pylist()) == load_cdf(src)

    DeltaTable(src).update(updates={"age": "age + 1"}, predicate="city = 'rome'")
    DeltaTable(src).delete("city = 'oslo'")  # a whole partition: removes only
    write_deltalake(src, people(range(30, 33), "lima"), mode="append")
    run(spark, src, dst, chk)

    got = DeltaTable(dst).to_pyarrow_table()
    assert got.schema.names[-3:] == ["_change_type", "_commit_version", "_commit_timestamp"]
    assert rows_of(got.to_pylist()) == load_cdf(src)
    kinds = set(got.column("_change_type").to_pylist())
    assert kinds == {"insert", "delete", "update_preimage", "update_postimage"}
    sink = PipelineRunner(None, Path(dst).parent)
    sink.target, sink.checkpoint = dst, chk
    sink.assert_no_orphans()
    sink.assert_records_consistent()
