"""Upserts, SCD type 2, complete mode and update-mode aggregations through Spark: a CDC
stream (out-of-order sequences across batches, several changes of a key in one batch,
deletes) merged by key into ``txn-delta``, a streaming aggregation in complete mode into
``txn-delta`` and in update mode through ``delta_batch_writer(keys=...)``; each compared
with a pure-Python oracle (``tests/e2e/upsert_driver.py``), and again after a fault at
each protocol step of a batch and a restart. Bad input is refused before any data is
touched. Without Spark: tests/contract/test_upserts.py; kill -9: tests/e2e/test_upserts_kill.py.

``exit`` kills the Python process at the step: for ``txn-delta`` that is the Spark
worker running the commit; the update route commits in the driver (this process), so
here it only ``raise``s (the e2e tests kill that driver).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake
from e2e import upsert_driver as pipelines
from pipeline_checks import run_to_end

import pyspark_txn
from pyspark_txn import admin
from pyspark_txn.sinks.tombstones import tombstones_uri

pytestmark = pytest.mark.spark


class Upserts(pipelines.Pipeline):
    """A pipeline of upsert_driver, run in this process's session to the end of its
    source as often as a test likes."""

    def __init__(self, spark, base: Path, kind: str, total: int = 1600, per_batch: int = 400):
        super().__init__(kind, base, total, per_batch)
        self.spark = spark

    def run(self, faults: str | None = None, **options) -> Exception | None:
        """Run to the end; the query's failure instead of raising it."""
        if faults:
            options["faultInjection"] = faults
        w = pipelines.writer(
            self.spark,
            self.kind,
            self.target,
            self.checkpoint,
            self.total,
            self.per_batch,
            **options,
        )
        try:
            run_to_end(w)
        except Exception as e:
            return e
        return None


@pytest.fixture
def upserts(spark, tmp_path):
    made = iter(range(100))

    def make(kind: str, **kw) -> Upserts:
        base = tmp_path / f"{kind}-{next(made)}"
        base.mkdir()
        return Upserts(spark, base, kind, **kw)

    return make


# --- the pipelines, without faults ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["cdc", "scd2"])
def test_a_cdc_stream_equals_the_change_log_applied_once_in_order(upserts, kind):
    p = upserts(kind)
    assert p.run() is None
    p.check()
    dt = DeltaTable(p.target)
    assert "op" not in dt.schema().to_arrow().names  # exceptColumns
    ops = [h["operation"] for h in dt.history() if "pyspark_txn.batch_id" in h]
    assert set(ops) == {"MERGE"}, ops  # one MERGE per batch, nothing else
    # the deletes are remembered (sequenceBy with deleteWhen)
    sink_id = admin.open_sink(p.checkpoint).sink_id
    assert DeltaTable(tombstones_uri(p.target, sink_id)).to_pyarrow_table().num_rows > 0
    # a restart with nothing new changes nothing
    version = dt.version()
    assert p.run() is None
    assert DeltaTable(p.target).version() == version


def test_the_oracles_see_what_the_stream_is_made_of():
    """The change stream has what the tests claim: out-of-order sequences across batches,
    several changes of a key in one batch, deletes, late changes older than a delete."""
    total, per_batch = 2000, 400
    log = pipelines.changes(total)
    batches = [log[i : i + per_batch] for i in range(0, total, per_batch)]
    assert any(
        max(c[1] for c in a) > min(c[1] for c in b)
        for a, b in zip(batches, batches[1:], strict=False)
    )
    assert all(len({c[0] for c in b}) < len(b) for b in batches)
    final = pipelines.expected_scd1(total)
    assert 0 < len(final) < pipelines.KEYS  # some keys end deleted
    late = 0
    for b, batch in enumerate(batches):  # an update arrives after a newer delete of its key
        deletes = {(c[0], c[1]) for earlier in batches[:b] for c in earlier if c[2] == "D"}
        late += any(c[2] == "U" and any(k == c[0] and s > c[1] for k, s in deletes) for c in batch)
    assert late


