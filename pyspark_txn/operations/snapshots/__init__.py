"""Named snapshots: a sink's committed state exported as standalone Delta tables.

An export pins one committed snapshot of a ``txn-delta`` sink (by default
the latest), copies the target table *as of the Delta version that commit
made* into ``<to>/data`` (a Delta table of its own: it stays readable after
the source table is vacuumed or dropped), writes ``<to>/manifest`` (one row
per source: Spark's offsets of that batch, ids, counts, checksum), and only
then registers the name in the sink's record table. A crash before the
registration leaves no registry entry, but what it wrote stays under ``<to>``
(loose files, or committed ``data``/``manifest`` tables if it died after
committing them) with the export marker: only the registry says which exports
exist. The next export to the same place removes that copy first, when the
marker's writer is provably dead (same host, its pid gone) or with
``replace_unfinished=True``; it never removes what a live export may own.

Export-only: nothing of the running query is committed or rolled back; the
export takes its own snapshot id (never reused) from the sink's stream, so a
running query only sees one more event in its record table.

Three cuts (docs/snapshots.md): :func:`export` (the latest committed batch,
now), :func:`request_export` (the batch the sink commits next, exported
inside that commit) and :func:`stop_and_export` (a terminal snapshot: the
query is stopped and its sink settled first). :func:`prepare_query` makes a
new query start exactly at a snapshot.

One module per question: ``registry`` (list, show), ``location`` (where an export goes),
``copy`` (pin and copy a committed snapshot), ``exports``, ``requests`` (exports cut at a
commit, terminal exports), ``verification`` (verify, delete), ``prepare`` (a new query from a
snapshot)."""

from .copy import TableCopy, check_export, copy_table
from .exports import export
from .location import STATE_CHOICES
from .prepare import PreparedQuery, kafka_starting_offsets, prepare_query, source_offsets
from .registry import (
    CHUNK_BYTES,
    EXPORT_MARKER,
    Progress,
    backup_of_part,
    backup_part_name,
    list_requests,
    list_snapshots,
    show,
)
from .requests import (
    ExportCancelled,
    cancel_request,
    query_checkpoint,
    request_export,
    serve_export_requests,
    stop_and_export,
    wait_for_export,
)
from .verification import ExportCheck, delete, verify, verify_entry

__all__ = [
    "CHUNK_BYTES",
    "EXPORT_MARKER",
    "ExportCancelled",
    "ExportCheck",
    "backup_of_part",
    "backup_part_name",
    "PreparedQuery",
    "Progress",
    "STATE_CHOICES",
    "TableCopy",
    "cancel_request",
    "check_export",
    "copy_table",
    "delete",
    "export",
    "kafka_starting_offsets",
    "list_requests",
    "list_snapshots",
    "prepare_query",
    "query_checkpoint",
    "request_export",
    "serve_export_requests",
    "show",
    "source_offsets",
    "stop_and_export",
    "verify",
    "verify_entry",
    "wait_for_export",
]
