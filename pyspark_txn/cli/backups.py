"""``pyspark-txn backups``: consistent backups of a pipeline of queries (docs/backups.md).

Exit codes as the other commands: 0 done/OK, 1 problems found (verify), not completed
(status) or declined (delete), 2 error.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import ConfigError
from ..operations import backups
from .args import storage_argument

TO_HELP = "where the backups live (their catalog is <to>/_catalog)"


def _common(p: argparse.ArgumentParser, *, backup_id: bool = True) -> None:
    storage_argument(p)
    if backup_id:
        p.add_argument("backup_id", type=int, help="the backup id")
    p.add_argument("--to", required=True, help=TO_HELP)
    p.add_argument("--json", action="store_true", help="print JSON")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add ``backups`` and its sub-commands to the CLI's sub-parsers."""
    b = sub.add_parser(
        "backups",
        help="consistent backups of a pipeline of txn-delta queries: take, status, list, "
        "show, verify, delete, restore",
        description="A backup holds one named snapshot per query, cut consistently along "
        "the pipeline (no downstream part holds rows its upstream part lacks); "
        "docs/backups.md.",
    )
    bsub = b.add_subparsers(dest="backups_command", required=True)
    p = bsub.add_parser(
        "take",
        help="back up running queries as one consistent set",
        description="take [ID] CHK [CHK...] --to URI: back up the queries with these "
        "checkpoint locations (ID: a positive integer above every id so far; default the "
        "next one). A query reading another member's table needs --reads.",
        epilog="exit status: 0 completed, 2 refused or failed",
    )
    _common(p, backup_id=False)
    p.add_argument("args", nargs="+", metavar="[ID] CHK", help="optional id, then checkpoints")
    p.add_argument(
        "--reads",
        action="append",
        default=[],
        metavar="CHK=TABLE[,TABLE...]",
        help="the table(s) a query's txn-delta source(s) read, one per source in order "
        "('-' for a source that is not txn-delta); repeat per query",
    )
    p.set_defaults(func=cmd_take)
    p = bsub.add_parser(
        "status",
        help="each member's part and the whole backup",
        epilog="exit status: 0 completed, 1 not completed, 2 error",
    )
    _common(p)
    p.set_defaults(func=cmd_status)
    p = bsub.add_parser("show", help="a backup's parts in detail", epilog="exit status: 0, 2 error")
    _common(p)
    p.set_defaults(func=cmd_show)
    p = bsub.add_parser("list", help="every backup in --to", epilog="exit status: 0, 2 error")
    _common(p, backup_id=False)
    p.set_defaults(func=cmd_list)
    p = bsub.add_parser(
        "verify",
        help="re-read every part's files and check the cut",
        epilog="exit status: 0 OK, 1 problems found, 2 error",
    )
    _common(p)
    p.set_defaults(func=cmd_verify)
    p = bsub.add_parser(
        "delete",
        help="remove every member's part (the id stays used)",
        epilog="exit status: 0 deleted, 1 declined, 2 error",
    )
    _common(p)
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.set_defaults(func=cmd_delete)
    p = bsub.add_parser(
        "restore",
        help="give every member a table and checkpoint at its part (new ones, or in place)",
        description="--into DIR writes <into>/part-<i>/table and /checkpoint per member; "
        "start the same queries on them (downstream sources reading the restored upstream "
        "tables). --in-place writes each member's own checkpoint and target, which must be "
        "gone or empty (lost, or moved away first); restart the queries unchanged. Needs "
        "only the backup location.",
        epilog="exit status: 0 restored, 2 refused or error",
    )
    _common(p)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--into", help="a new or empty directory")
    where.add_argument(
        "--in-place",
        action="store_true",
        help="restore at the members' own checkpoints and target tables (gone or empty)",
    )
    p.add_argument(
        "--accept-message-loss",
        action="store_true",
        help="restore members with acknowledging sources (txn-redis) although messages "
        "acknowledged after the backup cannot be read again",
    )
    p.set_defaults(func=cmd_restore)


