"""Runs the txn-delta sink's protocol without Spark on S3, as Spark drives it: per batch
a fresh planner-side writer allocates, one task stages a partition, a fresh commit-side
writer commits (``benchmarks/protocol_batches.py`` on an object store).

    python protocol_driver.py ROOT_URI STORAGE_OPTIONS_JSON WARMUP BATCHES

Runs WARMUP batches, prints ``warm``, waits for a line on stdin (the test reads the
proxy's request counts), runs BATCHES more and prints ``done``. Its own process, so
that delta-rs' and obstore's IO never waits on a server living in the test's process.
"""

from __future__ import annotations

import json
import sys

import pyarrow as pa

from pyspark_txn.sinks.delta import DeltaSinkOptions
from pyspark_txn.sinks.delta_target import schema_to_b64
from pyspark_txn.sinks.staging import stage_partition

SCHEMA = pa.schema([pa.field("id", pa.int64()), pa.field("v", pa.string())])


def main() -> None:
    root, storage, warmup, batches = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    opts = DeltaSinkOptions.parse(
        {
            "path": f"{root}/table",
            "checkpointLocation": sys.argv[5],
            "recordTable": f"{root}/records",
            "storageOptions": storage,
        }
    )
    meta = {"uri": opts.path, "arrow_schema": schema_to_b64(SCHEMA), "partition_by": []}
    for b in range(warmup + batches):
        if b == warmup:
            print("warm", flush=True)
            sys.stdin.readline()
        sid, token = opts.committer().allocate(target_meta={"uri": opts.path})
        rows = pa.record_batch(
            [pa.array(range(b * 100, (b + 1) * 100)), pa.array(["x"] * 100)], schema=SCHEMA
        )
        txns = stage_partition([rows], opts.staging(), sid, token, 0, SCHEMA)
        committer = opts.committer()
        committer.commit(
            b,
            sid,
            token,
            txns,
            run_id="driver-run",
            source_offsets=[{"offset": b}],
            query_id="driver-query",
            target_meta={
                **meta,
                "merge_schema": False,
                **committer.target.base(),
            },
        )
    print(json.dumps({"done": warmup + batches}), flush=True)


if __name__ == "__main__":
    main()
