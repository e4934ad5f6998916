"""A txn-sequence -> txn-postgres pipeline in its own process, for kill -9 tests.

usage: pg_driver.py BASE URL TABLE TOTAL PER_BATCH
"""

import sys

import pyspark_txn


def main() -> int:
    base, url, table, total, per_batch = sys.argv[1:6]
    spark = pyspark_txn.local_session("pyspark-txn-pg-e2e")
    q = (
        spark.readStream.format("txn-sequence")
        .option("rowsPerBatch", per_batch)
        .option("totalRows", total)
        .load()
        .writeStream.format("txn-postgres")
        .option("url", url)
        .option("table", table)
        .option("createTable", "true")
        .option("checkpointLocation", f"{base}/chk")
        .trigger(availableNow=True)
        .start()
    )
    q.awaitTermination()
    return 0


if __name__ == "__main__":
    sys.exit(main())
