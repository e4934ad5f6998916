"""pyspark-txn: run the demo, and watch, repair and verify txn-delta and txn-postgres
sinks (and snapshot txn-delta ones) from a shell, without Spark."""

# (this docstring is the command's --help description.) Layout: ``args`` parses the
# arguments the commands share, ``render`` prints, one module per command group adds its
# parsers (``add_parsers``) and runs its commands; here: main, run and the exit codes
# (0 OK, 1 needs attention or declined, 2 error, 130 interrupted).

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import NoReturn

from .. import storage
from ..errors import TxnError
from . import backups, demo, repair, snapshots, status
from .args import Parser, read_storage_options

#: the command groups, in the order ``--help`` lists them
GROUPS = (demo, status, snapshots, backups, repair)


def main(argv: list[str] | None = None) -> int:
    Parser.json_errors = "--json" in (sys.argv[1:] if argv is None else [str(a) for a in argv])
    parser = Parser(prog="pyspark-txn", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log protocol steps")
    sub = parser.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.add_parsers(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    _quiet_store_clients(args.verbose)
    real = sys.stdout
    sys.stdout = _Output(real)
    try:
        code = _dispatch(args)
        sys.stdout.flush()  # a small output is only written here
        return code
    except _OutputError as e:  # stdout is full or gone: say so where it can be read
        cause = e.__cause__
        print(f"pyspark-txn: error: cannot write output ({cause!r})", file=sys.stderr)
        return 2
    finally:
        sys.stdout = real


class _OutputError(Exception):
    """stdout cannot be written (a full disk, ``> /dev/full``): not the store's failure."""


class _Output:
    """stdout, whose write errors (other than a closed pipe) raise :class:`_OutputError`,
    so they are never taken for a store's error nor answered by more output."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise _OutputError() from e

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as e:
            raise _OutputError() from e

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _dispatch(args: argparse.Namespace) -> int:
    """Run the command; errors become one line on stderr (and JSON under --json), exit 2."""
    try:
        with storage.using(read_storage_options(getattr(args, "storage_options", None))):
            return args.func(args)
    except _OutputError:
        raise
    except TxnError as e:
        print(f"pyspark-txn: error: {e}", file=sys.stderr)
        if getattr(args, "json", False):  # scripts still get a document to parse
            print(json.dumps({"error": str(e), "type": type(e).__name__}))
        return 2
    except BrokenPipeError:  # `pyspark-txn records ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:  # a store or a location that cannot be read or written: one line
        problem = storage.describe_store_error(e)
        kind = "StorageError"
        if problem is None and isinstance(e, OSError):
            problem, kind = f"{type(e).__name__}: {e}", type(e).__name__
        if problem is None:
            raise
        print(f"pyspark-txn: error: {problem}", file=sys.stderr)
        if getattr(args, "json", False):
            print(json.dumps({"error": problem, "type": kind}))
        return 2


def run() -> NoReturn:
    """The ``pyspark-txn`` command: :func:`main`, then exit with its status at once.

    An exit code is the command's contract, but a normal interpreter exit runs the
    native libraries' teardown (delta-rs' runtime threads, pyarrow's pools), which
    aborted in about 1 run of 6 (``terminate called without an active exception``,
    status 134) after the command had printed its result. So: flush what was
    written, then ``os._exit`` with the status, skipping that teardown.
    """
    try:
        code = main()
    except SystemExit as e:  # argparse's usage errors and --help
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        print("pyspark-txn: interrupted", file=sys.stderr)
        code = 130
    except BaseException:  # a bug: the traceback, as an uncaught error would print it
        import traceback

        traceback.print_exc()
        code = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be written
            pass
    os._exit(code)


def _quiet_store_clients(verbose: bool) -> None:
    """No warning floods from the object-store clients (instance-metadata retries when
    credentials are missing): their failure comes back as one error line instead."""
    if verbose:
        return
    for name in ("botocore", "aiobotocore", "s3fs", "adlfs", "gcsfs", "urllib3", "azure"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("RUST_LOG", "error")


if __name__ == "__main__":
    run()
