"""``pyspark-txn snapshots ...``: named snapshots (docs/snapshots.md)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys

from .. import storage
from ..errors import ConfigError, TxnError
from ..operations.handle import open_sink
from .args import LOCATION_HELP, SINK_HELP, sink_arguments, storage_argument
from .render import named_lines, progress_bar, request_json


def _state_spark(args: argparse.Namespace):
    """A local SparkSession when the export must read a stateful query's state tables."""
    from ..operations.state_export import has_state

    if args.state == "skip":
        return None
    handle = open_sink(args.location, args.sink)
    if handle.checkpoint is None or not has_state(handle.checkpoint, handle.storage):
        return None
    from ..session import local_session

    return local_session(app_name="pyspark-txn snapshots export")


def cmd_snapshots_export(args: argparse.Namespace) -> int:
    from ..operations import snapshots

    if args.at_next_commit:
        if args.snapshot is not None or args.batch is not None:
            raise ConfigError("--snapshot/--batch and --at-next-commit exclude each other")
        if args.replace_unfinished:
            raise ConfigError(
                "--replace-unfinished and --at-next-commit exclude each other: the sink "
                "never removes anything at a requested location"
            )
        request = snapshots.request_export(
            args.location, args.name, args.to, sink=args.sink, state=args.state
        )
        if args.wait is None:
            if args.json:
                print(json.dumps({"requested": request.to_json()}, indent=2))
            else:
                print(
                    f"requested {request.name}: the sink exports the batch it commits next to "
                    f"{request.location}; check with: pyspark-txn snapshots show "
                    f"{args.location} {request.name}"
                )
            return 0
        named = snapshots.wait_for_export(
            args.location, args.name, sink=args.sink, timeout=args.wait
        )
    else:
        if args.wait is not None:
            raise ConfigError("--wait needs --at-next-commit")
        # the cheap checks first: a local Spark session takes half a minute to start
        snapshots.check_export(
            args.location,
            args.name,
            args.to,
            args.snapshot,
            sink=args.sink,
            replace_unfinished=args.replace_unfinished,
            batch=args.batch,
        )
        spark = _state_spark(args)
        progress, close = progress_bar("export")
        try:
            named = snapshots.export(
                args.location,
                args.name,
                args.to,
                args.snapshot,
                sink=args.sink,
                progress=progress,
                state=args.state,
                spark=spark,
                replace_unfinished=args.replace_unfinished,
                batch=args.batch,
            )
        except TxnError:
            raise
        except Exception as e:  # the export withdrew its id and copy: one line, exit 2
            if storage.describe_store_error(e) is not None:
                raise
            raise TxnError(
                f"export {args.name!r} to {args.to} failed ({type(e).__name__}: {e}); its "
                "partial copy was removed and nothing was registered"
            ) from e
        finally:
            close()
    if args.json:
        print(json.dumps(named.to_json(), indent=2))
    else:
        print("exported " + "\n".join(named_lines(named)))
        print(f"  data: {named.location}/data   manifest: {named.location}/manifest")
    return 0


def cmd_snapshots_prepare_query(args: argparse.Namespace) -> int:
    from ..operations import snapshots

    progress, close = progress_bar("copy")
    try:
        prepared = snapshots.prepare_query(
            args.location,
            args.name,
            args.checkpoint,
            args.path,
            sink=args.sink,
            progress=progress,
        )
    finally:
        close()
    if args.json:
        print(json.dumps(dataclasses.asdict(prepared), indent=2, default=str))
        return 0
    print(
        f"prepared: checkpoint {prepared.checkpoint} resumes after batch {prepared.batch_id}; "
        f"table {prepared.path} holds {prepared.rows} rows.\n"
        "Start the same query (same sources, same order) with "
        f".option('checkpointLocation', {prepared.checkpoint!r}) and the txn-delta sink's "
        f".option('path', {prepared.path!r})."
    )
    return 0


def cmd_snapshots_offsets(args: argparse.Namespace) -> int:
    from ..operations import snapshots

    if args.kafka:
        print(snapshots.kafka_starting_offsets(args.location, args.name, args.source, args.sink))
        return 0
    offsets = snapshots.source_offsets(args.location, args.name, args.sink)
    if args.json:
        print(json.dumps(offsets, indent=2))
        return 0
    for i, offset in enumerate(offsets):
        print(f"{i}\t{offset if offset is not None else '-'}")
    return 0


