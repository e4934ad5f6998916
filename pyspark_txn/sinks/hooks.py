"""What a sink asks of the code that operates it, without importing that code.

Exports requested "at the next commit" (named snapshots) are served by the sink right
after a batch's phase 2, but exporting is an operation (:mod:`pyspark_txn.operations`),
and sinks never import the operations. So the sink owns this small interface: it
describes where it writes (:class:`ExportSite`) and calls :func:`serve_exports`; the
package's ``__init__`` registers the server that :mod:`pyspark_txn.operations.snapshots`
implements, before any sink can run (every import of a sink module runs it first)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import TxnError

if TYPE_CHECKING:  # types only: importing this module stays cheap (pyspark_txn imports it)
    from ..state import SinkState, SnapshotRecord


@dataclass(frozen=True)
class ExportSite:
    """Where a ``txn-delta`` sink writes: enough to open it from outside Spark."""

    record_table: str
    sink_id: str
    target_uri: str
    storage_options: Mapping[str, str]
    fs_overrides: tuple = ()
    partition_by: tuple[str, ...] = ()
    checkpoint: str | None = None


#: ``(site, state, record, version)``: export ``record`` (Delta ``version`` of the
#: target, None when the batch made no commit) for every request pending in ``state``.
ExportServer = Callable[[ExportSite, Any, Any, Any], None]

_export_server: ExportServer | None = None


def set_export_server(server: ExportServer) -> None:
    """Install the function that serves export requests (done by ``pyspark_txn``)."""
    global _export_server
    _export_server = server


def serve_exports(
    site: ExportSite, state: SinkState, record: SnapshotRecord, version: int | None
) -> None:
    """Serve the export requests pending in ``state`` with the installed server."""
    if _export_server is None:  # pyspark_txn/__init__.py installs it: a broken install
        raise TxnError(
            f"sink {site.sink_id}: export requests are pending but no export server is "
            "installed (import pyspark_txn, which installs pyspark_txn.operations.snapshots)"
        )
    _export_server(site, state, record, version)