def test_complete_mode_holds_one_whole_result_at_every_version(upserts):
    p = upserts("complete")
    assert p.run() is None
    p.check()  # check_every_version: version by version, read with delta-rs
    ops = {h["operation"] for h in DeltaTable(p.target).history()}
    assert ops <= {"WRITE", "CREATE TABLE"}, ops


def test_update_mode_through_delta_batch_writer_equals_the_final_aggregate(upserts):
    p = upserts("update")
    assert p.run() is None
    p.check()


def test_update_mode_into_txn_delta_is_refused_by_spark(upserts, spark):
    """Spark refuses update mode for every Python data source sink, before our code runs
    (PySpark 4.3: "requirement failed: txn-delta does not support Update mode"). Update-mode
    aggregations go through ``delta_batch_writer(..., keys=...)``."""
    p = upserts("update")
    w = (
        pipelines.agg_frame(spark, p.total, p.per_batch)
        .writeStream.outputMode("update")
        .format("txn-delta")
        .option("path", p.target)
        .option("checkpointLocation", p.checkpoint)
        .option("keys", "k")
    )
    with pytest.raises(Exception, match="txn-delta does not support Update mode"):
        run_to_end(w)
    assert not os.path.exists(p.target)


def test_a_partitioned_cdc_table_keeps_its_partition_values(upserts, spark):
    """Staged files hold no partition column (its value is in the folder's name): the
    merge reads it back from there, for the keys and for the rows it writes."""
    p = upserts("cdc")
    df = pipelines.cdc_frame(spark, p.total, p.per_batch).selectExpr(
        "*", "CAST(k % 4 AS INT) AS part"
    )
    w = df.writeStream.format("txn-delta").option("path", p.target)
    w = w.option("checkpointLocation", p.checkpoint).options(**pipelines.CDC_OPTIONS)
    run_to_end(w.option("partitionBy", "part"))
    dt = DeltaTable(p.target)
    assert dt.metadata().partition_columns == ["part"]
    rows = dt.to_pyarrow_table().to_pylist()
    assert [r for r in rows if r["part"] != r["k"] % 4] == []
    assert pipelines.table("cdc", p.target) == pipelines.expected_scd1(p.total)


def test_update_mode_into_a_table_partitioned_by_its_key(upserts, spark):
    p = upserts("update")
    w = (
        pipelines.agg_frame(spark, p.total, p.per_batch)
        .writeStream.outputMode("update")
        .foreachBatch(
            pyspark_txn.delta_batch_writer(
                path=p.target, checkpoint=p.checkpoint, keys="k", partitionBy="k"
            )
        )
        .option("checkpointLocation", p.checkpoint)
    )
    run_to_end(w)
    assert DeltaTable(p.target).metadata().partition_columns == ["k"]
    p.check()


def _batch_writer_query(spark, p: Upserts, mode: str, **options):
    sink = pyspark_txn.delta_batch_writer(path=p.target, checkpoint=p.checkpoint, **options)
    return (
        pipelines.agg_frame(spark, p.total, p.per_batch)
        .writeStream.outputMode(mode)
        .foreachBatch(sink)
        .option("checkpointLocation", p.checkpoint)
    )


def test_update_mode_through_delta_batch_writer_without_keys_is_refused(upserts, spark):
    """Appended, each batch's updated groups would be more rows of the same groups."""
    p = upserts("update")
    with pytest.raises(Exception) as e:
        run_to_end(_batch_writer_query(spark, p, "update"))
    _one_line(e.value, r"delta_batch_writer: the query runs in update mode, .* give keys=")
    _nothing_written(p)


def test_complete_mode_through_delta_batch_writer_replaces_the_result(upserts, spark):
    """Each batch is the whole result: it replaces the table's rows, as txn-delta does in
    complete mode (appended, every batch would add the whole result again)."""
    p = upserts("complete")
    run_to_end(_batch_writer_query(spark, p, "complete"))
    p.check()  # every version one whole result


# --- faults at each protocol step, then a restart -------------------------------------------

