"""``pyspark-txn stuck``, ``abandon`` and ``verify``: find what did not finish, withdraw
it, re-read every file a live record names."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from ..operations.handle import DELTA, POSTGRES
from ..operations.repair import abandon_snapshot, snapshot_status, stuck_snapshots
from ..operations.verify import verify
from .args import (
    LOCATION_HELP,
    SINK_HELP,
    open_handle,
    sink_arguments,
    storage_argument,
    target_arguments,
)
from .render import CANNOT_SUCCEED, describe, gone_restart, progress_bar


def cmd_stuck(args: argparse.Namespace) -> int:
    handle = open_handle(args)
    stuck = stuck_snapshots(handle)
    if args.json:
        out = {
            "sink_id": handle.sink_id,
            "record_table": handle.record_table,
            "target_kind": handle.kind,
            "target": handle.target_label,
            "target_uri": handle.target_uri,
            "stuck": [s.to_json() for s in stuck],
        }
        print(json.dumps(out, indent=2))
        return 0
    if not stuck:
        print(f"sink {handle.sink_id}: no stuck snapshots")
        return 0
    print(f"sink {handle.sink_id}: {len(stuck)} snapshot record(s) whose phase 2 never completed")
    print(f"  target {handle.target_label}")
    why = CANNOT_SUCCEED.get(handle.kind or DELTA, CANNOT_SUCCEED[DELTA])
    for status in stuck:
        print()
        print("\n".join(describe(status)))
        if status.refusal is None:
            print(f"  if phase 2 can no longer succeed ({why}), withdraw it and restart the query:")
            print(
                f"    pyspark-txn abandon {shlex.quote(args.location)} "
                f"--snapshot {status.snapshot_id} --sink {handle.sink_id}"
            )
            print(
                "  otherwise restarting the query finishes it; a restart that fails the same "
                "way each time (its error, in the query's log, names the cause) means phase 2 "
                "cannot succeed as things are: fix that cause, or withdraw the snapshot"
            )
        else:
            print(f"  not abandonable: {status.refusal}")
    return 0


def cmd_abandon(args: argparse.Namespace) -> int:
    handle = open_handle(args)
    status = snapshot_status(handle, args.snapshot)
    print("\n".join(describe(status)))
    if status.state == "abandoned":
        if status.txn_states:  # prepared after the attempt was abandoned: dead, as a sweep knows
            abandon_snapshot(handle, args.snapshot, args.reason)
            print(
                f"it is already abandoned; rolled back the {len(status.txn_states)} prepared "
                "transaction(s) its tasks left, as recovery would"
            )
            return 0
        print("nothing to do: it is already abandoned")
        return 0
    if status.refusal is not None:
        print(
            f"pyspark-txn: error: snapshot {args.snapshot} cannot be abandoned: {status.refusal}",
            file=sys.stderr,
        )
        return 2
    if not args.yes:
        if not sys.stdin.isatty():
            print(
                "pyspark-txn: error: abandon asks for confirmation, but stdin is not a "
                "terminal; pass --yes to abandon without asking",
                file=sys.stderr,
            )
            return 2
        gone = (
            "prepared transactions are rolled back"
            if handle.kind == POSTGRES
            else "staged files are deleted"
        )
        answer = input(
            f"Abandon snapshot {args.snapshot}? Its {gone} and it can never be committed. [y/N] "
        )
        if answer.strip().lower() not in ("y", "yes"):
            print("not abandoned")
            return 1
    abandon_snapshot(handle, args.snapshot, args.reason)
    print(f"snapshot {args.snapshot} of sink {handle.sink_id} is abandoned.")
    if handle.kind == POSTGRES:
        print("Its prepared transactions are rolled back, as recovery would.")
    if status.target_gone is not None:
        print(f"But {status.target_gone}. {gone_restart(status)}.")
    elif status.record is not None:
        print(
            f"Restart the query: Spark replays batch {status.record.batch_id} and it is "
            "decided anew under a new snapshot id."
        )
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    handle = open_handle(args)
    progress, close = progress_bar()
    try:
        report = verify(handle, progress)
    finally:
        close()
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
        return 0 if report.ok else 1
    files = sum(s.files for s in report.snapshots)
    print(
        f"sink {report.sink_id}: {len(report.snapshots)} live snapshot records, {files} "
        f"{handle.terms.txns} in {report.target_uri}"
    )
    for sid, p in report.problems:
        print(f"  {p.severity}: snapshot {sid}: {p.handle}: {p.message}")
    errors, warnings = len(report.errors), len(report.warnings)
    print(
        "OK" + (f" ({warnings} warnings)" if warnings else "")
        if report.ok
        else f"{errors} problems found" + (f", {warnings} warnings" if warnings else "")
    )
    return 0 if report.ok else 1


def add_parsers(sub) -> None:
    """``stuck``, ``abandon`` and ``verify``."""
    p = sub.add_parser(
        "stuck",
        help="list snapshot records whose phase 2 never completed",
        description="List the sink's safe snapshot records whose phase 2 was never "
        "confirmed, with what the target holds. Restarting the query finishes them; one "
        "whose phase 2 can no longer succeed is withdrawn with `pyspark-txn abandon`. A "
        "running query shows its current batch here for a moment.",
    )
    sink_arguments(p)
    target_arguments(p)
    p.set_defaults(func=cmd_stuck)
    p = sub.add_parser(
        "abandon",
        help="withdraw a stuck snapshot record (or an open allocation)",
        description="Withdraw a snapshot record whose phase 2 can never succeed, or an open "
        "allocation: append an `abandoned` event and delete its staged files (txn-postgres: "
        "roll back its prepared transactions, as recovery would). Refused for a committed "
        "snapshot, a record that is not the last one, a batch the target already holds, and "
        "(txn-postgres) a record whose prepared transactions can all still commit or of "
        "which some already did. Stop the query first. Afterwards restart it: Spark "
        "replays the batch and it is decided anew under a new snapshot id.",
        epilog="exit status: 0 abandoned (or already abandoned), 1 declined at the prompt, "
        "2 refused or error (also: no terminal to confirm on and no --yes)",
    )
    p.add_argument("location", help=LOCATION_HELP)
    storage_argument(p)
    p.add_argument("--snapshot", type=int, required=True, help="the snapshot id to abandon")
    p.add_argument("--sink", help=SINK_HELP)
    p.add_argument(
        "--reason", default="abandoned by an operator", help="kept in the abandoned event"
    )
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    target_arguments(p)
    p.set_defaults(func=cmd_abandon)
    p = sub.add_parser(
        "verify",
        help="re-read every file a live snapshot record names; check sizes and CRC32s",
        description="Re-read every file named by a live (not abandoned) snapshot record of "
        "the sink and check it exists with the recorded size and CRC32. A committed "
        "record's file that is no longer in the target's current version (a later delete "
        "or vacuum) is a warning, not an error. txn-postgres: every prepared transaction "
        "a live record names must be committed with the recorded row count (or, while its "
        "phase 2 is pending, still prepared), and each committed batch's row in "
        "pyspark_txn_batches must be the record's own.",
        epilog="exit status: 0 all files OK (warnings allowed), 1 problems found, 2 error",
    )
    sink_arguments(p)
    target_arguments(p)
    p.set_defaults(func=cmd_verify)
