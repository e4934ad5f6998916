"""The ``pyspark-txn`` command line."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys

from . import _fs
from .errors import TxnError


def _record_table(location: str) -> str:
    """Accept a checkpoint location or a record table URI."""
    uri = _fs.normalize_uri(location)
    candidate = _fs.join(uri, "pyspark_txn", "records")
    from deltalake import DeltaTable

    if DeltaTable.is_deltatable(candidate):
        return candidate
    if DeltaTable.is_deltatable(uri):
        return uri
    raise TxnError(f"no record table at {location} (nor at {candidate})")


def _print_records(record_table: str, sink: str | None = None) -> None:
    from .state import DeltaEventLog, RecordStore

    store = RecordStore(DeltaEventLog(record_table))
    sinks = [sink] if sink else [s for s in store.log.streams()]
    for sink_id in sinks:
        events = store.events(sink_id)
        if events and events[0].kind.value in ("claim", "acked"):
            continue
        state = store.load_sink(sink_id)
        rec = state.execution_record
        print(f"sink {sink_id}")
        print(
            f"  execution record: epoch={rec.epoch} snapshot_id={rec.snapshot_id} "
            f"ongoing_snapshot_id={rec.ongoing_snapshot_id} "
            f"last_committed_batch={rec.last_committed_batch_id} query={rec.query_id}"
        )
        print(
            f"  {'seq':>4} {'event':<10} {'epoch':>5} {'snapshot':>8} {'batch':>5} {'rows':>8}  details"
        )
        for e in events:
            rows = e.payload.get("rows", "")
            detail = ""
            if e.kind.value == "snapshot":
                detail = (
                    f"{len(e.payload['txns'])} staged files, offsets {e.payload['source_offsets']}"
                )
            elif e.kind.value == "committed":
                detail = f"target version {e.payload.get('target_version')}"
            elif e.kind.value == "epoch":
                detail = f"run {e.payload.get('owner')}"
            print(
                f"  {e.seq:>4} {e.kind.value:<10} {e.epoch:>5} "
                f"{'' if e.snapshot_id is None else e.snapshot_id:>8} "
                f"{'' if e.batch_id is None else e.batch_id:>5} {rows:>8}  {detail}"
            )


def cmd_records(args: argparse.Namespace) -> int:
    _print_records(_record_table(args.location), args.sink)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """txn-sequence -> txn-delta in a few micro-batches, read back, then a replay."""
    from deltalake import DeltaTable

    from . import local_session

    base = os.path.abspath(args.dir)
    shutil.rmtree(base, ignore_errors=True)
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
    _print_records(_record_table(checkpoint))

    last = max(int(n) for n in os.listdir(os.path.join(checkpoint, "commits")) if n.isdigit())
    for name in (str(last), f".{last}.crc"):  # Hadoop keeps a checksum file beside it
        path = os.path.join(checkpoint, "commits", name)
        if os.path.exists(path):
            os.remove(path)
    print(
        f"\n3. Replay: deleted Spark's commit log of batch {last}, as if the driver died "
        "right after our commit; restarting the query ..."
    )
    from .state import DeltaEventLog, RecordStore

    store = RecordStore(DeltaEventLog(_record_table(checkpoint)))
    (sink_id,) = store.log.streams()
    seen = len(store.events(sink_id))
    run()
    new = [f"{e.kind.value}(snapshot={e.snapshot_id})" for e in store.events(sink_id)[seen:]]
    dt = DeltaTable(target)
    again = dt.to_pyarrow_table().num_rows
    print(f"   Spark ran batch {last} again. New record events: {', '.join(new)}:")
    print("   a new snapshot id was reserved for the attempt, but there is no new snapshot")
    print(f"   record: batch {last} was already decided, so phase 2 was a no-op and the")
    print("   attempt's staged files were discarded.")
    print(f"   The table still holds {again} rows (version {dt.version()}): exactly once.")
    spark.stop()
    return 0 if again == args.rows else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pyspark-txn", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log protocol steps")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="run the embedded exactly-once demo (local Delta tables)")
    p.add_argument("--dir", default="./demo", help="where the demo writes (default ./demo)")
    p.add_argument("--rows", type=int, default=10_000, help="rows to stream (default 10000)")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("records", help="show a sink's execution record and record events")
    p.add_argument("location", help="checkpoint location or record table URI")
    p.add_argument("--sink", help="only this sink id")
    p.set_defaults(func=cmd_records)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.func(args)
    except TxnError as e:
        print(f"pyspark-txn: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
