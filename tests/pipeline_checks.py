"""Running txn-sequence -> txn-delta pipelines and checking every row of the result."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
from deltalake import DeltaTable

import pyspark_txn
from pyspark_txn.sinks.staging import STAGING_ROOT
from pyspark_txn.sources.sequence import expected_rows
from pyspark_txn.state import DeltaEventLog, RecordStore, check_invariants


class FiredFaults:
    """The faults fired since this object was made, in any process (the lines that
    ``pyspark_txn.faults`` appends to ``$PYSPARK_TXN_FAULT_LOG``; tests/conftest.py sets it)."""

    def __init__(self) -> None:
        self.path = Path(os.environ["PYSPARK_TXN_FAULT_LOG"])
        self.offset = self.path.stat().st_size if self.path.exists() else 0

    def lines(self) -> list[str]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            return f.read().decode().splitlines()

    def fired(self, rule: str) -> list[str]:
        """The lines of ``rule`` (``point:action[@batch=N][@snapshot=S][@partition=P]``)."""
        head, *conds = rule.split("@")
        return [
            line
            for line in self.lines()
            if line.split()[0] == head and all(c in line.split()[1:] for c in conds)
        ]

    def assert_fired(self, rule: str) -> None:
        assert self.fired(rule), f"{rule} never fired (fired: {self.lines()})"


def await_end(query, timeout_s: float = 300) -> None:
    """Wait for an ``availableNow`` query to end. PySpark's ``awaitTermination(timeout)``
    returns False when the time runs out: that is a hang, so the query is stopped and the
    test fails (a query's own failure raises as usual)."""
    if not query.awaitTermination(timeout_s):
        query.stop()
        import pytest

        pytest.fail(f"the query did not end within {timeout_s} s (stopped)", pytrace=False)


def run_to_end(writer):
    """Start ``writer``, process everything available, stop; the query (see
    :func:`pyspark_txn.process_available`: ``availableNow`` where it drains a Python source)."""
    return pyspark_txn.process_available(writer)


class StreamPipeline:
    """A txn-sequence stream into one of our sinks (``writer``), run to the end, and its
    record table: what every sink's pipeline tests share."""

    #: Partition columns derived from each row's id: name -> (SQL expression of ``id``,
    #: the value the target must read back for an id). The sink gets them as partitionBy.
    partitions: Mapping[str, tuple[str, Callable[[int], Any]]] = {}

    def __init__(self, spark, base: Path, total: int = 5000, per_batch: int = 1000):
        self.spark = spark
        self.base = base
        self.checkpoint = str(base / "chk")
        self.total = total
        self.per_batch = per_batch
        self.start = 0  # the source's first row index

    def source(self, width: int = 0):
        """The txn-sequence stream, with the partition columns."""
        df = (
            self.spark.readStream.format("txn-sequence")
            .option("rowsPerBatch", self.per_batch)
            .option("totalRows", self.total)
            .option("width", width)
            .option("start", self.start)
            .load()
        )
        if self.partitions:
            derived = [f"{sql} AS `{name}`" for name, (sql, _) in self.partitions.items()]
            df = df.selectExpr("*", *derived)
        return df

    def sink_options(self, faults: str | None, options: dict[str, Any]) -> dict[str, Any]:
        if faults:
            options["faultInjection"] = faults
        if self.partitions:
            options.setdefault("partitionBy", ",".join(self.partitions))
        return options

    def writer(self, faults: str | None = None, width: int = 0, **options):
        raise NotImplementedError

    def run(self, faults: str | None = None, **options) -> Exception | None:
        """Run to the end; return the query's failure instead of raising it."""
        try:
            run_to_end(self.writer(faults, **options))
        except Exception as e:
            return e
        return None

    def record_store(self) -> RecordStore:
        return RecordStore(DeltaEventLog(os.path.join(self.checkpoint, "pyspark_txn", "records")))

    def sink_state(self):
        store = self.record_store()
        (sink_id,) = store.log.streams()
        return check_invariants(sink_id, store.events(sink_id))


class PipelineRunner(StreamPipeline):
    """Into txn-delta, with the checks of the Delta table."""

    def __init__(self, spark, base: Path, total: int = 5000, per_batch: int = 1000):
        super().__init__(spark, base, total, per_batch)
        self.target = str(base / "target")

    def writer(self, faults: str | None = None, width: int = 0, **options):
        w = self.source(width).writeStream.format("txn-delta").option("path", self.target)
        w = w.option("checkpointLocation", self.checkpoint)
        for k, v in self.sink_options(faults, options).items():
            w = w.option(k, v)
        return w

    # --- checks ---------------------------------------------------------------

    def table(self):
        return DeltaTable(self.target).to_pyarrow_table().sort_by("id")

    def assert_exactly_once(self, total: int | None = None, width: int = 0) -> None:
        """Every source row is in the target exactly once, with its exact values."""
        total = self.total if total is None else total
        got = self.table()
        ids = got.column("id")
        assert pc.count_distinct(ids).as_py() == got.num_rows, "duplicate rows in the target"
        want = expected_rows(0, total, width)
        assert got.num_rows == total, f"{got.num_rows} rows, expected {total}"
        assert got.select(want.column_names).equals(want)
        ids = got.column("id").to_pylist()
        for name, (_, value) in self.partitions.items():
            assert got.column(name).to_pylist() == [value(i) for i in ids], name

    def data_files(self) -> set[str]:
        """Every parquet file in the table's folder (the log's and any others)."""
        root = Path(self.target)
        return {
            str(p.relative_to(root))
            for p in root.rglob("*.parquet")
            if "_delta_log" not in p.relative_to(root).parts
        }

    def assert_no_orphans(self) -> None:
        """No data file outside the Delta log is left once the pipeline is done, and no
        other file (Spark's ``_SUCCESS``, ``.crc``, ``_temporary``) in the table's folders."""
        live = set(DeltaTable(self.target).file_uris())
        live = {os.path.relpath(u.removeprefix("file://"), self.target) for u in live}
        orphans = self.data_files() - live
        assert not orphans, f"orphan data files: {sorted(orphans)}"
        root = Path(self.target)
        others = [
            p.relative_to(root)
            for p in root.rglob("*")
            if p.relative_to(root).parts[0] not in ("_delta_log", STAGING_ROOT)
            and (p.is_file() and p.suffix != ".parquet" or p.name.startswith(("_", ".")))
        ]
        assert not others, f"files that are no data files in the table's folders: {others}"
        staged = Path(self.target) / STAGING_ROOT
        stray = [p for p in staged.rglob("*") if p.is_file() and not p.name.endswith(".dir")]
        assert not stray, f"data in the staging area: {stray}"

    def assert_records_consistent(self) -> None:
        state = self.sink_state()
        records = sorted(state.records.values(), key=lambda r: r.snapshot_id)
        ids = [r.snapshot_id for r in records]
        assert ids == sorted(set(ids)), "snapshot ids must strictly increase"
        batches = [r.batch_id for r in records]
        assert batches == sorted(set(batches))
        assert DeltaTable(self.target).transaction_version(state.sink_id) == batches[-1]
        if state.summary_seq == 0:  # (retention summarized older records away)
            assert sum(r.rows for r in records) == self.table().num_rows