# (kind, fault): kill (exit) or fail (raise) each step of batch 1, then restart. The
# bounded set keeps one step of each kind; SLOW=1 runs every step of every kind, both
# actions where the step runs in a Spark worker (txn-delta's commit), raise where it runs
# in this driver (the update route).
_STEPS = ["before_record", "after_record", "mid_phase2", "after_phase2", "after_commit"]
_BOUNDED = {
    ("cdc", "mid_phase2:exit@batch=1"),  # tombstones written, the MERGE not
    ("scd2", "after_record:raise@batch=1"),  # the record safe, no tombstone, no MERGE
    ("complete", "after_phase2:exit@batch=1"),  # overwritten, not confirmed
    ("update", "after_phase2:raise@batch=1"),  # merged, Spark's commit log not written
}


def _fault_cases():
    for kind in pipelines.KINDS:
        for step in _STEPS:
            if step == "mid_phase2" and kind not in ("cdc", "scd2"):
                continue  # only a merge that keeps tombstones has a step between two commits
            for action in ("raise",) if kind == "update" else ("exit", "raise"):
                fault = f"{step}:{action}@batch=1"
                slow = [] if (kind, fault) in _BOUNDED else [pytest.mark.slow]
                yield pytest.param(kind, fault, id=f"{kind}-{fault}", marks=slow)


@pytest.mark.parametrize(("kind", "fault"), list(_fault_cases()))
def test_a_fault_at_a_protocol_step_then_restart_applies_every_change_once(
    upserts, fired_faults, kind, fault
):
    p = upserts(kind)
    failure = p.run(fault)
    assert failure is not None, "the injected fault must fail the query"
    fired_faults.assert_fired(fault)
    if ":raise" in fault:
        assert f"injected fault at {fault.partition(':')[0]}" in str(failure), str(failure)[:3000]
    if kind == "complete" and DeltaTable.is_deltatable(p.target):
        p.check_every_version()  # what the crash left: whole results only
    assert p.run() is None
    p.check()


@pytest.mark.slow
@pytest.mark.parametrize("kind", pipelines.KINDS)
def test_a_fault_at_every_step_in_one_pipeline(upserts, fired_faults, kind):
    p = upserts(kind, total=3600)
    action = "raise" if kind == "update" else "exit"
    steps = [s for s in _STEPS if s != "mid_phase2" or kind in ("cdc", "scd2")]
    for batch, step in enumerate(steps):
        fault = f"{step}:{action}@batch={batch}"
        assert p.run(fault) is not None, fault
        fired_faults.assert_fired(fault)
        if kind == "complete" and DeltaTable.is_deltatable(p.target):
            p.check_every_version()
    assert p.run() is None
    p.check()


def test_a_redone_first_batch_keeps_its_deletes(upserts, fired_faults, spark):
    """Batch 0 of a sink into a table that has rows already (loaded before the stream
    started), crashed after its tombstones landed and before the MERGE: the redo must
    not take its own deletes for older ones and drop them."""
    p = upserts("cdc")
    write_deltalake(
        p.target,
        pa.table(
            {"k": pa.array(range(pipelines.KEYS), pa.int64()), "seq": [-1] * pipelines.KEYS}
        ).append_column("v", pa.array(["loaded"] * pipelines.KEYS)),
    )
    fault = "mid_phase2:raise@batch=0"
    assert p.run(fault) is not None
    fired_faults.assert_fired(fault)
    assert p.run() is None
    assert pipelines.table("cdc", p.target) == pipelines.expected_scd1(p.total)


# --- bad input: refused before any data is touched ------------------------------------------


def _nothing_written(p: Upserts) -> None:
    assert not DeltaTable.is_deltatable(p.target), "the target was written"
    data = [f for f in Path(p.base).rglob("*.parquet") if "pyspark_txn" not in f.parts]
    assert data == [], data


def _one_line(failure: Exception | None, pattern: str) -> str:
    """The line of the query's failure that matches ``pattern`` (one clear line)."""
    assert failure is not None, "the query must fail"
    lines = [line for line in str(failure).splitlines() if re.search(pattern, line)]
    assert lines, str(failure)[:3000]
    return lines[0]


