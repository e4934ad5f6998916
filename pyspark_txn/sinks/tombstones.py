"""Deletes remembered by an upserting sink (``sequenceBy`` with ``deleteWhen``), so a
change older than a delete that arrives after it cannot bring the row back.

A small Delta table per sink inside the target's folder, at
``<table>/_pyspark_txn/tombstones/<sink id>`` (a folder Delta readers and VACUUM leave
alone): one row per deleted key (SCD type 2: per delete, since a history needs every one),
its sequence and when the delete was seen. Phase 2
writes a batch's tombstones *before* it merges the batch into the table, with the
sink's app transaction for that batch, so a phase 2 redone after a crash skips what
landed, and a table that holds the batch always has its tombstones. Rows older than
``tombstoneRetention`` are dropped in the same commit: after that, an older change that
arrives late is applied (docs/upserts.md)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from ..storage import fs as _fs
from .upsert import UpsertSpec, latest_per_key, newer_sql, quote

log = logging.getLogger(__name__)

DELETED_AT = "__deleted_at_ms"  # when phase 2 saw the delete (ms since the epoch)


def tombstones_uri(table_uri: str, sink_id: str) -> str:
    return _fs.join(table_uri, "_pyspark_txn", "tombstones", sink_id)


class Tombstones:
    def __init__(
        self,
        table_uri: str,
        sink_id: str,
        spec: UpsertSpec,
        storage_options: Mapping[str, str] | None,
    ) -> None:
        self.uri = tombstones_uri(table_uri, sink_id)
        self.sink_id = sink_id
        self.spec = spec
        self.storage_options = dict(storage_options) if storage_options else None

    def _open(self):
        from deltalake import DeltaTable
        from deltalake.exceptions import TableNotFoundError

        try:
            return DeltaTable(self.uri, storage_options=self.storage_options)
        except TableNotFoundError:
            return None

    def _columns(self) -> list[str]:
        return [*self.spec.keys, *self.spec.sequence_by]

    def of(self, rows: Any, batch_id: int) -> Any:
        """The tombstones of the keys in ``rows`` as batch ``batch_id`` found them (None:
        none kept yet). A phase 2 redone after its tombstones landed reads the table as
        it was before them, or the batch's own deletes would make it stale."""
        import pyarrow.compute as pc
        from deltalake import DeltaTable

        dt = self._open()
        if dt is None or rows.num_rows == 0:
            return None
        while (dt.transaction_version(self.sink_id) or -1) >= batch_id:
            if dt.version() == 0:
                return None
            dt = DeltaTable(
                self.uri, version=dt.version() - 1, storage_options=self.storage_options
            )
        first = self.spec.keys[0]
        wanted = pc.unique(rows.column(first))
        kept = dt.to_pyarrow_dataset().to_table(
            columns=self._columns(), filter=pc.field(first).isin(wanted)
        )
        if len(self.spec.keys) > 1 and kept.num_rows:
            keys = rows.select(list(self.spec.keys)).group_by(list(self.spec.keys)).aggregate([])
            kept = kept.join(keys, keys=list(self.spec.keys), join_type="left semi")
        return kept

    def record(self, deletes: Any, batch_id: int, schema: Any) -> None:
        """Remember ``deletes`` (keys and sequences; with SCD type 1 the greatest per key
        stays) as of ``batch_id``; once per batch (the sink's app transaction).
        ``schema``: the stream's, for the key and sequence types."""
        import pyarrow as pa
        from deltalake import DeltaTable
        from deltalake.transaction import CommitProperties, Transaction

        dt = self._open()
        if dt is not None and (dt.transaction_version(self.sink_id) or -1) >= batch_id:
            return  # this batch's tombstones landed before a crash
        now = int(time.time() * 1000)
        fields = [schema.field(c) for c in self._columns()]
        table_schema = pa.schema([*fields, pa.field(DELETED_AT, pa.int64())])
        if dt is None:
            DeltaTable.create(
                self.uri,
                table_schema,
                mode="ignore",
                name=f"pyspark_txn_tombstones_{self.sink_id}",
                description="pyspark-txn: deletes remembered for sequenceBy (docs/upserts.md)",
                storage_options=self.storage_options,
            )
            dt = DeltaTable(self.uri, storage_options=self.storage_options)
        if self.spec.scd_type == 1:
            deletes = latest_per_key(deletes, self.spec)
        source = deletes.select(self._columns()).append_column(
            DELETED_AT, pa.array([now] * deletes.num_rows, pa.int64())
        )
        cutoff = now - self.spec.tombstone_retention_s * 1000
        by = [*self.spec.keys, *(self.spec.sequence_by if self.spec.scd_type == 2 else ())]
        on = " AND ".join(f"t.{quote(k)} = s.{quote(k)}" for k in by)
        everything = {c: f"s.{quote(c)}" for c in source.schema.names}
        (
            dt.merge(
                source,
                predicate=on,
                source_alias="s",
                target_alias="t",
                commit_properties=CommitProperties(
                    app_transactions=[Transaction(app_id=self.sink_id, version=batch_id)]
                ),
            )
            .when_matched_update(updates=everything, predicate=newer_sql(self.spec))
            .when_not_matched_insert(updates=everything)
            .when_not_matched_by_source_delete(predicate=f"t.{quote(DELETED_AT)} < {cutoff}")
            .execute()
        )
        log.debug("sink %s: %d tombstones of batch %d", self.sink_id, deletes.num_rows, batch_id)
