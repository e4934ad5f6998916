"""Per-batch cost of the sink protocol without Spark: tiny batches through the real
record table and a real Delta target on local disk.

    .venv/bin/python benchmarks/protocol_batches.py [--batches 3000] [--block 500]

Each batch does what the sink does: allocate (planner), stage one partition of
``--rows`` rows (task), commit (driver: decide, record, phase 2). Per block it
reports the median and p99 time per batch, the record table's files and bytes
(and ``_delta_log`` files), and this process's RSS: a flat median and bounded
files are issue 10's goals. ``--profile`` prints where the time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import os
import pstats
import statistics
import tempfile
import time

import pyarrow as pa

from pyspark_txn.sinks.delta import DeltaSinkOptions
from pyspark_txn.sinks.delta_target import schema_to_b64
from pyspark_txn.sinks.staging import stage_partition

SCHEMA = pa.schema([pa.field("id", pa.int64()), pa.field("v", pa.string())])


def folder_size(path: str) -> tuple[int, int, int]:
    files = size = log_files = 0
    for root, _, names in os.walk(path):
        for n in names:
            files += 1
            size += os.path.getsize(os.path.join(root, n))
            log_files += root.endswith("_delta_log")
    return files, size, log_files


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=3000)
    p.add_argument("--block", type=int, default=500)
    p.add_argument("--rows", type=int, default=10)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--option", action="append", default=[], help="extra sink option k=v")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    root = tempfile.mkdtemp(prefix="txn-protocol-")
    options = {"path": f"{root}/table", "checkpointLocation": f"{root}/chk"}
    options.update(dict(o.split("=", 1) for o in args.option))
    opts = DeltaSinkOptions.parse(options)
    committer = opts.committer()
    committer.store.log.create_if_missing()
    staging = opts.staging()
    meta = {
        "uri": opts.path,
        "arrow_schema": schema_to_b64(SCHEMA),
        "partition_by": [],
        "merge_schema": False,
    }
    profiler = cProfile.Profile() if args.profile else None
    times: list[float] = []
    print(
        f"{'block':>11} {'median ms':>9} {'p99 ms':>7} {'rec files':>9} {'rec KiB':>8} "
        f"{'log files':>9} {'RSS MiB':>8}"
    )
    for b in range(args.batches):
        t0 = time.perf_counter()
        if profiler:
            profiler.enable()
        committer = opts.committer()  # Spark makes a fresh writer for every batch
        sid, token = committer.allocate()
        batch = pa.record_batch(
            [pa.array(range(b * args.rows, (b + 1) * args.rows)), pa.array(["x"] * args.rows)],
            schema=SCHEMA,
        )
        txns = stage_partition([batch], staging, sid, token, 0, SCHEMA)
        committer.commit(
            b,
            sid,
            token,
            txns,
            run_id="bench-run",
            source_offsets=[{"offset": b}],
            query_id="bench-query",
            target_meta={**meta, **committer.target.base()},
        )
        if profiler:
            profiler.disable()
        times.append((time.perf_counter() - t0) * 1000)
        if (b + 1) % args.block == 0:
            block = times[-args.block :]
            files, size, log_files = folder_size(opts.record_table)
            p99 = statistics.quantiles(block, n=100)[-1]
            print(
                f"{b + 2 - args.block:>5}-{b + 1:<5} {statistics.median(block):>9.1f} "
                f"{p99:>7.1f} {files:>9} {size / 1024:>8.0f} {log_files:>9} {rss_mb():>8.0f}",
                flush=True,
            )
    if profiler:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(
            int(os.environ.get("PROFILE_LINES", "40"))
        )


if __name__ == "__main__":
    main()
