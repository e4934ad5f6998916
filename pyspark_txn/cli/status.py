"""``pyspark-txn records`` (a sink's execution record and events) and ``pyspark-txn
status`` (progress, lag, target, record-table size, anything stuck)."""

from __future__ import annotations

import argparse
import json
import shlex

from .. import storage
from ..operations.handle import (
    POSTGRES,
    describe_origin,
    describe_target,
    find_record_table,
    recorded_target,
    sink_streams,
    target_kind,
    target_terms,
)
from ..operations.status import (
    DEFAULT_STALE_AFTER_S,
    LightSinkStatus,
    NotStartedStatus,
    SinkStatus,
    location_status,
)
from ..state import allocated_ids
from ..storage.checkpoint import read_sink_file
from .args import LOCATION_HELP, sink_arguments, storage_argument, target_arguments
from .render import describe, holds, light_status_lines, not_started_lines


def _print_records(record_table: str, sink: str | None = None) -> None:
    from ..state import DeltaEventLog, RecordStore

    store = RecordStore(DeltaEventLog(record_table, storage.current().for_delta()))
    for sink_id in [sink] if sink else sink_streams(store):
        events = store.events(sink_id)
        state = store.load_sink(sink_id)
        rec = state.execution_record
        meta = recorded_target(store, sink_id, state)
        terms = target_terms(target_kind(meta))
        print(f"sink {sink_id}")
        print(f"  target: {describe_target(meta)}")
        print(
            f"  execution record: epoch={rec.epoch} snapshot_id={rec.snapshot_id} "
            f"ongoing_snapshot_id={rec.ongoing_snapshot_id} query={rec.query_id or '-'}"
        )
        # The last record's phase 2 is confirmed by the next record (or by recovery), so
        # "confirmed" trails the last recorded batch by one while a query runs.
        last = state.last_record
        confirmed = rec.last_committed_batch_id
        print(
            f"  last recorded batch: {last.batch_id if last else 'none'}; phase 2 confirmed "
            "in the record table "
            + ("for no batch yet" if confirmed is None else f"through batch {confirmed}")
            + " (`pyspark-txn status` asks the target itself)"
        )
        print(
            f"  {'seq':>4} {'event':<10} {'epoch':>5} {'snapshot':>8} {'batch':>5} {'rows':>8}  details"
        )
        for e in events:
            rows = e.payload.get("rows", "")
            detail = ""
            if e.kind.value == "snapshot":
                detail = (
                    f"{len(e.payload['txns'])} {terms.txns}, offsets {e.payload['source_offsets']}"
                )
                confirms = sorted(int(k) for k in e.payload.get("confirms") or {})
                if confirms:
                    detail += f"; confirms phase 2 of snapshot {', '.join(map(str, confirms))}"
            elif e.kind.value == "summary":
                detail = (
                    f"history of {e.payload.get('summarized_events')} events summarized: "
                    f"{len(e.payload.get('records', []))} records, "
                    f"{len(e.payload.get('named', []))} named snapshots kept"
                )
            elif e.kind.value == "named":
                detail = f"named snapshot {e.payload.get('name')!r} at {e.payload.get('location')}"
            elif e.kind.value == "name_deleted":
                detail = f"named snapshot {e.payload.get('name')!r} deleted"
            elif e.kind.value == "committed":
                detail = terms.committed_as(e.payload.get("target_version"))
            elif e.kind.value == "epoch":
                detail = f"run {e.payload.get('owner')}"
            elif e.kind.value == "abandoned":
                detail = f"reason: {e.payload.get('reason')}"
            elif e.kind.value == "allocated" and len(e.payload.get("tokens") or ()) > 1:
                ids = allocated_ids(e)
                detail = f"reserves snapshots {ids[0][0]}-{ids[-1][0]} (a planner's lease)"
            print(
                f"  {e.seq:>4} {e.kind.value:<10} {e.epoch:>5} "
                f"{'' if e.snapshot_id is None else e.snapshot_id:>8} "
                f"{'' if e.batch_id is None else e.batch_id:>5} {rows:>8}  {detail}"
            )


def cmd_records(args: argparse.Namespace) -> int:
    record_table, checkpoint = find_record_table(args.location)
    sink = args.sink
    if sink is None and checkpoint is not None:
        # a checkpoint names its own sink: a record table shared by several queries
        # (option recordTable) holds the others' too (`--sink` or the table lists them)
        kept = read_sink_file(checkpoint, storage.current())
        sink = kept.get("sink_id") if kept else None
    _print_records(record_table, sink)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    status = location_status(
        args.location,
        args.sink,
        target_uri=args.target,
        url=args.url,
        password_file=args.password_file,
        stale_after_s=args.stale_after,
    )
    if args.json:
        print(json.dumps(status.to_json(), indent=2))
    elif isinstance(status, LightSinkStatus):
        print("\n".join(light_status_lines(status)))
    elif isinstance(status, NotStartedStatus):
        print("\n".join(not_started_lines(status)))
    else:
        _print_sink_status(status, args)
    return 0 if status.healthy else 1