def cmd_snapshots_list(args: argparse.Namespace) -> int:
    from ..operations import snapshots

    named = snapshots.list_snapshots(args.location, args.sink)
    requests = snapshots.list_requests(args.location, args.sink)
    if args.json:
        print(
            json.dumps(
                [{**n.to_json(), "state": "exported"} for n in named]
                + [request_json(r) for r in requests],
                indent=2,
            )
        )
        return 0
    if not named and not requests:
        print("no named snapshots")
    for n in named:
        print(
            f"{n.name}\texported\tsnapshot {n.snapshot_id}\tbatch {n.batch_id}\t"
            f"{n.details.get('rows')} rows\t{n.location}"
        )
    for r in requests:
        print(
            f"{r.name}\trequested\tfor the next commit\t\t"
            f"since {r.requested_at.isoformat() if r.requested_at else '?'}\t{r.location}"
        )
    return 0


def cmd_snapshots_show(args: argparse.Namespace) -> int:
    from ..operations import snapshots

    pending = {
        r.name: r
        for r in snapshots.list_requests(args.location, args.sink, command="snapshots show")
    }
    if args.name in pending:
        r = pending[args.name]
        if args.json:
            print(json.dumps(request_json(r), indent=2))
            return 0
        print(
            f"{r.name}: requested (not exported yet): the sink exports the batch it commits "
            f"next to {r.location}; requested "
            f"{r.requested_at.isoformat() if r.requested_at else '?'}\n"
            f"  cancel with: pyspark-txn snapshots cancel {shlex.quote(args.location)} {r.name}"
        )
        return 0
    n = snapshots.show(args.location, args.name, args.sink)
    if args.json:
        print(json.dumps({**n.to_json(), "state": "exported"}, indent=2))
        return 0
    print("\n".join(named_lines(n)))
    print(f"  Spark's offsets of batch {n.batch_id}: {n.details.get('source_offsets')}")
    print(f"  data checksum {n.details.get('data_checksum')}")
    return 0


def cmd_snapshots_cancel(args: argparse.Namespace) -> int:
    from ..operations import snapshots

    r = snapshots.cancel_request(args.location, args.name, sink=args.sink)
    if args.json:
        print(json.dumps({"cancelled": r.to_json()}, indent=2))
    else:
        print(f"cancelled the requested export {r.name} (to {r.location})")
    return 0


def cmd_snapshots_verify(args: argparse.Namespace) -> int:
    from ..operations import snapshots

    progress, close = progress_bar("verify")
    try:
        check = snapshots.verify(args.location, args.name, args.sink, progress)
    finally:
        close()
    if args.json:
        print(json.dumps(check.to_json(), indent=2))
        return 0 if check.ok else 1
    if check.readable:
        print(f"{check.name}: {check.files} files, {check.rows} rows at {check.location}")
    else:
        print(f"{check.name}: unreadable export at {check.location}")
    for p in check.problems:
        print(f"  error: {p}")
    print("OK" if check.ok else f"{len(check.problems)} problems found")
    return 0 if check.ok else 1


