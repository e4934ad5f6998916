"""Throughput of txn-delta beside Spark's own sinks, on the same source, in one run.

    .venv/bin/python benchmarks/sink_throughput.py [--rows 4000000] [--rounds 3]

Sinks, each fed ``--rows`` rows from txn-sequence in ``--batches`` micro-batches
(default one):
  parquet     Spark's built-in parquet file sink (JVM only)
  noop        Spark's noop sink (reads the source, writes nothing)
  count-only  a Python Arrow stream writer that only counts rows: the ceiling
              of any Python sink, since every row crosses from the JVM to Python
  foreachBatch  the hand-written alternative: collect with toArrow() and write
              with delta-rs write_deltalake, skipping committed batch ids
  txn-delta   this package's two-phase transactional Delta sink (snappy, the default)
  txn-delta-raw  the same with compression=none: shows what encoding costs
Rounds run the sinks in a random order after a GC of both heaps, so noise and
leftovers spread evenly; medians are reported, with ratios against the others. Then a driver-limit demo: the same
batch with spark.driver.maxResultSize far below the batch size.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from pyspark.sql.datasource import DataSource, DataSourceStreamArrowWriter, WriterCommitMessage


class CountMessage(WriterCommitMessage):
    def __init__(self, rows: int) -> None:
        self.rows = rows


class CountOnlyWriter(DataSourceStreamArrowWriter):
    def write(self, iterator):
        return CountMessage(sum(b.num_rows for b in iterator))

    def commit(self, messages, batchId):
        pass  # counting is the whole job

    def abort(self, messages, batchId):
        pass  # nothing staged


class CountOnlySink(DataSource):
    @classmethod
    def name(cls):
        return "bench-count-only"

    def streamWriter(self, schema, overwrite):
        return CountOnlyWriter()


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


def run_once(spark, sink: str, rows: int, width: int, work: str, batches: int = 1) -> float:
    shutil.rmtree(work, ignore_errors=True)
    df = (
        spark.readStream.format("txn-sequence")
        .option("rowsPerBatch", -(-rows // batches))
        .option("totalRows", rows)
        .option("numPartitions", 2)
        .option("width", width)
        .load()
    )
    w = df.writeStream.option("checkpointLocation", f"{work}/chk").trigger(availableNow=True)
    if sink == "parquet":
        w = w.format("parquet").option("path", f"{work}/out")
    elif sink == "noop":
        w = w.format("noop")
    elif sink == "count-only":
        w = w.format("bench-count-only")
    elif sink == "foreachBatch":
        w = w.foreachBatch(foreach_batch_to_delta(f"{work}/out", "bench"))
    elif sink == "txn-delta":
        w = w.format("txn-delta").option("path", f"{work}/out")
    elif sink == "txn-delta-raw":
        w = w.format("txn-delta").option("path", f"{work}/out").option("compression", "none")
    else:
        raise ValueError(sink)
    t0 = time.perf_counter()
    w.start().awaitTermination()
    elapsed = time.perf_counter() - t0
    if sink.startswith("txn-delta") or sink == "foreachBatch":
        from deltalake import DeltaTable

        got = DeltaTable(f"{work}/out").count()
        assert got == rows, f"{sink} wrote {got} rows, expected {rows}"
    return elapsed


SINKS = ["parquet", "noop", "count-only", "foreachBatch", "txn-delta", "txn-delta-raw"]


def throughput(args) -> dict:
    import pyspark_txn

    spark = pyspark_txn.local_session(
        "bench", **{"spark.sql.execution.arrow.maxRecordsPerBatch": "100000"}
    )
    spark.dataSource.register(CountOnlySink)
    work = tempfile.mkdtemp(prefix="txn-bench-")
    run_once(spark, "txn-delta", 100_000, args.width, f"{work}/warmup")  # JIT, workers
    times: dict[str, list[float]] = {s: [] for s in SINKS}
    rng = random.Random(args.seed)
    for r in range(args.rounds):
        # A fresh random order each round, and a full GC of both heaps before
        # every run: foreachBatch leaves the driver's heaps full of collected
        # batches, and whoever runs next would pay for collecting them.
        order = rng.sample(SINKS, len(SINKS))
        for sink in order:
            gc.collect()
            spark._jvm.System.gc()
            time.sleep(1)
            t = run_once(spark, sink, args.rows, args.width, f"{work}/{sink}", args.batches)
            times[sink].append(t)
            print(
                f"round {r + 1} {sink:<13} {t:6.2f} s  {args.rows / t / 1e6:5.2f} M rows/s",
                flush=True,
            )
    spark.stop()
    shutil.rmtree(work, ignore_errors=True)
    med = {s: statistics.median(v) for s, v in times.items()}
    rate = {s: args.rows / t / 1e6 for s, t in med.items()}
    return {"times_s": times, "median_s": med, "m_rows_per_s": rate}


def time_calls(owner, name: str, record) -> None:
    """Replace ``owner.name`` (a function or method) by one that passes the ms of each
    call to ``record`` (``--steps`` of the benchmarks: where a batch's time goes)."""
    import functools

    inner = getattr(owner, name)

    @functools.wraps(inner)
    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            record((time.perf_counter() - t0) * 1000)

    setattr(owner, name, timed)


def paired_ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    """Median over rounds of (rate a / rate b) within one round: noise shared by a
    round cancels out."""
    return statistics.median(tb / ta for ta, tb in zip(times[a], times[b], strict=True))


DRIVER_LIMIT_CHILD = r"""
import sys, tempfile
sys.path.insert(0, {bench_dir!r})
import pyspark_txn, sink_throughput as b
spark = pyspark_txn.local_session("bench-limit", **{{"spark.driver.maxResultSize": "{limit}"}})
work = tempfile.mkdtemp()
for sink in ("txn-delta", "foreachBatch"):
    try:
        t = b.run_once(spark, sink, {rows}, {width}, work + "/" + sink)
        print("RESULT", sink, "ok", round(t, 2), flush=True)
    except Exception as e:
        msg = str(e).split("\n")[0][:160]
        print("RESULT", sink, "failed", msg, flush=True)
"""


def driver_limit(args) -> dict:
    code = DRIVER_LIMIT_CHILD.format(
        bench_dir=os.path.dirname(os.path.abspath(__file__)),
        limit=args.driver_limit,
        rows=args.rows,
        width=args.width,
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    results = {}
    for line in out.stdout.splitlines():
        if line.startswith("RESULT"):
            _, sink, status, *rest = line.split(" ", 3)
            results[sink] = f"{status} {' '.join(rest)}".strip()
    return results


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=4_000_000)
    p.add_argument("--width", type=int, default=2, help="extra int64 columns")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=1, help="seed of the per-round run order")
    p.add_argument(
        "--batches", type=int, default=1, help="split the rows into this many micro-batches"
    )
    p.add_argument("--driver-limit", default="32m", help="spark.driver.maxResultSize for the demo")
    p.add_argument("--skip-limit", action="store_true")
    args = p.parse_args()
    res = throughput(args)
    rate = res["m_rows_per_s"]
    print("\nmedian M rows/s: " + ", ".join(f"{s} {rate[s]:.2f}" for s in SINKS))
    pairs = [
        ("txn-delta", "parquet"),
        ("txn-delta", "count-only"),
        ("txn-delta", "foreachBatch"),
        ("txn-delta-raw", "count-only"),
        ("count-only", "parquet"),
        ("foreachBatch", "parquet"),
    ]
    ratios, paired = {}, {}
    print(f"{'':<26} {'of medians':>10} {'paired':>8}")
    for a, b in pairs:
        k = f"{a} / {b}"
        ratios[k] = rate[a] / rate[b]
        paired[k] = paired_ratio(res["times_s"], a, b)
        print(f"{k:<26} {ratios[k]:>9.2f}x {paired[k]:>7.2f}x")
    res["paired_ratios"] = paired
    res["ratios"] = ratios
    if not args.skip_limit:
        res["driver_limit"] = driver_limit(args)
        print(f"\nwith spark.driver.maxResultSize={args.driver_limit}:")
        for sink, outcome in res["driver_limit"].items():
            print(f"  {sink:<13} {outcome}")
    os.makedirs("benchmarks/results", exist_ok=True)
    res["args"] = vars(args)
    suffix = "" if args.batches == 1 else f"_{args.batches}batches"
    with open(f"benchmarks/results/sink_throughput{suffix}.json", "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
