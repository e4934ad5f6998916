"""Several txn-sequence -> txn-delta queries in one driver, for the many-queries test.

usage: many_driver.py BASE NQUERIES SECONDS [--restart-first]

Query ``i`` writes ``BASE/q{i}/target`` with checkpoint ``BASE/q{i}/chk`` on a
1 s processing-time trigger. Once every query has finished a batch, the driver
watches them for SECONDS (with ``--restart-first`` it stops query 0 half way
and starts it again on the same checkpoint and target), then on until every query
finished at least MIN_NEW_BATCHES batches since the watch began (progress, at
whatever rate this machine runs), then stops them all and prints one
``SUMMARY {json}`` line. Exit 1 as soon as a query dies, after printing its
exception.
"""

import json
import sys
import time

import pyspark_txn

ROWS_PER_BATCH = 50
ROWS_PER_SECOND = 200  # ahead of 50 rows/s, so a restarted query catches up quickly
FIRST_BATCH_S = 120  # a busy 2-core machine can take a minute to finish the first batches
POLL_S = 0.5
MIN_NEW_BATCHES = 3  # batches every query must finish while watched
PROGRESS_GUARD_S = 240  # a hang guard for those batches, not a rate


def start_query(spark, base: str, i: int):
    return (
        spark.readStream.format("txn-sequence")
        .option("rowsPerBatch", ROWS_PER_BATCH)
        .option("rowsPerSecond", ROWS_PER_SECOND)
        .load()
        .writeStream.format("txn-delta")
        .option("path", f"{base}/q{i}/target")
        .option("checkpointLocation", f"{base}/q{i}/chk")
        .queryName(f"q{i}")
        .trigger(processingTime="1 second")
        .start()
    )


def batch_id(q) -> int | None:
    progress = q.lastProgress
    return None if progress is None else progress["batchId"]


def dead(queries) -> str | None:
    """A report of the first query that stopped on its own, else None."""
    for q in queries:
        if not q.isActive:
            error = q.exception()
            if error is None:
                return f"{q.name} stopped without an error (nobody asked it to)"
            return f"{q.name} failed: {error}"
    return None


def watch(
    queries, seconds: float, until_progress: bool = False, restart=None, until=None
) -> str | None:
    """Poll for ``seconds`` (or until every query made progress, or ``until()`` holds);
    a failure report or None."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        failure = dead(queries)
        if failure is not None:
            return f"after {time.monotonic() - started:.1f} s: {failure}"
        if until_progress and all(batch_id(q) is not None for q in queries):
            return None
        if until is not None and until():
            return None
        if restart is not None and time.monotonic() - started >= seconds / 2:
            restart()
            restart = None
        time.sleep(POLL_S)
    if until_progress:
        slow = [q.name for q in queries if batch_id(q) is None]
        return f"no batch finished in {seconds:g} s by {slow}"
    if until is not None:
        return f"{until.__doc__} not within {seconds:g} s"
    return dead(queries)


def main() -> int:
    base, n, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    spark = pyspark_txn.local_session(
        "pyspark-txn-many", **{"spark.ui.showConsoleProgress": "false"}
    )
    queries = [start_query(spark, base, i) for i in range(n)]
    runs = [1] * n

    def restart_first():
        queries[0].stop()
        print(f"stopped q0 after batch {batch_id(queries[0])}; starting it again", flush=True)
        queries[0] = start_query(spark, base, 0)
        runs[0] += 1

    print(f"started {n} queries", flush=True)
    failure = watch(queries, FIRST_BATCH_S, until_progress=True)
    first = {q.name: batch_id(q) for q in queries}
    if failure is None:
        print(f"every query finished a batch; watching for {seconds:g} s", flush=True)
        first = {q.name: batch_id(q) for q in queries}
        restart = restart_first if "--restart-first" in sys.argv else None
        failure = watch(queries, seconds, restart=restart)

    def progressed() -> bool:
        """every query finished MIN_NEW_BATCHES more batches"""
        return all((batch_id(q) or -1) >= first[q.name] + MIN_NEW_BATCHES for q in queries)

    if failure is None:
        failure = watch(queries, PROGRESS_GUARD_S, until=progressed)
    if failure is not None:
        print(failure, flush=True)
        return 1
    for q in queries:
        q.stop()
    summary = {
        q.name: {
            "firstBatchId": first[q.name],
            "lastBatchId": batch_id(q),
            "runs": runs[i],
            "runId": str(q.runId),
        }
        for i, q in enumerate(queries)
    }
    print("SUMMARY " + json.dumps(summary, sort_keys=True), flush=True)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
