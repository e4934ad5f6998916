"""The record table's steady state written and read by this package, not by delta-rs.

A one-event append through ``write_deltalake`` cost 5.5 ms on local disk where the
commit itself is 1.9 ms, and a catch-up through ``update_incremental`` 3.1 ms where
reading the one new commit file is 0.15 ms; on S3 delta-rs LISTs and re-reads the
log around every commit (docs/protocol.md, "Record-table appends and catch-up").
The record table is written only by this package, so its appends and catch-up are
done here, on the log this process already holds:

- **Append**: the event's parquet file, then commit ``v + 1`` written
  *put-if-absent* (:func:`pyspark_txn.storage.fs.write_new`: a hard link on local
  disk, a conditional PUT on S3, Azure and GCS), where ``v`` is the version this
  process has just checked. Any commit after ``v`` makes it fail: stricter than
  delta-rs's check, which lets appends of other streams through.
- **Catch-up**: the commit files after ``v`` (one LIST on S3 and GCS, a ``stat`` each
  on local disk, a HEAD each elsewhere), each read once, their ``add`` and ``remove``
  applied to the live file set held here. The commit file at ``v`` must still be the
  one seen (size and mtime or ETag): a table deleted and created again is opened
  afresh, never mixed with the old one.
- **Still delta-rs**: creating the table, compaction, checkpoints, log clean-up,
  vacuum, deleting summarized events, and any open from scratch (a gap in the log,
  a protocol it cannot hold). The table stays a plain Delta table (reader 1,
  writer 2, no partitions) that delta-rs and Spark read as before; a table with
  anything else is appended to through delta-rs.

The pure part (the view, applying actions, the commit's lines) has no IO.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from ..events import Event

#: Action kinds a catch-up applies; any other (``protocol``, ``cdc``,
#: ``domainMetadata``, ...) makes it open the table afresh through delta-rs.
_FOLLOWED = frozenset({"add", "remove", "commitInfo", "txn", "metaData"})

#: The highest protocol this module writes commits for: the record table as created.
MAX_READER, MAX_WRITER = 1, 2


@dataclass(frozen=True)
class LogView:
    """The record table as this process last checked it: a version, the commit file
    that made it (its marker), and the data files live at it (paths as delta-rs
    lists them: relative, decoded). ``writable``: its protocol is one this module
    writes commits for."""

    version: int
    marker: Any
    files: tuple[str, ...]
    writable: bool


def apply_actions(files: dict[str, None], actions: Iterable[Mapping[str, Any]]) -> bool:
    """Apply one commit's ``add`` and ``remove`` actions to ``files`` (in place).
    False where the commit holds anything this view cannot follow: the caller then
    opens the table afresh."""
    for action in actions:
        for kind, body in action.items():
            if kind not in _FOLLOWED:
                return False
            if kind == "add":
                if body.get("deletionVector") or body.get("partitionValues"):
                    return False
                files[unquote(body["path"])] = None
            elif kind == "remove":
                files.pop(unquote(body["path"]), None)
            elif kind == "metaData" and not metadata_writable(
                body.get("partitionColumns") or (), body.get("configuration") or {}
            ):
                return False
    return True


def data_file_name() -> str:
    """A new data file's name, unique like delta-rs's (``part-...-<uuid>-c000``)."""
    return f"part-00000-{uuid.uuid4()}-c000.snappy.parquet"


def commit_bytes(events: Sequence[Event], path: str, size: int, *, now_ms: int) -> bytes:
    """The commit of one append: ``commitInfo``, the app transaction ``txn(stream,
    seq)`` of the (one) stream's last event, and the data file's ``add`` with its
    row count and the bounds of ``stream`` and ``seq`` (file skipping for readers
    that filter on them)."""
    last = events[-1]
    return _lines(
        [
            {
                "commitInfo": {
                    "timestamp": now_ms,
                    "operation": "WRITE",
                    "operationParameters": {"mode": "Append"},
                    "clientVersion": "pyspark-txn",
                    "isBlindAppend": True,
                    "pyspark_txn.event": last.kind.value,
                }
            },
            {"txn": {"appId": last.stream, "version": last.seq, "lastUpdated": now_ms}},
            {"add": _add(path, size, events, now_ms, True)},
        ]
    )


def rewrite_bytes(
    operation: str,
    removed: Sequence[str],
    added: tuple[str, int, Sequence[Event]] | None,
    *,
    now_ms: int,
    data_change: bool,
) -> bytes:
    """The commit of a rewrite: the files ``removed``, and the one file ``added`` (path,
    size, its events) that holds what of them is kept. ``OPTIMIZE`` (compaction:
    ``data_change`` False, the same events) or ``DELETE`` (summarized events gone).
    Written put-if-absent on the version after the one read, so any commit in between
    makes it fail: two compactions can never both remove one file (delta-rs 1.6.6's
    ``optimize`` let that through, and both new files held its events)."""
    actions: list[dict[str, Any]] = [
        {
            "commitInfo": {
                "timestamp": now_ms,
                "operation": operation,
                "operationParameters": {},
                "clientVersion": "pyspark-txn",
                "isBlindAppend": False,
            }
        }
    ]
    actions += [
        {
            "remove": {
                "path": path,
                "deletionTimestamp": now_ms,
                "dataChange": data_change,
                "extendedFileMetadata": False,
                "partitionValues": {},
            }
        }
        for path in removed
    ]
    if added is not None:
        path, size, events = added
        actions.append({"add": _add(path, size, events, now_ms, data_change)})
    return _lines(actions)


def _add(path: str, size: int, events: Sequence[Event], now_ms: int, data_change: bool) -> dict:
    streams = sorted(e.stream for e in events)
    seqs = sorted(e.seq for e in events)
    stats = {
        "numRecords": len(events),
        "minValues": {"stream": streams[0], "seq": seqs[0]},
        "maxValues": {"stream": streams[-1], "seq": seqs[-1]},
        "nullCount": {"stream": 0, "seq": 0},
    }
    return {
        "path": path,
        "partitionValues": {},
        "size": size,
        "modificationTime": now_ms,
        "dataChange": data_change,
        "stats": json.dumps(stats, separators=(",", ":")),
    }


def _lines(actions: Sequence[Mapping[str, Any]]) -> bytes:
    return "".join(json.dumps(a, separators=(",", ":")) + "\n" for a in actions).encode()


def now_ms() -> int:
    return int(time.time() * 1000)


def protocol_writable(reader: int, writer: int, features: Sequence[str]) -> bool:
    """Whether commits written here are valid for a table of this protocol (features:
    its reader and writer table features)."""
    return reader <= MAX_READER and writer <= MAX_WRITER and not features


def metadata_writable(partitions: Sequence[str], configuration: Mapping[str, Any]) -> bool:
    """Whether commits written here are valid for a table of this partitioning and
    configuration: none, and not ``delta.appendOnly`` (our rewrites remove files with
    ``dataChange``; delta-rs refuses those there)."""
    append_only = str(configuration.get("delta.appendOnly") or "").strip().lower()
    return not partitions and append_only != "true"
