"""Running txn-sequence -> txn-postgres pipelines and checking every row in PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
from pipeline_checks import StreamPipeline

from pyspark_txn.sources.sequence import expected_rows


class PgPipeline(StreamPipeline):
    """Into txn-postgres, with the checks of the PostgreSQL table."""

    def __init__(self, spark, base: Path, server, schema: str, total=5000, per_batch=1000):
        super().__init__(spark, base, total, per_batch)
        self.server = server
        self.schema = schema
        self.table = f"{schema}.target"

    def writer(self, faults: str | None = None, width: int = 0, **options):
        w = (
            self.source(width)
            .writeStream.format("txn-postgres")
            .option("url", self.server.url)
            .option("table", self.table)
            .option("createTable", "true")
            .option("checkpointLocation", self.checkpoint)
        )
        for k, v in self.sink_options(faults, options).items():
            w = w.option(k, v)
        return w

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

    def assert_records_consistent(self) -> None:
        state = self.sink_state()
        sink_id = state.sink_id
        records = sorted(state.records.values(), key=lambda r: r.snapshot_id)
        batches = [r.batch_id for r in records]
        assert batches == sorted(set(batches))
        (top,) = self.query(
            f"SELECT max(batch_id) FROM {self.schema}.pyspark_txn_batches WHERE sink_id = %s",
            (sink_id,),
        )[0]
        assert top == batches[-1]
        assert sum(r.rows for r in records) == self.total
