"""``pyspark-txn demo``: the embedded exactly-once demo on local Delta tables."""

from __future__ import annotations

import argparse
import os
import shutil

from ..errors import ConfigError
from ..operations.handle import find_record_table, open_sink
from .status import _print_records

DEMO_MARKER = ".pyspark-txn-demo"
DEMO_OUTPUTS = {"orders", "checkpoint"}  # what demos before the marker left behind


def cmd_demo(args: argparse.Namespace) -> int:
    """txn-sequence -> txn-delta in a few micro-batches, read back, then a replay."""
    from deltalake import DeltaTable

    from .. import local_session

    base = os.path.abspath(args.dir)
    marker = os.path.join(base, DEMO_MARKER)
    if os.path.exists(base) and not os.path.isdir(base):
        raise ConfigError(f"--dir {args.dir}: is a file; choose a new or empty directory")
    entries = set(os.listdir(base)) if os.path.isdir(base) else set()
    if entries and DEMO_MARKER not in entries and not entries <= DEMO_OUTPUTS:
        raise ConfigError(
            f"--dir {args.dir}: the directory exists and was not made by the demo; "
            "choose a new or empty directory (the demo starts afresh by deleting its own)"
        )
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(base)
    with open(marker, "w") as f:
        f.write("made by `pyspark-txn demo`; the next demo run deletes this directory\n")
    target, checkpoint = os.path.join(base, "orders"), os.path.join(base, "checkpoint")
    print(f"pyspark-txn demo in {base}: starting a local Spark session ...", flush=True)
    spark = local_session("pyspark-txn-demo")

    def run() -> None:
        (
            spark.readStream.format("txn-sequence")
            .option("rowsPerBatch", args.rows // 4)
            .option("totalRows", args.rows)
            .load()
            .writeStream.format("txn-delta")
            .option("path", target)
            .option("checkpointLocation", checkpoint)
            .trigger(availableNow=True)
            .start()
            .awaitTermination()
        )

    run()
    dt = DeltaTable(target)
    table = dt.to_pyarrow_table()
    ids = table.column("id").to_pylist()
    print(f"\n1. Streamed {args.rows} rows into the Delta table {target}")
    print(
        f"   read back with delta-rs: {table.num_rows} rows, {len(set(ids))} distinct ids, "
        f"table version {dt.version()}"
    )
    print("\n2. The record table (snapshot records written before each commit):")
    _print_records(find_record_table(checkpoint)[0])

    last = max(int(n) for n in os.listdir(os.path.join(checkpoint, "commits")) if n.isdigit())
    for name in (str(last), f".{last}.crc"):  # Hadoop keeps a checksum file beside it
        path = os.path.join(checkpoint, "commits", name)
        if os.path.exists(path):
            os.remove(path)
    print(
        f"\n3. Replay: deleted Spark's commit log of batch {last}, as if the driver died "
        "right after our commit; restarting the query ..."
    )
    handle = open_sink(checkpoint)
    store = handle.record_store()
    seen = len(store.events(handle.sink_id))
    run()
    new = [
        "epoch(a new run)"
        if e.kind.value == "epoch"
        else f"{e.kind.value}(snapshot={e.snapshot_id})"
        for e in store.events(handle.sink_id)[seen:]
    ]
    dt = DeltaTable(target)
    again = dt.to_pyarrow_table().num_rows
    print(f"   Spark ran batch {last} again. New record events: {', '.join(new)}:")
    print("   the restarted query is a new run and took the sink's epoch; a new snapshot id")
    print("   was reserved for the attempt, but there is no new snapshot")
    print(f"   record: batch {last} was already decided, so phase 2 was a no-op and the")
    print("   attempt's staged files were discarded.")
    print(f"   The table still holds {again} rows (version {dt.version()}): exactly once.")
    spark.stop()
    return 0 if again == args.rows else 1


def add_parsers(sub) -> None:
    """``demo``."""
    p = sub.add_parser("demo", help="run the embedded exactly-once demo (local Delta tables)")
    p.add_argument("--dir", default="./demo", help="where the demo writes (default ./demo)")
    p.add_argument("--rows", type=int, default=10_000, help="rows to stream (default 10000)")
    p.set_defaults(func=cmd_demo)
