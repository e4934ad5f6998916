"""A fast-path query whose Spark write has a task that fails once after writing files:
run in its own process, as task retries need a ``local[n,maxFailures]`` master.

argv: workdir, jar of LeakyCommitter. Prints what the table holds as JSON.
"""

import json
import os
import sys

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import DeltaTable
from pyspark import TaskContext
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

import pyspark_txn

ROWS, FAIL_AT = 100_000, 90_000
work, jar = sys.argv[1], sys.argv[2]
# local[2] retries no task: local[2,4] retries each up to 3 times
spark = (
    SparkSession.builder.master("local[2,4]")
    .config("spark.ui.enabled", "false")
    .config("spark.sql.shuffle.partitions", "2")
    .config("spark.jars", jar)
    # the user's session: a committer that leaves a failed attempt's files in place
    .config("spark.sql.parquet.output.committer.class", "pyspark_txn_test.LeakyCommitter")
    .getOrCreate()
)
spark.sparkContext.setLogLevel("OFF")
pyspark_txn.register(spark)
pq.write_table(pa.table({"id": pa.array(range(ROWS), pa.int64())}), f"{work}/src/f.parquet")


@F.udf(T.IntegerType())
def attempt(i):
    return TaskContext.get().attemptNumber()


@F.udf(T.LongType())
def fail_first_attempt(i):
    # Spark hands a Python UDF 100 rows at a time, and the write takes them as they come:
    # the first attempt has written files when it fails
    if TaskContext.get().attemptNumber() == 0 and i == FAIL_AT:
        raise RuntimeError("the first attempt of this task fails after writing files")
    return i


sink = pyspark_txn.delta_batch_writer(
    path=f"{work}/t", checkpoint=f"{work}/c", targetFileRows="20000"
)


def batch(df, batch_id):
    # the attempt number goes into the rows: which attempt wrote a row can be told
    df = df.coalesce(1).withColumn("attempt", attempt("id"))
    sink(df.withColumn("id", fail_first_attempt("id")), batch_id)


df = spark.readStream.schema("id long").parquet(f"{work}/src")
pyspark_txn.process_available(
    df.writeStream.foreachBatch(batch).option("checkpointLocation", f"{work}/c")
)
table = DeltaTable(f"{work}/t").to_pyarrow_table()
ids = table.column("id")
summary = {
    "rows": table.num_rows,
    "distinct": len(pc.unique(ids)),
    "min": pc.min(ids).as_py(),
    "max": pc.max(ids).as_py(),
    "attempts": sorted(pc.unique(table.column("attempt")).to_pylist()),
}
print(json.dumps(summary), flush=True)
os._exit(0)  # not the JVM's and delta-rs's teardown at interpreter exit (issue 23 item 10)
