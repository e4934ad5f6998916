"""The fast path (issue 14) beside Spark's parquet sink, txn-delta, the count-only
Python writer and a hand-written foreachBatch + delta-rs, on one source, in one run.

    .venv/bin/python benchmarks/fast_path.py [--source jvm|python] [--batches N]
                                             [--rows 4000000] [--rounds 5]
                                             [--sinks parquet,fast] [--before DIR] [--steps]

Sources:
  jvm     Spark's parquet file source over ``--rows`` rows (4 int64 columns) in
          two files per micro-batch (``maxFilesPerTrigger``), so no
          Python source sits in front of any sink
  python  this package's ``txn-sequence`` (4 int64 columns), ``--batches`` micro-batches
Sinks:
  parquet       Spark's parquet file sink (JVM only, not transactional into Delta)
  fast          ``pyspark_txn.delta_batch_writer`` in foreachBatch: Spark's parquet
                writer stages, the two-phase protocol commits to Delta
  txn-delta     this package's Python Data Source sink (rows cross to Python workers)
  count-only    a Python Arrow writer that only counts rows: the ceiling of any
                Python Data Source sink
  foreachBatch  toArrow() into the driver, delta-rs write_deltalake, skipping
                committed batch ids (the hand-written alternative)
  fast-before   with ``--before DIR``: the fast path of an older copy of the package,
                importable from DIR as ``pyspark_txn_before`` (e.g. ``git archive`` of
                the commit, its ``pyspark_txn/`` renamed), for before/after in one run
For ``parquet`` and the fast paths the written files are summarised (files, bytes, row
groups, codecs, dictionary-encoded columns) so both sides can be seen to write the same
kind of file; each round also prints Spark's ``addBatch`` time (summed over batches).
``--steps`` times the fast path's steps in the driver (wrapping its functions) and
prints the median per batch of each: where one batch's time goes.
Rounds run the sinks in a random order after a GC of both heaps; medians and paired
ratios (median over rounds of per-round ratios) are printed, and written as JSON to
``benchmarks/results/fast_path_<source>_<batches>.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
# Python workers unpickle the count-only sink by module name: let them import it
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_HERE, os.environ.get("PYTHONPATH")]))
from sink_throughput import (  # noqa: E402
    CountOnlySink,
    foreach_batch_to_delta,
    paired_ratio,
    time_calls,
)

SINKS = ["parquet", "fast", "txn-delta", "count-only", "foreachBatch"]
LAST: dict = {}  # what run_once saw of its last run besides its time
SCHEMA = "id long, a long, b long, c long"
FILES_PER_BATCH = 2  # one read task per core of local[2]


def make_source(folder: str, rows: int, files: int) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    per = -(-rows // files)
    for i in range(files):
        ids = np.arange(i * per, min(rows, (i + 1) * per), dtype=np.int64)
        table = pa.table({"id": ids, "a": ids * 3, "b": ids % 1000, "c": ids * 7})
        pq.write_table(table, f"{folder}/part-{i:05d}.parquet")


def source_frame(spark, args, folder: str, rows: int):
    if args.source == "jvm":
        return (
            spark.readStream.schema(SCHEMA)
            .option("maxFilesPerTrigger", FILES_PER_BATCH)
            .parquet(folder)
        )
    return (
        spark.readStream.format("txn-sequence")
        .option("rowsPerBatch", -(-rows // args.batches))
        .option("totalRows", rows)
        .option("numPartitions", 2)
        .option("width", 3)
        .load()
    )


STEPS: dict[str, list[float]] = {}


def time_steps() -> None:
    """Wrap the fast path's steps (the driver's side of one batch) with timers."""
    from pyspark_txn.sinks import delta, delta_target, fast, twophase
    from pyspark_txn.state.backends import delta_log

    def wrap(owner, name: str, label: str) -> None:
        time_calls(owner, name, STEPS.setdefault(label, []).append)

    for owner, name, label in [
        (fast.DeltaBatchWriter, "__call__", "callback (all of the below)"),
        (fast, "read_query_id", "checkpoint: query id"),
        (fast, "read_batch_offsets", "checkpoint: offsets"),
        (delta_log.DeltaEventLog, "create_if_missing", "record table: create if missing"),
        (delta_target.DeltaTarget, "check_stream_schema", "target: schema check"),
        (delta.DeltaSinkOptions, "target_meta", "target: version, meta"),
        (twophase.TwoPhaseCommitter, "allocate", "allocate"),
        (fast, "write_marker", "marker"),
        (fast.DeltaBatchWriter, "_spark_write", "Spark's write (settings, job)"),
        (fast, "collect_spark_output", "list, CRC32, footers, fsync"),
        (twophase.TwoPhaseCommitter, "commit", "commit (record, Delta commit)"),
    ]:
        wrap(owner, name, label)


def files_summary(folder: str) -> dict:
    """What the parquet files under ``folder`` are: count, bytes, row groups, codecs and
    the columns with a dictionary-encoded chunk."""
    import pyarrow.parquet as pq

    summary: dict = {"files": 0, "bytes": 0, "row_groups": 0, "codecs": set(), "dict": set()}
    for top, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(top, folder)
            if not name.endswith(".parquet") or any(
                part.startswith(("_", ".")) for part in rel.split(os.sep) if part != "."
            ):  # Spark's _temporary, _spark_metadata; Delta's _delta_log checkpoints
                continue
            path = os.path.join(top, name)
            meta = pq.ParquetFile(path).metadata
            summary["files"] += 1
            summary["bytes"] += os.path.getsize(path)
            summary["row_groups"] += meta.num_row_groups
            for g in range(meta.num_row_groups):
                for c in range(meta.num_columns):
                    col = meta.row_group(g).column(c)
                    summary["codecs"].add(col.compression)
                    if "DICTIONARY" in str(col.encodings) or col.has_dictionary_page:
                        summary["dict"].add(col.path_in_schema)
    return {k: sorted(v) if isinstance(v, set) else v for k, v in summary.items()}


def run_once(spark, sink: str, args, folder: str, rows: int, work: str) -> float:
    import pyspark_txn

    shutil.rmtree(work, ignore_errors=True)
    chk, out = f"{work}/chk", f"{work}/out"
    w = (
        source_frame(spark, args, folder, rows)
        .writeStream.option("checkpointLocation", chk)
        .trigger(availableNow=True)
    )
    if sink == "parquet":
        w = w.format("parquet").option("path", out)
    elif sink == "fast":
        w = w.foreachBatch(pyspark_txn.delta_batch_writer(path=out, checkpoint=chk))
    elif sink == "fast-before":
        import pyspark_txn_before  # type: ignore[import-not-found]

        w = w.foreachBatch(pyspark_txn_before.delta_batch_writer(path=out, checkpoint=chk))
    elif sink == "txn-delta":
        w = w.format("txn-delta").option("path", out)
    elif sink == "count-only":
        w = w.format("bench-count-only")
    elif sink == "foreachBatch":
        w = w.foreachBatch(foreach_batch_to_delta(out, "bench"))
    else:
        raise ValueError(sink)
    t0 = time.perf_counter()
    query = w.start()
    query.awaitTermination()
    elapsed = time.perf_counter() - t0
    batches = len(query.recentProgress)
    LAST["addBatch_ms"] = sum(p["durationMs"].get("addBatch", 0) for p in query.recentProgress)
    if sink in ("parquet", "fast", "fast-before"):
        LAST["files"] = files_summary(out)
    assert batches == args.batches, f"{sink} ran {batches} batches, expected {args.batches}"
    if sink in ("fast", "fast-before", "txn-delta", "foreachBatch"):
        from deltalake import DeltaTable

        got = DeltaTable(out).count()
        assert got == rows, f"{sink} wrote {got} rows, expected {rows}"
    return elapsed


def main() -> None:
    import logging

    import pyspark_txn

    parser = argparse.ArgumentParser()
    parser.add_argument("--source", choices=("jvm", "python"), default="jvm")
    parser.add_argument("--rows", type=int, default=4_000_000)
    parser.add_argument("--batches", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1, help="seed of the per-round run order")
    parser.add_argument("--sinks", default=",".join(SINKS))
    parser.add_argument("--before", help="folder holding pyspark_txn_before (sink fast-before)")
    parser.add_argument("--steps", action="store_true", help="time the fast path's steps")
    args = parser.parse_args()
    if args.steps:
        time_steps()
    sinks = args.sinks.split(",")
    if args.before:
        sys.path.insert(0, os.path.abspath(args.before))
        if "fast-before" not in sinks:
            sinks.append("fast-before")
    logging.basicConfig(level=logging.WARNING)
    spark = pyspark_txn.local_session(
        "bench-fast",
        **{
            "spark.sql.execution.arrow.maxRecordsPerBatch": "100000",
            "spark.ui.showConsoleProgress": "false",
        },
    )
    spark.dataSource.register(CountOnlySink)
    work = tempfile.mkdtemp(prefix="txn-bench-fast-")
    folder = f"{work}/source"
    os.makedirs(folder)
    if args.source == "jvm":
        make_source(folder, args.rows, args.batches * FILES_PER_BATCH)
    warm_rows = args.rows // 10
    warm = f"{work}/warm-source"
    os.makedirs(warm)
    if args.source == "jvm":
        make_source(warm, warm_rows, args.batches * FILES_PER_BATCH)
    for sink in sinks:  # JIT, Python workers, the first batch of a fresh JVM
        run_once(spark, sink, args, warm, warm_rows, f"{work}/warmup")
    STEPS.clear()  # not the warm-up's
    times: dict[str, list[float]] = {s: [] for s in sinks}
    add_batch: dict[str, list[float]] = {s: [] for s in sinks}
    files: dict[str, dict] = {}
    rng = random.Random(args.seed)
    for r in range(args.rounds):
        for sink in rng.sample(sinks, len(sinks)):
            gc.collect()
            spark.sparkContext._jvm.System.gc()
            time.sleep(0.5)
            t = run_once(spark, sink, args, folder, args.rows, f"{work}/{sink}")
            times[sink].append(t)
            add_batch[sink].append(LAST["addBatch_ms"])
            if "files" in LAST:
                files[sink] = LAST.pop("files")
            print(
                f"round {r + 1} {sink:<12} {t:6.2f} s  {args.rows / t / 1e6:5.2f} M rows/s  "
                f"addBatch {LAST['addBatch_ms']:.0f} ms",
                flush=True,
            )
    spark.stop()
    shutil.rmtree(work, ignore_errors=True)
    rate = {s: args.rows / statistics.median(ts) / 1e6 for s, ts in times.items()}
    pairs = [
        ("fast", "parquet"),
        ("fast-before", "parquet"),
        ("fast", "fast-before"),
        ("fast", "txn-delta"),
        ("fast", "count-only"),
        ("fast", "foreachBatch"),
        ("txn-delta", "parquet"),
        ("count-only", "parquet"),
    ]
    ratios = {
        f"{a} / {b}": paired_ratio(times, a, b) for a, b in pairs if a in times and b in times
    }
    print(f"\n{args.source} source, {args.rows} rows in {args.batches} batches")
    print("median M rows/s: " + ", ".join(f"{s} {rate[s]:.2f}" for s in sinks))
    print("paired ratios (throughput): " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    print(
        "median addBatch ms: "
        + ", ".join(f"{s} {statistics.median(v):.0f}" for s, v in add_batch.items())
    )
    for sink, summary in files.items():
        print(f"files of {sink}: {summary}")
    if STEPS:
        print("fast path, median ms per batch:")
        for label, ms in STEPS.items():
            print(f"  {label:<32} {statistics.median(ms):8.1f}  (n={len(ms)})")
    os.makedirs("benchmarks/results", exist_ok=True)
    result = {
        "args": vars(args),
        "times_s": times,
        "add_batch_ms": add_batch,
        "m_rows_per_s": rate,
        "ratios": ratios,
        "files": files,
        "steps_ms": STEPS,
    }
    with open(f"benchmarks/results/fast_path_{args.source}_{args.batches}.json", "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
