"""Argument parsing shared by the commands: where a sink is (location, --sink),
--storage-options, how to reach a txn-postgres database, --json usage errors."""

from __future__ import annotations

import argparse
import json
import sys

from .. import storage
from ..errors import ConfigError
from ..operations.handle import SinkHandle, open_sink

LOCATION_HELP = "checkpoint location, or record table URI"


def storage_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--storage-options",
        metavar="JSON|@FILE",
        help="object-store options for every store the command reads or writes, as the "
        'sink\'s storageOptions: a JSON object (e.g. \'{"AWS_REGION": "eu-west-1"}\') or '
        "@file holding one (default: credentials from the environment); "
        "see docs/object-stores.md",
    )


def read_storage_options(raw: str | None) -> storage.StorageOptions:
    """--storage-options, parsed before anything is touched (@file: the file's text)."""
    if raw is None:
        return storage.StorageOptions()
    if raw.startswith("@"):
        try:
            with open(raw[1:], encoding="utf-8") as f:
                raw = f.read()
        except OSError as e:
            raise ConfigError(f"--storage-options {raw}: cannot read the file: {e}") from None
    return storage.StorageOptions.parse(raw, "command line", "--storage-options")


def sink_arguments(p: argparse.ArgumentParser, *, name: bool = False, as_json: bool = True):
    """The arguments every sink command takes: where, which sink (and name), --json,
    --storage-options."""
    storage_argument(p)
    p.add_argument("location", help=LOCATION_HELP)
    if name:
        p.add_argument("name")
    p.add_argument("--sink", help=SINK_HELP)
    if as_json:
        p.add_argument("--json", action="store_true", help="print JSON")


SINK_HELP = "sink id (default: the checkpoint's kept sink id, or the record table's only sink)"


def target_arguments(p: argparse.ArgumentParser) -> None:
    """How a command reaches a txn-postgres sink's database (docs/postgres.md)."""
    p.add_argument(
        "--url",
        help="txn-postgres: the database, as a libpq URI or key=value string (default: the "
        "one the sink's records keep, without its password). The password comes from "
        "--password-file, else libpq: PGPASSWORD or ~/.pgpass (PGPASSFILE); it is never "
        "printed",
    )
    p.add_argument("--password-file", help="txn-postgres: a file holding the password")


class Parser(argparse.ArgumentParser):
    """argparse, whose usage errors come out as JSON when the command line has --json."""

    json_errors = False

    def error(self, message: str):
        if Parser.json_errors:
            self.print_usage(sys.stderr)
            print(
                json.dumps({"error": message, "type": "UsageError", "usage": self.format_usage()})
            )
            sys.exit(2)
        super().error(message)


def open_handle(args: argparse.Namespace) -> SinkHandle:
    """The sink of a command that reads its target (``--url``, ``--password-file``)."""
    return open_sink(args.location, args.sink, url=args.url, password_file=args.password_file)
