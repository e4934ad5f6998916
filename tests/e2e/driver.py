"""A whole pipeline driver in its own process, for kill -9 and fencing tests.

usage: driver.py BASE TOTAL PER_BATCH [--continuous RATE] [--redis URL] [--fast]
                 [--option KEY=VALUE ...] [--column NAME=SQL ...]

With ``--redis URL`` the source is ``txn-redis`` (stream ``orders``, group ``g``
from the stream's start, PER_BATCH messages a batch) instead of ``txn-sequence``.
With ``--fast`` the sink is the fast path (``delta_batch_writer`` in foreachBatch)
with the same options, instead of ``txn-delta``. ``--column NAME=SQL`` adds a column
computed from the source's (e.g. one to partition by).
"""

import sys

import pyspark_txn


def main() -> int:
    base, total, per_batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    continuous = "--continuous" in sys.argv
    spark = pyspark_txn.local_session("pyspark-txn-e2e")
    if "--redis" in sys.argv:
        reader = (
            spark.readStream.format("txn-redis")
            .option("url", sys.argv[sys.argv.index("--redis") + 1])
            .option("stream", "orders")
            .option("group", "g")
            .option("startId", "0")
            .option("checkpointLocation", f"{base}/chk")
            .option("maxMessagesPerBatch", per_batch)
        )
    else:
        reader = spark.readStream.format("txn-sequence").option("rowsPerBatch", per_batch)
        reader = reader.option("totalRows", total)
    if continuous:
        reader = reader.option("rowsPerSecond", sys.argv[sys.argv.index("--continuous") + 1])
    options, columns = {}, []
    for i, arg in enumerate(sys.argv):
        if arg in ("--option", "--column"):
            key, _, value = sys.argv[i + 1].partition("=")
            if arg == "--option":
                options[key] = value
            else:
                columns.append(f"{value} AS `{key}`")
    df = reader.load()
    if columns:
        df = df.selectExpr("*", *columns)
    w = df.writeStream.option("checkpointLocation", f"{base}/chk")
    if "--fast" in sys.argv:
        sink = pyspark_txn.delta_batch_writer(
            path=f"{base}/target", checkpoint=f"{base}/chk", **options
        )
        w = w.foreachBatch(sink)
    else:
        w = w.format("txn-delta").option("path", f"{base}/target")
        for key, value in options.items():
            w = w.option(key, value)
    w = w.trigger(processingTime="500 milliseconds") if continuous else w.trigger(availableNow=True)
    q = w.start()
    q.awaitTermination()
    return 0


if __name__ == "__main__":
    sys.exit(main())
