"""A Delta target whose phase 2 merges each batch by key (upserts, CDC, SCD type 2):
the same two-phase protocol as appends (the record is safe before anything becomes
visible; a replay is a no-op), one MERGE commit per batch carrying the sink's app
transaction.

Phase 1 stages the batch's change records as for an append. Phase 2 reads them back,
applies the rules of :mod:`.upsert` (the latest change per key, deletes, tombstones,
SCD type 2 histories) and asks delta-rs for one ``MERGE`` with the app transaction
``(sink id, batch id)`` and the record's stamps. Staged files are inputs here, not
table files: once the MERGE has landed they are removed. Where the table has
``delta.enableChangeDataFeed=true`` delta-rs writes the change data of the MERGE.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..faults import NO_FAULTS, FaultPlan
from ..state import SnapshotRecord, TxnHandle
from .delta_commit import _NO_HOOKS
from .delta_keys import rows_of_keys
from .delta_target import DeltaTarget, schema_from_b64, table_arrow_schema
from .merge_pruning import pruning_predicate
from .tombstones import Tombstones
from .upsert import (
    DELETE_FLAG,
    START_AT,
    UpsertSpec,
    check_batch,
    latest_per_key,
    newer_sql,
    quote,
    scd2_versions,
    with_delete_flag,
    without_tombstoned,
)

log = logging.getLogger(__name__)


class DeltaMergeTarget(DeltaTarget):
    """:class:`DeltaTarget` whose batches are merged by ``spec.keys`` (module doc)."""

    def __init__(
        self,
        uri: str,
        sink_id: str,
        *,
        spec: UpsertSpec,
        faults: FaultPlan = NO_FAULTS,
        **options: Any,
    ) -> None:
        super().__init__(uri, sink_id, **options)
        self.spec = spec
        self.faults = faults  # mid_phase2: tombstones written, the MERGE not yet

    # --- before the record --------------------------------------------------------------

    def preflight(self, record: SnapshotRecord) -> None:
        """Besides the append checks: the batch's change records can be merged as the
        rules say (no null key, no two changes of one key that nothing orders). Read
        here, before the record, from the staged files' key and sequence columns."""
        super().preflight(record)
        rows = self._batch_rows(
            record.txns,
            schema_from_b64(record.target["arrow_schema"]),
            [*self.spec.keys, *self.spec.sequence_by],
        )
        if rows is not None:
            check_batch(rows, self.spec)

    # --- phase 2 ------------------------------------------------------------------------

    def commit(self, record: SnapshotRecord) -> int | None:
        version = super().commit(record)
        if record.txns:  # the staged change records were the MERGE's input: spent now
            self._remove_staged(record.snapshot_id, record.token, (), "merged (spent)")
        return version

    def _write_commit(
        self,
        dt,
        batch_id: int,
        txns: Sequence[TxnHandle],
        target_meta: Mapping[str, Any],
        stamps: Mapping[str, Any],
        recheck: Callable[[Any], None] | None = None,
    ):
        props = self._commit_properties(batch_id, stamps)
        dt = self._table_for_commit(dt, target_meta, recheck, None)
        before = dt.version()
        rows = self._batch_rows(txns, schema_from_b64(target_meta["arrow_schema"]))
        if rows is not None:
            source, on = self._source(dt, rows, batch_id)
            if source.num_rows:
                self._merge(dt, source, on, props)
                dt.update_incremental()
        done = dt.transaction_version(self.sink_id)
        if done is None or done < batch_id:  # (batch 0 is done at version 0: not falsy)
            # nothing changed (every change stale, or none matched): delta-rs makes no
            # commit for such a MERGE. The batch is done all the same, in a commit of its
            # own that carries the app transaction and the record's stamps
            dt.create_write_transaction(
                [],
                mode="append",
                schema=dt.schema(),
                partition_by=self.partition_by or None,
                commit_properties=props,
                post_commithook_properties=_NO_HOOKS(),
            )
        return self._after_commit(dt, before, batch_id)

    def _source(self, dt, rows: Any, batch_id: int) -> tuple[Any, list[str]]:
        """What to merge (and on which columns): the latest change per key, less changes a
        remembered delete makes stale (SCD 1), or the versions to write (SCD 2). The
        batch's deletes are remembered first, where the spec keeps tombstones: a table
        that holds the batch has its tombstones."""
        flagged = with_delete_flag(rows, self.spec)
        tombstones = (
            Tombstones(self.uri, self.sink_id, self.spec, self.storage_options)
            if self.spec.keeps_tombstones
            else None
        )
        if self.spec.scd_type == 2:
            source = self._scd2_source(dt, flagged, tombstones, batch_id)
            on = [*self.spec.keys, START_AT]
            deletes = flagged.filter(flagged.column(DELETE_FLAG))
        else:
            source, on = latest_per_key(flagged, self.spec), list(self.spec.keys)
            if tombstones is not None:
                source = without_tombstoned(source, tombstones.of(source, batch_id), self.spec)
            deletes = source.filter(source.column(DELETE_FLAG))
        if tombstones is not None and deletes.num_rows:
            tombstones.record(deletes, batch_id, rows.schema)
            self.faults.hit("mid_phase2", batch_id)
        return source, on

    def _merge(self, dt, source: Any, on: Sequence[str], props: Any) -> None:
        import pyarrow as pa

        columns = [c for c in table_arrow_schema(dt).names if c in source.schema.names]
        values = {c: f"s.{quote(c)}" for c in columns}
        predicate = " AND ".join(f"t.{quote(k)} = s.{quote(k)}" for k in on)
        # the keys' bounds as literals: delta-rs prunes files by them (merge_pruning)
        pruning = pruning_predicate(
            source,
            self.spec.keys,
            dt.metadata().partition_columns,
            pa.table(dt.get_add_actions(flatten=True)),
        )
        if pruning is not None:
            predicate = f"{predicate} AND {pruning}"
        merger = dt.merge(
            source,
            predicate=predicate,
            source_alias="s",
            target_alias="t",
            commit_properties=props,
            post_commithook_properties=_NO_HOOKS(),
        )
        if self.spec.scd_type == 2:
            merger = merger.when_matched_update(updates=values).when_not_matched_insert(
                updates=values
            )
        else:
            newer = newer_sql(self.spec)
            flag = f"s.{quote(DELETE_FLAG)}"
            merger = (
                merger.when_matched_delete(predicate=f"{flag} AND ({newer})")
                .when_matched_update(updates=values, predicate=f"NOT {flag} AND ({newer})")
                .when_not_matched_insert(updates=values, predicate=f"NOT {flag}")
            )
        metrics = merger.execute()
        log.debug("sink %s: merge %s", self.sink_id, metrics)

    def _scd2_source(self, dt, flagged: Any, tombstones: Tombstones | None, batch_id: int) -> Any:
        """The versions of the keys the batch touches that are new or end elsewhere now."""
        schema = table_arrow_schema(dt)
        columns = schema.names
        existing = rows_of_keys(dt, flagged, self.spec.keys, schema)
        remembered = tombstones.of(flagged, batch_id) if tombstones is not None else None
        return scd2_versions(existing, flagged, self.spec, columns, remembered)

    def _batch_rows(
        self, txns: Sequence[TxnHandle], schema: Any, columns: Sequence[str] | None = None
    ) -> Any:
        """The batch's staged change records, in the order they were staged (files by
        task, rows as written): one table; None for a batch without rows. A staged file
        of a partitioned table holds no partition column (its folder's name does, as
        Delta's files): the values come from its handle, typed as ``schema`` (the
        table's) says."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        wanted = list(columns) if columns is not None else None
        in_files = None if wanted is None else [c for c in wanted if c not in self.partition_by]
        parts = []
        for t in txns:
            with self.fs.open(self._abs(t.handle), "rb") as f:
                rows = pq.ParquetFile(f).read(columns=in_files)  # not read_table: see read_rows
            values = t.meta.get("partition_values") or {}
            for c in self.partition_by:
                if wanted is None or c in wanted:
                    field = schema.field(c).with_nullable(True)
                    value = pa.array([values.get(c)] * rows.num_rows, pa.string())
                    rows = rows.append_column(field, value.cast(field.type))
            parts.append(rows)
        if not parts:
            return None
        return pa.concat_tables(parts, promote_options="permissive")