def _print_sink_status(status: SinkStatus, args: argparse.Namespace) -> None:
    d = status.to_json()
    verdict = "healthy" if status.healthy else "NEEDS ATTENTION"
    if status.healthy and status.open_attempts:
        verdict = "healthy, with a batch in flight or left unfinished"
    elif status.healthy and status.open_exports:
        verdict = "healthy, with an export running or left unfinished"
    print(f"sink {d['sink_id']}: {verdict}")
    started = status.started_from
    if started is not None:
        print(f"  {describe_origin(started)} at batch {started.get('batch_id')}")
    if status.failed_attempt:
        print(
            f"  failed: Spark planned batch {d['spark_planned_batch']}, but its last attempt "
            "was aborted by Spark and rolled back, and no run has tried it since (the "
            "query failed or was stopped in it; its driver log says why): fix the cause "
            "and restart the query, which replays the batch"
        )
    if status.open_attempts:
        staged = (
            f"; {d['staged_txns']} prepared transaction(s) holding their rows' locks"
            if d["staged_txns"]
            else ""
        )
        print(
            f"  unfinished: snapshot(s) {', '.join(map(str, status.open_attempts))} allocated "
            f"and not recorded{staged}: a batch of a running query, or what a failed or "
            "killed run left, which the query's next start rolls back (or: pyspark-txn "
            f"abandon {shlex.quote(args.location)} --snapshot N)"
        )
    if status.open_exports:
        n = status.open_exports[0] if len(status.open_exports) == 1 else "N"
        print(
            f"  export: snapshot id(s) {', '.join(map(str, status.open_exports))} allocated "
            "by an export that has not registered yet: an export running now, or what a "
            "killed export left (once none runs: pyspark-txn abandon "
            f"{shlex.quote(args.location)} --snapshot {n} withdraws it; export again to "
            "the same --to with --replace-unfinished)"
        )
    if d["last_batch"] is None:
        print("  no batch recorded yet")
    else:
        lag = d["lag_seconds"]
        print(
            f"  last batch {d['last_batch']} (snapshot {d['last_snapshot_id']}, "
            f"{d['last_rows']} rows), recorded {d['last_recorded_at']}"
            + (f", {lag:.0f} s ago" if lag is not None else "")
        )
    if d["spark_planned_batch"] is not None:
        committed = d["spark_committed_batch"]
        print(
            f"  Spark's checkpoint: batch {d['spark_planned_batch']} planned, "
            + ("no batch committed" if committed is None else f"batch {committed} committed")
        )
    target = d["target"]
    if target is None:
        print("  target: not known yet (no snapshot record names it)")
    elif d["target_error"]:
        print(f"  target {target}: cannot be read: {d['target_error']}")
    elif d["target_kind"] == POSTGRES:
        print(
            f"  target {target}: {holds(d['target_batch'])} "
            f"(pyspark_txn_batches); {d['staged_txns']} prepared transaction(s) of "
            f"{d['staged_attempts']} attempt(s) pending"
        )
    elif d["target_version"] is None:
        print(f"  target {target}: no table")
    else:
        print(
            f"  target {target}: version {d['target_version']}, "
            f"{holds(d['target_batch'])}; staging markers of "
            f"{d['staged_attempts']} recent attempt(s) (a sweep every 32 snapshot ids "
            "forgets the settled ones: up to ~64 are kept)"
        )
    for problem in status.problems:
        print(f"  problem: {problem}")
    if d["run_id"] is None:
        print("  no run holds the sink yet (a run takes it at its first commit)")
    else:
        query = f" (query {d['query_id']})" if d["query_id"] else ""
        print(f"  run {d['run_id']} holds epoch {d['epoch']}{query}")
    print(
        f"  record table {d['record_table']}: {d['record_table_events']} events in its "
        f"history, {d['record_table_files']} files, {d['record_table_bytes']} bytes"
    )
    for r in status.export_requests:
        print(
            f"  export {r.name!r} requested for the next commit, to {r.location} (see: "
            f"pyspark-txn snapshots show {shlex.quote(args.location)} {r.name})"
        )
    for s in status.stuck:
        print("  stuck: " + "\n    ".join(describe(s)))
        print(f"    see: pyspark-txn stuck {shlex.quote(args.location)}")


def add_parsers(sub) -> None:
    """``records`` and ``status``."""
    p = sub.add_parser("records", help="show a sink's execution record and record events")
    p.add_argument("location", help=LOCATION_HELP)
    p.add_argument("--sink", help="only this sink id")
    storage_argument(p)
    p.set_defaults(func=cmd_records)
    p = sub.add_parser(
        "status",
        help="summarise a sink: last batch, lag, target, record-table size, anything stuck",
        description="Summarise one sink (txn-delta or txn-postgres) from its record table, "
        "target and Spark "
        "checkpoint, without Spark: the last recorded batch and how long ago, what the "
        "target holds, the run holding the sink, the record table's size, and any snapshot "
        "whose phase 2 never completed. A mode=light sink (no record table): its last "
        "batch from its Delta table's history (--target) and Spark's checkpoint. A "
        "checkpoint made by snapshots prepare-query or backups restore: where it came from "
        "and its next batch. Safe while the query runs.",
        epilog="exit status: 0 healthy, 1 needs attention (stuck snapshot, unreadable "
        "target, a light sink's batch planned and not written for --stale-after seconds), "
        "2 error",
    )
    sink_arguments(p)
    target_arguments(p)
    p.add_argument(
        "--target",
        metavar="URI",
        help="the sink's Delta table: a mode=light checkpoint does not name it (without "
        "it, only Spark's checkpoint is shown); for other sinks it replaces the one their "
        "records name",
    )
    p.add_argument(
        "--stale-after",
        metavar="SECONDS",
        type=_seconds,
        default=DEFAULT_STALE_AFTER_S,
        help="mode=light: a batch Spark planned and the table does not hold after this "
        f"long needs attention (default {DEFAULT_STALE_AFTER_S:.0f})",
    )
    p.set_defaults(func=cmd_status)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value
