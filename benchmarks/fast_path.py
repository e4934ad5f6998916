"""The fast path (issue 14) beside Spark's parquet sink, txn-delta and a hand-written
foreachBatch + delta-rs, on one JVM source, in one run.

    .venv/bin/python benchmarks/fast_path.py [--rows 4000000] [--rounds 3]

The source is Spark's parquet file source over ``--rows`` rows (4 int64 columns,
4 files) read in one micro-batch (``availableNow``), so no Python source sits
in front of any sink. Sinks:
  parquet       Spark's parquet file sink (JVM only, not transactional into Delta)
  fast          ``pyspark_txn.delta_batch_writer`` in foreachBatch: Spark's parquet
                writer stages, the two-phase protocol commits to Delta
  txn-delta     this package's Python Data Source sink (rows cross to Python workers)
  foreachBatch  toArrow() into the driver, delta-rs write_deltalake, skipping
                committed batch ids (the hand-written alternative)
Rounds run the sinks in a random order after a GC of both heaps; medians and
paired ratios (median over rounds of per-round ratios) are printed as JSON too.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import statistics
import tempfile
import time

SINKS = ["parquet", "fast", "txn-delta", "foreachBatch"]


def make_source(folder: str, rows: int, files: int = 4) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    per = -(-rows // files)
    for i in range(files):
        ids = np.arange(i * per, min(rows, (i + 1) * per), dtype=np.int64)
        table = pa.table({"id": ids, "a": ids * 3, "b": ids % 1000, "c": ids * 7})
        pq.write_table(table, f"{folder}/part-{i}.parquet")


def foreach_batch_to_delta(path: str, app_id: str):
    def write(df, batch_id: int) -> None:
        from deltalake import DeltaTable, write_deltalake
        from deltalake.transaction import CommitProperties, Transaction

        dt = DeltaTable(path) if DeltaTable.is_deltatable(path) else None
        if dt is not None and (dt.transaction_version(app_id) or -1) >= batch_id:
            return
        write_deltalake(
            dt if dt is not None else path,
            df.toArrow(),
            mode="append",
            commit_properties=CommitProperties(
                app_transactions=[Transaction(app_id=app_id, version=batch_id)]
            ),
        )

    return write


def run_once(spark, sink: str, source: str, rows: int, work: str) -> float:
    import pyspark_txn

    shutil.rmtree(work, ignore_errors=True)
    df = spark.readStream.schema("id long, a long, b long, c long").parquet(source)
    chk = f"{work}/chk"
    w = df.writeStream.option("checkpointLocation", chk).trigger(availableNow=True)
    out = f"{work}/out"
    if sink == "parquet":
        w = w.format("parquet").option("path", out)
    elif sink == "fast":
        w = w.foreachBatch(pyspark_txn.delta_batch_writer(path=out, checkpoint=chk))
    elif sink == "txn-delta":
        w = w.format("txn-delta").option("path", out)
    elif sink == "foreachBatch":
        w = w.foreachBatch(foreach_batch_to_delta(out, "bench"))
    else:
        raise ValueError(sink)
    t0 = time.perf_counter()
    w.start().awaitTermination()
    elapsed = time.perf_counter() - t0
    if sink != "parquet":
        from deltalake import DeltaTable

        got = DeltaTable(out).count()
        assert got == rows, f"{sink} wrote {got} rows, expected {rows}"
    return elapsed


def main() -> None:
    import logging

    import pyspark_txn

    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=4_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    spark = pyspark_txn.local_session(
        "bench-fast", **{"spark.sql.execution.arrow.maxRecordsPerBatch": "100000"}
    )
    work = tempfile.mkdtemp(prefix="txn-bench-fast-")
    source = f"{work}/source"
    import os

    os.makedirs(source)
    make_source(source, args.rows)
    for sink in SINKS:  # JIT, Python workers
        run_once(spark, sink, source, args.rows, f"{work}/warmup")
    times: dict[str, list[float]] = {s: [] for s in SINKS}
    for r in range(args.rounds):
        order = random.sample(SINKS, len(SINKS))
        for sink in order:
            gc.collect()
            spark.sparkContext._jvm.System.gc()
            t = run_once(spark, sink, source, args.rows, f"{work}/{sink}")
            times[sink].append(t)
            print(f"round {r} {sink}: {t:.2f} s ({args.rows / t / 1e6:.2f} M rows/s)", flush=True)
    rate = {s: args.rows / statistics.median(ts) / 1e6 for s, ts in times.items()}

    def paired(a: str, b: str) -> float:
        return statistics.median(tb / ta for ta, tb in zip(times[a], times[b], strict=True))

    ratios = {
        "fast / parquet": paired("fast", "parquet"),
        "fast / txn-delta": paired("fast", "txn-delta"),
        "fast / foreachBatch": paired("fast", "foreachBatch"),
        "txn-delta / parquet": paired("txn-delta", "parquet"),
    }
    print("\nmedian M rows/s: " + ", ".join(f"{s} {rate[s]:.2f}" for s in SINKS))
    print("paired ratios (throughput): " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    print(json.dumps({"rows": args.rows, "times_s": times, "m_rows_per_s": rate, "ratios": ratios}))
    spark.stop()
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
