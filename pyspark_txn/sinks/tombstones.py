"""Deletes remembered by an upserting sink (``sequenceBy`` with ``deleteWhen``), so a
change older than a delete that arrives after it cannot bring the row back.

A small Delta table per sink inside the target's folder, at
``<table>/_pyspark_txn/tombstones/<sink id>`` (a folder Delta readers and VACUUM leave
alone): one row per deleted key (SCD type 2: per delete, since a history needs every one),
its sequence and when the delete was seen. Phase 2 writes a batch's tombstones *before*
it merges the batch into the table, with the sink's app transaction for that batch, so a
phase 2 redone after a crash skips what landed, and a table that holds the batch always
has its tombstones. Rows older than ``tombstoneRetention`` are dropped in the same
commit: after that, an older change that arrives late is applied (docs/upserts.md).

A named snapshot (and so a backup's part) carries the tombstones as of its batch
(:func:`tombstones_as_of`); a query started from it finds them at
``<table>/_pyspark_txn/tombstones/_inherited`` and reads them with its own."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from ..storage import fs as _fs
from .delta_keys import rows_of_keys
from .upsert import UpsertSpec, latest_per_key, newer_sql, quote

log = logging.getLogger(__name__)

DELETED_AT = "__deleted_at_ms"  # when phase 2 saw the delete (ms since the epoch)
#: The tombstones a table started from a snapshot inherited (written once, never again).
INHERITED = "_inherited"


def tombstones_uri(table_uri: str, sink_id: str) -> str:
    return _fs.join(table_uri, "_pyspark_txn", "tombstones", sink_id)


def _open(uri: str, storage_options: Mapping[str, str] | None, version: int | None = None):
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    try:
        return DeltaTable(
            uri, version=version, storage_options=dict(storage_options) if storage_options else None
        )
    except TableNotFoundError:
        return None


def _done(dt, sink_id: str) -> int:
    """The sink's last batch in the tombstone table, -1 for none (batch 0 is a batch)."""
    done = dt.transaction_version(sink_id)
    return -1 if done is None else int(done)


def tombstones_as_of(
    table_uri: str, sink_id: str, batch_id: int, storage_options: Mapping[str, str] | None
) -> tuple[str, int] | None:
    """(location, version) of the sink's tombstones as they were when batch ``batch_id``
    was committed (its own included), None where there were none yet."""
    uri = tombstones_uri(table_uri, sink_id)
    dt = _open(uri, dict(storage_options) if storage_options else None)
    if dt is None:
        return None
    while _done(dt, sink_id) > batch_id:
        if dt.version() == 0:
            return None
        dt.load_as_version(dt.version() - 1)
    return uri, dt.version()


class Tombstones:
    def __init__(
        self,
        table_uri: str,
        sink_id: str,
        spec: UpsertSpec,
        storage_options: Mapping[str, str] | None,
    ) -> None:
        self.uri = tombstones_uri(table_uri, sink_id)
        self.inherited = tombstones_uri(table_uri, INHERITED)
        self.sink_id = sink_id
        self.spec = spec
        self.storage_options = dict(storage_options) if storage_options else None

    def _columns(self) -> list[str]:
        return [*self.spec.keys, *self.spec.sequence_by]

    def of(self, rows: Any, batch_id: int) -> Any:
        """The tombstones of the keys in ``rows`` as batch ``batch_id`` found them (None:
        none kept yet): the sink's own, and those its table inherited. A phase 2 redone
        after its tombstones landed reads them as they were before them, or the batch's
        own deletes would make it stale."""
        import pyarrow as pa
        import pyarrow.compute as pc

        if rows.num_rows == 0:
            return None
        parts = []
        own = _open(self.uri, self.storage_options)
        if own is not None:
            while _done(own, self.sink_id) >= batch_id:
                if own.version() == 0:
                    own = None
                    break
                own.load_as_version(own.version() - 1)
        inherited = _open(self.inherited, self.storage_options)
        cutoff = self._cutoff()
        for dt in (own, inherited):
            if dt is not None:
                kept = self._of_keys(dt, rows)
                # deletes older than the retention are forgotten when read, not only when
                # the next batch with deletes rewrites the table
                kept = kept.filter(pc.greater_equal(kept.column(DELETED_AT), cutoff))
                parts.append(kept.select(self._columns()))
        parts = [p for p in parts if p.num_rows]
        return pa.concat_tables(parts) if parts else None

    def _cutoff(self) -> int:
        return int(time.time() * 1000) - self.spec.tombstone_retention_s * 1000

    def _of_keys(self, dt, rows: Any) -> Any:
        import pyarrow as pa

        fields = [rows.schema.field(c) for c in self._columns()]
        schema = pa.schema([*fields, pa.field(DELETED_AT, pa.int64())])
        return rows_of_keys(dt, rows, self.spec.keys, schema)

    def record(self, deletes: Any, batch_id: int, schema: Any) -> None:
        """Remember ``deletes`` (keys and sequences; with SCD type 1 the greatest per key
        stays) as of ``batch_id``; once per batch (the sink's app transaction).
        ``schema``: the stream's, for the key and sequence types."""
        import pyarrow as pa
        from deltalake import DeltaTable
        from deltalake.transaction import CommitProperties, Transaction

        from .delta_commit import maintain_log

        dt = _open(self.uri, self.storage_options)
        if dt is not None and _done(dt, self.sink_id) >= batch_id:
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
        by = [*self.spec.keys, *(self.spec.sequence_by if self.spec.scd_type == 2 else ())]
        everything = {c: f"s.{quote(c)}" for c in source.schema.names}
        (
            dt.merge(
                source,
                predicate=" AND ".join(f"t.{quote(k)} = s.{quote(k)}" for k in by),
                source_alias="s",
                target_alias="t",
                commit_properties=CommitProperties(
                    app_transactions=[Transaction(app_id=self.sink_id, version=batch_id)]
                ),
            )
            .when_matched_update(updates=everything, predicate=newer_sql(self.spec))
            .when_not_matched_insert(updates=everything)
            .when_not_matched_by_source_delete(
                predicate=f"t.{quote(DELETED_AT)} < {self._cutoff()}"
            )
            .execute()
        )
        dt.update_incremental()
        maintain_log(dt, self.uri, self.storage_options)
        log.debug("sink %s: %d tombstones of batch %d", self.sink_id, deletes.num_rows, batch_id)