def cmd_snapshots_delete(args: argparse.Namespace) -> int:
    from ..operations import snapshots

    n = snapshots.show(args.location, args.name, args.sink)
    if not args.force and snapshots.backup_of_part(n.name, n.location) is not None:
        snapshots.delete(args.location, args.name, args.sink)  # refused, naming the backup
    if not args.yes:
        if not sys.stdin.isatty():
            raise ConfigError(
                "delete asks for confirmation, but stdin is not a terminal; pass --yes to "
                "delete without asking"
            )
        answer = input(f"Delete snapshot {n.name!r} and everything under {n.location}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("not deleted")
            return 1
    snapshots.delete(args.location, args.name, args.sink, force=args.force)
    if args.json:
        print(json.dumps({"deleted": n.to_json()}, indent=2))
    else:
        print(f"deleted {n.name} ({n.location})")
    return 0


def add_parsers(sub) -> None:
    """``snapshots export|prepare-query|offsets|list|show|verify|delete|cancel``."""
    snaps = sub.add_parser(
        "snapshots",
        help="named snapshots: export, list, show, verify, delete, cancel, prepare-query, offsets",
        description="Named snapshots of a txn-delta sink: a committed snapshot exported as "
        "standalone Delta tables (data/, manifest/) and registered under a name in the "
        "sink's record table. See docs/snapshots.md.",
    )
    ssub = snaps.add_subparsers(dest="snapshots_command", required=True)
    p = ssub.add_parser(
        "export",
        help="export a committed snapshot under a name",
        description="Copy the sink's target as of a committed snapshot (default: the "
        "latest) to TO/data, write TO/manifest, then register NAME. Export-only: the "
        "running query is not touched.",
        epilog="exit status: 0 exported, 2 error",
    )
    p.add_argument("location", help=LOCATION_HELP)
    storage_argument(p)
    p.add_argument("name", help="letters, digits, '-', '_', '.'; unique per sink")
    p.add_argument("--to", required=True, help="a new or empty directory (URI)")
    p.add_argument("--snapshot", type=int, help="the sink's snapshot id (default: latest)")
    p.add_argument(
        "--batch", type=int, help="Spark's batch id, instead of --snapshot (default: latest)"
    )
    p.add_argument(
        "--at-next-commit",
        action="store_true",
        help="ask the running query to export the batch it commits next (inside its commit)",
    )
    p.add_argument(
        "--wait",
        type=float,
        metavar="SECONDS",
        help="with --at-next-commit: wait up to SECONDS for the export (default: do not wait)",
    )
    p.add_argument(
        "--state",
        choices=("auto", "include", "skip"),
        default="auto",
        help="state tables of a stateful query: auto (if it has state; starts a local Spark), "
        "include (required), skip",
    )
    p.add_argument(
        "--replace-unfinished",
        action="store_true",
        help="remove the partial copy of an unfinished export at --to even if its writer may "
        "still run (only when you know it is dead)",
    )
    p.add_argument("--sink", help=SINK_HELP)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_snapshots_export)
    p = ssub.add_parser(
        "prepare-query",
        help="prepare a checkpoint and table that start a new query at a named snapshot",
        description="Copy the snapshot's data into a new table at --path and write a Spark "
        "checkpoint at --checkpoint whose last committed batch is the snapshot's, with its "
        "offsets. The same query started with both resumes exactly there.",
        epilog="exit status: 0 prepared, 2 error",
    )
    sink_arguments(p, name=True)
    p.add_argument("--checkpoint", required=True, help="the new query's checkpoint (new/empty)")
    p.add_argument("--path", required=True, help="the new query's target table (new/empty)")
    p.set_defaults(func=cmd_snapshots_prepare_query)
    p = ssub.add_parser(
        "offsets",
        help="print the snapshot's source offsets (e.g. a Kafka startingOffsets JSON)",
        epilog="exit status: 0, 2 error",
    )
    sink_arguments(p, name=True)
    p.add_argument(
        "--kafka", action="store_true", help="print source --source as Kafka startingOffsets"
    )
    p.add_argument("--source", type=int, default=0, help="source index for --kafka (default 0)")
    p.set_defaults(func=cmd_snapshots_offsets)
    p = ssub.add_parser("list", help="list named snapshots", epilog="exit status: 0, 2 error")
    sink_arguments(p)
    p.set_defaults(func=cmd_snapshots_list)
    p = ssub.add_parser("show", help="show one named snapshot", epilog="exit status: 0, 2 error")
    sink_arguments(p, name=True)
    p.set_defaults(func=cmd_snapshots_show)
    p = ssub.add_parser(
        "verify",
        help="re-read an export; compare files, sizes, CRC32s and rows with the registry",
        epilog="exit status: 0 OK, 1 mismatches found, 2 error",
    )
    sink_arguments(p, name=True)
    p.set_defaults(func=cmd_snapshots_verify)
    p = ssub.add_parser(
        "delete",
        help="remove a named snapshot's export, then its name",
        epilog="exit status: 0 deleted, 1 declined at the prompt, 2 error",
    )
    sink_arguments(p, name=True)
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.add_argument(
        "--force",
        action="store_true",
        help="delete a backup's part too (that backup then no longer restores)",
    )
    p.set_defaults(func=cmd_snapshots_delete)
    p = ssub.add_parser(
        "cancel",
        help="cancel an export requested with --at-next-commit that has not run yet",
        epilog="exit status: 0 cancelled, 2 error (also: the export already ran)",
    )
    sink_arguments(p, name=True)
    p.set_defaults(func=cmd_snapshots_cancel)