def _parse_reads(raw: list[str]) -> dict[str, list[str | None]]:
    out: dict[str, list[str | None]] = {}
    for item in raw:
        chk, sep, tables = item.partition("=")
        if not sep or not chk or not tables:
            raise ConfigError(f"--reads {item!r}: expected CHK=TABLE[,TABLE...]")
        out[chk] = [None if t == "-" else t for t in tables.split(",")]
    return out


def _member_line(m) -> str:
    line = f"  {m.checkpoint}: {m.state}"
    if m.reason:
        line += f" ({m.reason})"
    if m.state == "completed":
        line += f", batch {m.batch_id}, table version {m.target_version}, at {m.location}"
    return line


def _print_status(st, *, detail: bool = False) -> None:
    print(f"backup {st.backup_id}: {st.state}" + (f" ({st.reason})" if st.reason else ""))
    for m in st.members:
        print(_member_line(m))
        if detail and m.source_offsets:
            print(f"    source offsets: {json.dumps(list(m.source_offsets), sort_keys=True)}")


def cmd_take(args: argparse.Namespace) -> int:
    rest = list(args.args)
    backup_id = None
    if rest[0].isdigit():
        backup_id = int(rest.pop(0))
    if not rest:
        raise ConfigError("backups take: give at least one checkpoint location")
    st = backups.take(backup_id, rest, args.to, reads=_parse_reads(args.reads))
    if args.json:
        print(json.dumps(st.to_json(), indent=2, default=str))
    else:
        _print_status(st)
    return 0 if st.state == "completed" else 2


def cmd_status(args: argparse.Namespace) -> int:
    st = backups.status(args.backup_id, args.to)
    if args.json:
        print(json.dumps(st.to_json(), indent=2, default=str))
    else:
        _print_status(st)
    return 0 if st.state == "completed" else 1


def cmd_show(args: argparse.Namespace) -> int:
    st = backups.show(args.backup_id, args.to)
    if args.json:
        print(json.dumps(st.to_json(), indent=2, default=str))
    else:
        _print_status(st, detail=True)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    all_ = backups.list_backups(args.to)
    if args.json:
        print(json.dumps([b.to_json() for b in all_], indent=2, default=str))
    else:
        for b in all_:
            print(f"{b.backup_id}\t{b.state}\t{len(b.members)} members\t{b.created_at}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    check = backups.verify(args.backup_id, args.to)
    if args.json:
        print(json.dumps(check.to_json(), indent=2, default=str))
    else:
        for member, c in zip(check.members, check.checks, strict=True):
            print(f"{member}: {c.files} files, {c.rows} rows at {c.location}")
        for p in check.problems:
            print(f"  error: {p}")
        print("OK" if check.ok else f"{len(check.problems)} problems found")
    return 0 if check.ok else 1


def cmd_delete(args: argparse.Namespace) -> int:
    st = backups.status(args.backup_id, args.to)
    if not args.yes:
        if not sys.stdin.isatty():
            raise ConfigError(
                "delete asks for confirmation, but stdin is not a terminal; pass --yes to "
                "delete without asking"
            )
        answer = input(f"Delete every part of backup {st.backup_id}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("not deleted")
            return 1
    st = backups.delete(args.backup_id, args.to)
    if args.json:
        print(json.dumps({"deleted": st.to_json()}, indent=2, default=str))
    else:
        print(f"deleted backup {st.backup_id} (its id stays used)")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    restored = backups.restore(
        args.backup_id,
        args.to,
        args.into,
        in_place=args.in_place,
        accept_message_loss=args.accept_message_loss,
    )
    if args.json:
        print(json.dumps([r.to_json() for r in restored], indent=2))
    else:
        for r in restored:
            reads = "".join(f", source {s} reads {p}" for s, p in sorted(r.reads.items()))
            when = (
                "restored by an earlier run: not changed now"
                if r.earlier
                else "stateful: a new query that recomputes its state from its sources"
                if r.fresh
                else f"next batch {r.batch_id + 1}"
            )
            print(f"{r.original}: checkpoint {r.checkpoint}, path {r.path} ({when}){reads}")
    return 0
