"""Throughput of txn-postgres beside the usual alternatives, on the same source, in one run.

    .venv/bin/python benchmarks/postgres_sink.py [--rows 1000000] [--rounds 3] [--width 2]

Each sink gets ``--rows`` rows from txn-sequence (``id``, ``value`` and ``--width``
int64 payload columns) in one micro-batch, into its own empty table of a
throwaway PostgreSQL cluster (tests/pg_server.py, as the tests start it):

  txn-postgres  this package's sink: binary COPY per partition, PREPARE TRANSACTION,
                COMMIT PREPARED after the snapshot record (exactly once)
  foreachBatch  the hand-written alternative: ``toArrow()`` on the driver, one
                binary COPY with psycopg plus a batch-id marker row in the same
                transaction (skips batch ids already committed)
  jdbc          Spark's built-in JDBC sink in ``foreachBatch`` (at-least-once), where
                a PostgreSQL JDBC jar is on the machine (Debian's
                libpostgresql-jdbc-java: /usr/share/java/postgresql.jar)

Rounds run the sinks in a random order; medians and paired ratios are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

JDBC_JARS = ("/usr/share/java/postgresql.jar",)


def foreach_batch_copy(url: str, table: str, columns: list[str]):
    """The hand-written foreachBatch sink: everything through the driver, one COPY."""

    def write(df, batch_id: int) -> None:
        import psycopg
        from psycopg import sql

        data = df.toArrow()
        with psycopg.connect(url) as conn, conn.cursor() as cur:
            marks = sql.Identifier(f"{table}_batches")  # batch ids committed into ``table``
            cur.execute(
                sql.SQL("CREATE TABLE IF NOT EXISTS {} (batch_id bigint PRIMARY KEY)").format(marks)
            )
            cur.execute(sql.SQL("SELECT 1 FROM {} WHERE batch_id = %s").format(marks), (batch_id,))
            if cur.fetchone():
                return
            copy_sql = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT BINARY)").format(
                sql.Identifier(table), sql.SQL(", ").join(sql.Identifier(c) for c in columns)
            )
            with cur.copy(copy_sql) as copy:
                copy.set_types(["int8"] * len(columns))
                for batch in data.to_batches():
                    cols = [c.to_pylist() for c in batch.columns]
                    for row in zip(*cols, strict=True):
                        copy.write_row(row)
            cur.execute(sql.SQL("INSERT INTO {} VALUES (%s)").format(marks), (batch_id,))

    return write


def foreach_batch_jdbc(jdbc_url: str, table: str, user: str, password: str):
    def write(df, batch_id: int) -> None:
        (
            df.write.format("jdbc")
            .option("url", jdbc_url)
            .option("dbtable", table)
            .option("user", user)
            .option("password", password)
            .option("driver", "org.postgresql.Driver")
            .mode("append")
            .save()
        )

    return write


def run_once(spark, server, sink: str, rows: int, width: int, work: str) -> float:
    shutil.rmtree(work, ignore_errors=True)
    table = f"bench_{sink.replace('-', '_').lower()}_{uuid.uuid4().hex[:6]}"
    columns = ["id", "value"] + [f"c{i}" for i in range(1, width + 1)]
    with server.connect() as conn:
        conn.execute(f"CREATE TABLE {table} ({', '.join(c + ' bigint' for c in columns)})")
    df = (
        spark.readStream.format("txn-sequence")
        .option("rowsPerBatch", rows)
        .option("totalRows", rows)
        .option("numPartitions", 2)
        .option("width", width)
        .load()
    )
    w = df.writeStream.option("checkpointLocation", f"{work}/chk").trigger(availableNow=True)
    if sink == "txn-postgres":
        w = w.format("txn-postgres").option("url", server.url).option("table", f"public.{table}")
    elif sink == "foreachBatch":
        w = w.foreachBatch(foreach_batch_copy(server.url, table, columns))
    elif sink == "jdbc":
        jdbc_url = f"jdbc:postgresql://127.0.0.1:{server.port}/postgres"
        w = w.foreachBatch(foreach_batch_jdbc(jdbc_url, table, server.user, server.password))
    else:
        raise ValueError(sink)
    t0 = time.perf_counter()
    w.start().awaitTermination()
    elapsed = time.perf_counter() - t0
    with server.connect() as conn:
        (got,) = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
        conn.execute(f"DROP TABLE {table}")
    assert got == rows, f"{sink} wrote {got} rows, expected {rows}"
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--width", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    from pg_server import PostgresServer, pg_bindir

    import pyspark_txn

    bindir = pg_bindir()
    if bindir is None:
        print("no PostgreSQL binaries (apt-get install postgresql)", file=sys.stderr)
        return 1
    jar = next((j for j in JDBC_JARS if os.path.exists(j)), None)
    sinks = ["txn-postgres", "foreachBatch"] + (["jdbc"] if jar else [])
    server = PostgresServer(bindir)
    conf = {"spark.jars": jar} if jar else {}
    spark = pyspark_txn.local_session("pyspark-txn-pg-bench", **conf)
    spark.sparkContext.setLogLevel("ERROR")
    work = tempfile.mkdtemp(prefix="pg-bench-")
    rng = random.Random(args.seed)
    times: dict[str, list[float]] = {s: [] for s in sinks}
    try:
        run_once(spark, server, "txn-postgres", 10_000, args.width, f"{work}/warm")  # JIT, workers
        for r in range(args.rounds):
            order = sinks[:]
            rng.shuffle(order)
            for sink in order:
                t = run_once(spark, server, sink, args.rows, args.width, f"{work}/{sink}-{r}")
                times[sink].append(t)
                print(
                    f"round {r} {sink}: {t:.2f} s, {args.rows / t / 1e6:.3f} M rows/s", flush=True
                )
    finally:
        spark.stop()
        server.destroy()
        shutil.rmtree(work, ignore_errors=True)
    rates = {s: args.rows / statistics.median(ts) for s, ts in times.items()}
    ratios = {
        f"txn-postgres/{s}": statistics.median(
            b / a for a, b in zip(times["txn-postgres"], times[s], strict=True)
        )
        for s in sinks
        if s != "txn-postgres"
    }
    print(
        json.dumps(
            {
                "rows": args.rows,
                "columns": 2 + args.width,
                "rounds": args.rounds,
                "M_rows_per_s_median": {s: round(v / 1e6, 3) for s, v in rates.items()},
                "paired_ratios_median": {k: round(v, 2) for k, v in ratios.items()},
                "jdbc_jar": jar,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
