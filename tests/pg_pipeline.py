"""Running txn-sequence -> txn-postgres pipelines and checking every row in PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
from pipeline_checks import run_to_end

from pyspark_txn.sources.sequence import expected_rows
from pyspark_txn.state import DeltaEventLog, RecordStore, check_invariants


class PgPipeline:
    def __init__(self, spark, base: Path, server, schema: str, total=5000, per_batch=1000):
        self.spark = spark
        self.base = base
        self.server = server
        self.schema = schema
        self.table = f"{schema}.target"
        self.checkpoint = str(base / "chk")
        self.total = total
        self.per_batch = per_batch

    def writer(self, faults: str | None = None, width: int = 0, **options):
        df = (
            self.spark.readStream.format("txn-sequence")
            .option("rowsPerBatch", self.per_batch)
            .option("totalRows", self.total)
            .option("width", width)
            .load()
        )
        w = (
            df.writeStream.format("txn-postgres")
            .option("url", self.server.url)
            .option("table", self.table)
            .option("createTable", "true")
            .option("checkpointLocation", self.checkpoint)
        )
        if faults:
            w = w.option("faultInjection", faults)
        for k, v in options.items():
            w = w.option(k, v)
        return w

    def run(self, faults: str | None = None, **options) -> Exception | None:
        try:
            run_to_end(self.writer(faults, **options))
        except Exception as e:
            return e
        return None

    def query(self, sql, params=()):
        with self.server.connect() as conn:
            return conn.execute(sql, params).fetchall()

    def table_rows(self) -> pa.Table:
        with self.server.connect() as conn:
            cur = conn.execute(f"SELECT * FROM {self.table} ORDER BY id")
            names = [d.name for d in cur.description]
            rows = cur.fetchall()
        return pa.table({n: [r[i] for r in rows] for i, n in enumerate(names)})

    def assert_exactly_once(self, total: int | None = None, width: int = 0) -> None:
        total = self.total if total is None else total
        ids = [r[0] for r in self.query(f"SELECT id FROM {self.table} ORDER BY id")]
        assert len(ids) == len(set(ids)), "duplicate rows in the target"
        assert len(ids) == total, f"{len(ids)} rows, expected {total}"
        want = expected_rows(0, total, width)
        got = self.table_rows()
        for name in want.column_names:
            assert got.column(name).to_pylist() == want.column(name).to_pylist(), name

    def sink_id(self) -> str:
        (sink_id,) = self.record_store().log.streams()
        return sink_id

    def assert_nothing_prepared(self) -> None:
        left = self.query("SELECT gid FROM pg_prepared_xacts")
        assert left == [], f"prepared transactions left: {left}"

    def record_store(self) -> RecordStore:
        return RecordStore(DeltaEventLog(str(Path(self.checkpoint) / "pyspark_txn" / "records")))

    def assert_records_consistent(self) -> None:
        store = self.record_store()
        (sink_id,) = store.log.streams()
        state = check_invariants(sink_id, store.events(sink_id))
        records = sorted(state.records.values(), key=lambda r: r.snapshot_id)
        batches = [r.batch_id for r in records]
        assert batches == sorted(set(batches))
        (top,) = self.query(
            f"SELECT max(batch_id) FROM {self.schema}.pyspark_txn_batches WHERE sink_id = %s",
            (sink_id,),
        )[0]
        assert top == batches[-1]
        assert sum(r.rows for r in records) == self.total
