"""Speed of ``pyspark-txn snapshots export`` against a plain copy of the same files.

    .venv/bin/python benchmarks/export_speed.py [--batches 20] [--rows 200000]

Builds a txn-delta sink without Spark (allocate, stage, commit per batch),
then, alternating, exports the latest snapshot and copies the table's data
files with ``shutil.copyfile``; reports MB/s and rows/s of each (medians).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
import pyarrow as pa
from deltalake import DeltaTable

from pyspark_txn import snapshots
from pyspark_txn.sinks.delta import DeltaSinkOptions
from pyspark_txn.sinks.delta_target import schema_to_b64
from pyspark_txn.sinks.staging import stage_partition

SCHEMA = pa.schema([pa.field(f"c{i}", pa.int64()) for i in range(4)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="txn-export-")
    opts = DeltaSinkOptions.parse(
        {"path": f"{root}/table", "checkpointLocation": f"{root}/chk"}
    ).with_checkpoint_sink_id()
    opts.record_store().log.create_if_missing()
    rng = np.random.default_rng(7)
    for b in range(args.batches):
        committer = opts.committer()
        sid, token = committer.allocate()
        arrays = [pa.array(rng.integers(0, 2**40, args.rows)) for _ in SCHEMA]
        txns = stage_partition(
            [pa.record_batch(arrays, schema=SCHEMA)], opts.staging(), sid, token, 0, SCHEMA
        )
        committer.commit(
            b,
            sid,
            token,
            txns,
            run_id="bench",
            query_id="q",
            target_meta={
                "uri": opts.path,
                "arrow_schema": schema_to_b64(SCHEMA),
                "partition_by": [],
                "merge_schema": False,
                **committer.target.base(),
            },
        )
    files = [f for f in DeltaTable(opts.path).file_uris()]
    size = sum(os.path.getsize(f.removeprefix("file://")) for f in files)
    rows = args.batches * args.rows
    export_s, copy_s = [], []
    for r in range(args.rounds):
        t0 = time.perf_counter()
        snapshots.export(opts.checkpoint_location, f"r{r}", f"{root}/exports/r{r}")
        export_s.append(time.perf_counter() - t0)
        dest = f"{root}/copies/r{r}"
        os.makedirs(dest)
        t0 = time.perf_counter()
        for f in files:
            shutil.copyfile(f.removeprefix("file://"), os.path.join(dest, os.path.basename(f)))
        copy_s.append(time.perf_counter() - t0)
    mb = size / 1e6
    e, c = statistics.median(export_s), statistics.median(copy_s)
    print(f"{len(files)} files, {mb:.0f} MB, {rows:,} rows; medians of {args.rounds} rounds")
    print(f"export:     {e:.2f} s  {mb / e:.0f} MB/s  {rows / e / 1e6:.1f} M rows/s")
    print(f"plain copy: {c:.2f} s  {mb / c:.0f} MB/s  {rows / c / 1e6:.1f} M rows/s")
    print(f"export / plain copy throughput: {c / e:.2f}x")
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
