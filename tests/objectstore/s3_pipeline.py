"""txn-sequence -> txn-delta pipelines whose target and record table live on an object
store (moto's S3, Azurite), with Spark's checkpoint on local disk (Spark has no S3A or
ABFS here), and their checks. ``s3``: the store (``uri``, ``options``, ``keys``)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.compute as pc
from deltalake import DeltaTable
from pipeline_checks import StreamPipeline

from pyspark_txn.sinks.staging import MARKER_SUFFIX, STAGING_ROOT
from pyspark_txn.sources.sequence import expected_rows
from pyspark_txn.state import DeltaEventLog, RecordStore, check_invariants


class S3Pipeline(StreamPipeline):
    def __init__(self, spark, base: Path, s3, total: int = 500, per_batch: int = 100):
        super().__init__(spark, base, total, per_batch)
        self.s3 = s3
        self.target = s3.uri("target")
        self.records = s3.uri("records")

    @property
    def storage_options(self) -> dict[str, str]:
        return self.s3.options

    def writer(self, faults: str | None = None, width: int = 0, **options):
        w = self.source(width).writeStream.format("txn-delta").option("path", self.target)
        w = w.option("checkpointLocation", self.checkpoint)
        w = w.option("recordTable", self.records)
        w = w.option("storageOptions", json.dumps(self.storage_options))
        for k, v in self.sink_options(faults, options).items():
            w = w.option(k, v)
        return w

    def record_store(self) -> RecordStore:
        return RecordStore(DeltaEventLog(self.records, self.storage_options))

    def dt(self) -> DeltaTable:
        return DeltaTable(self.target, storage_options=self.storage_options)

    def table(self):
        return self.dt().to_pyarrow_table().sort_by("id")

    def assert_exactly_once(self, total: int | None = None) -> None:
        total = self.total if total is None else total
        got = self.table()
        assert pc.count_distinct(got.column("id")).as_py() == got.num_rows, "duplicate rows"
        assert got.num_rows == total, f"{got.num_rows} rows, expected {total}"
        want = expected_rows(0, total, 0)
        assert got.select(want.column_names).equals(want)

    def assert_no_orphans(self) -> None:
        """Every object under the target is the log's, a live data file or an empty
        attempt's marker (kept until retention forgets the snapshot, as on local disk)."""
        live = {u.split("/target/", 1)[1] for u in self.dt().file_uris()}
        keys = [k.split("target/", 1)[1] for k in self.s3.keys("target/")]
        data = {k for k in keys if not k.startswith(("_delta_log/", STAGING_ROOT + "/"))}
        assert data == live, (
            f"orphan objects: {sorted(data - live)}; missing: {sorted(live - data)}"
        )
        staged = [
            k for k in keys if k.startswith(STAGING_ROOT + "/") and not k.endswith(MARKER_SUFFIX)
        ]
        assert not staged, f"data left in the staging area: {staged}"

    def assert_records_consistent(self) -> None:
        store = self.record_store()
        (sink_id,) = store.log.streams()
        state = check_invariants(sink_id, store.events(sink_id))
        records = sorted(state.records.values(), key=lambda r: r.snapshot_id)
        batches = [r.batch_id for r in records]
        assert batches == sorted(set(batches))
        assert self.dt().transaction_version(state.sink_id) == batches[-1]