def test_a_key_column_missing_from_the_stream_is_refused(upserts):
    p = upserts("cdc")
    failure = p.run(keys="nope")
    _one_line(failure, r"option keys: columns \['nope'\] are not in the stream")
    _nothing_written(p)


def test_a_null_key_in_the_data_is_refused_before_the_record(upserts, spark):
    """A null key in batch 1: refused before its record, with one line; the table holds
    batch 0 only, and nothing the refused batch staged is left."""
    p = upserts("cdc")
    df = pipelines.cdc_frame(spark, p.total, p.per_batch).selectExpr(
        "CASE WHEN v = 'v500' THEN NULL ELSE k END AS k", "seq", "op", "v"
    )
    w = df.writeStream.format("txn-delta").option("path", p.target)
    w = w.option("checkpointLocation", p.checkpoint).options(**pipelines.CDC_OPTIONS)
    with pytest.raises(Exception) as e:
        run_to_end(w)
    _one_line(e.value, r"option keys: column 'k' is null in 1 change record\(s\) of this batch")
    assert set(p.batch_commits().values()) == {0}
    assert pipelines.table("cdc", p.target) == pipelines.expected_scd1(p.per_batch)
    handle = admin.open_sink(p.checkpoint)
    assert [r.batch_id for r in handle.load().records.values()] == [0]
    assert admin.stuck_snapshots(handle) == []
    assert p.staged_files() == []


def test_a_sequence_of_an_unorderable_type_is_refused(upserts, spark):
    p = upserts("cdc")
    df = pipelines.cdc_frame(spark, p.total, p.per_batch).selectExpr(
        "k", "array(seq) AS seq", "op", "v"
    )
    w = df.writeStream.format("txn-delta").option("path", p.target)
    w = w.option("checkpointLocation", p.checkpoint).options(**pipelines.CDC_OPTIONS)
    with pytest.raises(Exception) as e:
        run_to_end(w)
    _one_line(e.value, r"option sequenceBy: column 'seq' has type list<.*>, which has no order")
    _nothing_written(p)


def test_a_delete_predicate_that_does_not_parse_is_refused(upserts):
    p = upserts("cdc")
    failure = p.run(deleteWhen="op ==")
    _one_line(failure, r"option deleteWhen='op ==': .*position")
    _nothing_written(p)


def test_keys_changed_across_a_restart_are_refused(upserts):
    p = upserts("cdc", total=800)
    assert p.run() is None
    before = pipelines.table("cdc", p.target)
    p.total = 1600
    failure = p.run(keys="v")
    _one_line(failure, r"upsert options .*keys=\['k'\].*keys=\['v'\]")
    assert pipelines.table("cdc", p.target) == before
    assert p.run() is None  # the same keys again: it goes on
    p.check()


@pytest.mark.parametrize("table_parts", [["k"], pytest.param([], marks=pytest.mark.slow)])
def test_complete_mode_with_a_partitioning_other_than_the_tables_is_refused(upserts, table_parts):
    """A table partitioned otherwise than partitionBy says (by an earlier query here):
    refused when the query starts, naming both; the table keeps its result."""
    first = upserts("complete", total=800)
    assert first.run(**({"partitionBy": "k"} if table_parts else {})) is None
    assert DeltaTable(first.target).metadata().partition_columns == table_parts
    version = DeltaTable(first.target).version()
    other = upserts("complete", total=800)
    other.target = first.target  # another query (checkpoint) into the same table
    failure = other.run(partitionBy="" if table_parts else "k")
    _one_line(failure, r"option partitionBy=.* but the Delta table at .* is partitioned by")
    assert DeltaTable(first.target).version() == version


def test_keys_with_complete_mode_are_refused(upserts):
    p = upserts("complete")
    failure = p.run(keys="k")
    _one_line(failure, "option keys with outputMode complete")
    _nothing_written(p)
