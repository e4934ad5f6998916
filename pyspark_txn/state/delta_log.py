"""The record table as a Delta table, written and read with delta-rs.

Conditional append: each event is one Delta commit carrying the app
transaction ``txn(appId=stream, version=seq)``. The check ``txn version >= seq``
is made on the same ``DeltaTable`` snapshot the commit is built on, so a racing
writer with the same stream loses with ``CommitFailedError`` (measured on
deltalake 1.6.6; a path string instead of the object would reload and lose the
check). Small appends are compacted and checkpointed every ``compact_every``
versions so reads and commits stay flat over thousands of batches.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from .events import Event, arrow_schema, events_to_arrow
from .store import AppendRejected, EventLog

log = logging.getLogger(__name__)


class DeltaEventLog(EventLog):
    def __init__(
        self,
        uri: str,
        storage_options: Mapping[str, str] | None = None,
        *,
        compact_every: int = 64,
    ) -> None:
        self.uri = uri
        self.storage_options = dict(storage_options or {}) or None
        self.compact_every = compact_every

    def __repr__(self) -> str:
        return f"DeltaEventLog({self.uri!r})"

    def _open(self):
        from deltalake import DeltaTable

        if not DeltaTable.is_deltatable(self.uri, storage_options=self.storage_options):
            return None
        return DeltaTable(self.uri, storage_options=self.storage_options)

    def create_if_missing(self) -> None:
        """Create the table. Call from one process: concurrent creation is unsafe in delta-rs."""
        from deltalake import DeltaTable

        if self._open() is None:
            DeltaTable.create(
                self.uri,
                arrow_schema(),
                mode="ignore",
                name="pyspark_txn_records",
                description="pyspark-txn record table (append-only event log)",
                storage_options=self.storage_options,
            )

    def append(self, event: Event) -> None:
        from deltalake import write_deltalake
        from deltalake.exceptions import CommitFailedError
        from deltalake.transaction import CommitProperties, Transaction

        dt = self._open()
        if dt is None:
            self.create_if_missing()
            dt = self._open()
        current = dt.transaction_version(event.stream)
        expected = 0 if current is None else current + 1
        if event.seq != expected:
            raise AppendRejected(
                f"{event.stream}#{event.seq} cannot land: the next free seq is {expected}"
            )
        try:
            write_deltalake(
                dt,
                events_to_arrow([event]),
                mode="append",
                commit_properties=CommitProperties(
                    app_transactions=[Transaction(app_id=event.stream, version=event.seq)],
                    custom_metadata={"pyspark_txn.event": event.kind.value},
                ),
            )
        except CommitFailedError as e:
            raise AppendRejected(str(e)) from e
        self._maintain(dt)

    def _maintain(self, dt) -> None:
        version = dt.version()
        if self.compact_every <= 0 or version % self.compact_every:
            return
        try:
            dt.optimize.compact()
            dt.create_checkpoint()
        except Exception as e:  # an optimisation only: the events are already safe
            log.warning(
                "record table %s: compaction at version %d failed: %r", self.uri, version, e
            )

    def read(self, stream: str) -> list[Event]:
        dt = self._open()
        if dt is None:
            return []
        rows = dt.to_pyarrow_table(filters=[("stream", "=", stream)]).to_pylist()
        rows.sort(key=lambda r: r["seq"])
        return [Event.from_row(r) for r in rows]

    def streams(self) -> list[str]:
        dt = self._open()
        if dt is None:
            return []
        import pyarrow.compute as pc

        col = dt.to_pyarrow_table(columns=["stream"]).column("stream")
        return sorted(pc.unique(col).to_pylist())
