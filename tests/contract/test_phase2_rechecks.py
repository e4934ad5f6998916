"""Phase 2 commits into the table as it is then, which may not be the table the record
was checked against (issue 34 items 10 and 11; protocol review 2026-11-27, F3 and F4).

F3: another engine alters the target after a batch's record (a CHECK constraint the
rows break, a table feature, a retyped, dropped or renamed column). Recovery, or a
phase 2 retried after a conflict with that change, used to commit the batch anyway:
the table then held rows that break its own constraint, or files whose schema it no
longer declares. Phase 2 now checks the table it commits on again and refuses, leaving
the record to `pyspark-txn stuck` / `abandon`; a constraint the rows meet is no reason.

F4: another writer checkpoints the target and cleans its log while a step holds a
cached table object made from the commit files that cleanup removed; reading the
sink's app version from it failed the batch ("File not found ...001.json").

Real Delta tables (delta-rs) in tmp dirs; the "other engine" is delta-rs's own DDL.
"""

from __future__ import annotations

import json
import os
import pickle
import threading
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake
from deltalake.table import TableFeatures
from support import at_fault_point
from test_admin import SCHEMA, SinkDriver, run_cli, stuck_after_record

from pyspark_txn import admin
from pyspark_txn.errors import ConfigError, TargetChangedError
from pyspark_txn.sinks import delta_target
from pyspark_txn.storage import delta_tables


def _sink(tmp_path, **options):
    s = SinkDriver(tmp_path, **options)
    s.batch(0, [1, 2])
    s.batch(1, [3, 4])
    return s


def _refused_recovery(s, snapshot_id):
    """A restart (a new run) recovers the pending batch 2 and must refuse it."""
    with pytest.raises(TargetChangedError) as e:
        s.batch(3, [5, 6], run_id="run-2")
    msg = str(e.value)
    assert "batch 2" in msg and s.target in msg and f"snapshot {snapshot_id}" in msg
    assert "stays pending" in msg and f"--snapshot {snapshot_id}" in msg
    assert "\n" not in msg
    assert not TargetChangedError.retryable
    return msg


def _nothing_committed(s):
    dt = DeltaTable(s.target)
    assert dt.transaction_version(s.sink_id) == 1, "batch 2 was committed after all"
    assert set(pa.table(dt.get_add_actions()).column("path").to_pylist()).isdisjoint(
        {t.handle for t in s.handle().load().last_record.txns}
    )


def _stuck_and_abandonable(s, capsys, rec):
    (stuck,) = admin.stuck_snapshots(s.handle())
    assert stuck.record.snapshot_id == rec.snapshot_id and stuck.record.batch_id == 2
    assert not stuck.target_holds_batch and stuck.to_json()["abandonable"] is True
    code, out, _ = run_cli(capsys, "stuck", s.chk)
    assert code == 0 and f"snapshot {rec.snapshot_id}" in out


# --- F3: a CHECK constraint added after the record ------------------------------------


@pytest.mark.parametrize(
    "constraint, broken",
    [("id < 50", 2), ("v != 'v200' AND id > 0", 1)],
    ids=["both-rows", "one-row"],
)
def test_recovery_refuses_rows_that_break_a_constraint_added_after_the_record(
    tmp_path, capsys, constraint, broken
):
    s = _sink(tmp_path)
    rec = stuck_after_record(s, 2, [100, 200])  # recorded, the driver died before phase 2
    DeltaTable(s.target).alter.add_constraint({"small_ids": constraint})  # another engine

    msg = _refused_recovery(s, rec.snapshot_id)
    assert "small_ids" in msg and constraint in msg and f"{broken} of the batch's 2 rows" in msg
    _nothing_committed(s)
    assert s.ids() == [1, 2, 3, 4]
    with pytest.raises(TargetChangedError):  # every restart: the same refusal, nothing lands
        s.batch(3, [5, 6], run_id="run-3")
    assert s.ids() == [1, 2, 3, 4]

    _stuck_and_abandonable(s, capsys, rec)
    code, out, err = run_cli(capsys, "abandon", s.chk, "--snapshot", rec.snapshot_id, "--yes")
    assert code == 0, err
    assert admin.stuck_snapshots(s.handle()) == []

    # Spark replays batch 2: with the constraint there, it is refused before any record
    # (txn-delta does not enforce CHECK constraints on new batches), and nothing wedges
    with pytest.raises(ConfigError, match="CHECK constraints"):
        s.batch(2, [100, 200], run_id="run-4")
    assert admin.stuck_snapshots(s.handle()) == []
    # the person who decides drops the constraint (or changes the query): the query goes on
    DeltaTable(s.target).alter.drop_constraint("small_ids")
    s.batch(2, [100, 200], run_id="run-5")
    s.batch(3, [5, 6], run_id="run-5")
    assert s.ids() == [1, 2, 3, 4, 5, 6, 100, 200]  # every row exactly once
    assert admin.stuck_snapshots(s.handle()) == [] and admin.verify(s.handle()).ok


@pytest.mark.parametrize("constraint", ["id < 500", "v LIKE 'v%' AND id IS NOT NULL"])
def test_recovery_commits_rows_that_meet_a_constraint_added_after_the_record(tmp_path, constraint):
    """No false refusal: the rows meet it, so the decided batch lands. The next batch
    is new and follows the sink's rules for new batches: refused before its record."""
    s = _sink(tmp_path)
    stuck_after_record(s, 2, [100, 200])
    DeltaTable(s.target).alter.add_constraint({"in_range": constraint})
    with pytest.raises(ConfigError, match="CHECK constraints"):  # batch 3, not batch 2
        s.batch(3, [5, 6], run_id="run-2")
    assert s.ids() == [1, 2, 3, 4, 100, 200]
    assert DeltaTable(s.target).transaction_version(s.sink_id) == 2
    assert admin.stuck_snapshots(s.handle()) == []


def test_a_constraint_on_a_column_the_stream_lacks_reads_it_as_null(tmp_path):
    """The rows of a nullable table column the stream lacks are null there: a CHECK on
    it fails for them, as Delta's own writers decide (null or false breaks it)."""
    s = _sink(tmp_path)
    stuck_after_record(s, 2, [100, 200])
    _overwrite_schema(s, pa.table({"id": [7], "v": ["x"], "extra": [1]}))
    DeltaTable(s.target).alter.add_constraint({"has_extra": "extra > 0"})
    msg = _refused_recovery(s, 2)
    assert "has_extra" in msg and "2 of the batch's 2 rows" in msg
    _nothing_committed(s)


@pytest.mark.parametrize("constraint, broken", [("v != 'v200'", 1), ("v LIKE 'v%'", 0)])
def test_a_constraint_on_a_partition_column_reads_the_files_partition_values(
    tmp_path, constraint, broken
):
    """A partitioned table's files do not hold the partition column: its value is the
    file's partition value."""
    s = _sink(tmp_path, partitionBy="v")
    rec = stuck_after_record(s, 2, [100, 200])
    DeltaTable(s.target).alter.add_constraint({"by_part": constraint})
    if broken:
        msg = _refused_recovery(s, rec.snapshot_id)
        assert f"broken by {broken} of the batch's 2 rows" in msg
        _nothing_committed(s)
    else:
        with pytest.raises(ConfigError, match="CHECK constraints"):  # batch 3's preflight
            s.batch(3, [5, 6], run_id="run-2")
        assert s.ids() == [1, 2, 3, 4, 100, 200]


@pytest.mark.parametrize(
    "expression, said",
    [
        ("spark_only(id) > 0", "could not be evaluated on the batch's rows"),  # not taken as met
        ("Extra > 0 OR id < 150", "broken by 1 of the batch's 2 rows"),  # Spark's any-case name
    ],
)
def test_a_constraint_as_spark_wrote_it(tmp_path, expression, said):
    """Delta keeps the Spark SQL text; delta-rs's engine evaluates it. What it cannot
    evaluate refuses the batch; an unquoted name in another case still finds its column."""
    s = _sink(tmp_path)
    rec = stuck_after_record(s, 2, [100, 200])
    _overwrite_schema(s, pa.table({"id": [7], "v": ["x"], "Extra": [1]}))
    DeltaTable(s.target).alter.set_table_properties(  # as Spark's ADD CONSTRAINT leaves it
        {"delta.constraints.spark_made": expression}, raise_if_not_exists=False
    )
    msg = _refused_recovery(s, rec.snapshot_id)
    assert "spark_made" in msg and said in msg
    _nothing_committed(s)


def test_a_phase2_retried_after_a_conflicting_constraint_refuses(tmp_path, monkeypatch, capsys):
    """The constraint lands while phase 2 builds its commit: delta-rs's commit fails on
    the protocol change, phase 2 is retried on the fresh table, and must check it."""
    s = _sink(tmp_path)
    add_actions = delta_target.add_actions
    pending = [lambda: DeltaTable(s.target).alter.add_constraint({"small_ids": "id < 50"})]

    def other_engine_first(txns):  # phase 2 has opened the table and builds on it
        if pending:
            pending.pop()()
        return add_actions(txns)

    monkeypatch.setattr(delta_target, "add_actions", other_engine_first)
    with pytest.raises(TargetChangedError, match="small_ids"):
        s.batch(2, [100, 200])
    assert not pending, "the constraint was never added: the test proves nothing"
    assert s.ids() == [1, 2, 3, 4]
    rec = s.handle().load().last_record
    assert rec.batch_id == 2
    _stuck_and_abandonable(s, capsys, rec)


# --- F3: the schema or the table's features changed after the record -------------------


def _overwrite_schema(s, table):
    """Another engine's ``overwriteSchema``: a new schema, the old rows replaced."""
    write_deltalake(s.target, table, mode="overwrite", schema_mode="overwrite")


@pytest.mark.parametrize(
    "table, said",
    [
        (pa.table({"id": pa.array(["1"]), "v": pa.array(["x"])}), "column 'id' is "),
        (pa.table({"id": pa.array([1], pa.int64())}), "'v'"),
        (pa.table({"ident": pa.array([1], pa.int64()), "v": pa.array(["x"])}), "'id'"),
    ],
    ids=["retyped", "dropped", "renamed"],
)
def test_recovery_refuses_a_schema_changed_after_the_record(tmp_path, capsys, table, said):
    s = _sink(tmp_path)
    rec = stuck_after_record(s, 2, [100, 200])
    _overwrite_schema(s, table)
    msg = _refused_recovery(s, rec.snapshot_id)
    assert said in msg
    _nothing_committed(s)
    _stuck_and_abandonable(s, capsys, rec)
    DeltaTable(s.target).to_pyarrow_table()  # the table still reads


@pytest.mark.parametrize(
    "feature", [TableFeatures.RowTracking, TableFeatures.ColumnMapping], ids=str
)
def test_recovery_refuses_a_table_feature_added_after_the_record(tmp_path, capsys, feature):
    s = _sink(tmp_path)
    rec = stuck_after_record(s, 2, [100, 200])
    DeltaTable(s.target).alter.add_feature(feature, allow_protocol_versions_increase=True)
    msg = _refused_recovery(s, rec.snapshot_id)
    assert "writer features" in msg
    _nothing_committed(s)
    _stuck_and_abandonable(s, capsys, rec)


def test_recovery_refuses_nulls_in_a_column_made_not_null_after_the_record(tmp_path):
    s = _sink(tmp_path)
    committer = s.committer("after_record:raise@batch=2")
    sid, token = committer.allocate({"uri": s.target})
    rows = pa.record_batch([pa.array([7, 8], pa.int64()), pa.array([None, "x"])], schema=SCHEMA)
    from pyspark_txn.faults import InjectedFault
    from pyspark_txn.sinks.staging import stage_partition

    handles = stage_partition([rows], s.opts.staging(), sid, token, 0, SCHEMA)
    with pytest.raises(InjectedFault):
        committer.commit(
            2,
            sid,
            token,
            handles,
            run_id="run-1",
            query_id="q",
            target_meta=s.opts.target_meta(SCHEMA, committer.target.base()),
        )
    strict = pa.schema([pa.field("id", pa.int64()), pa.field("v", pa.string(), nullable=False)])
    _overwrite_schema(s, pa.table({"id": [1], "v": ["x"]}, schema=strict))
    msg = _refused_recovery(s, sid)
    assert "NOT NULL" in msg and "'v'" in msg
    _nothing_committed(s)


def test_a_table_that_did_not_change_is_not_checked_again(tmp_path, monkeypatch):
    """The hot path: phase 2 on the table version the record was made against checks
    nothing again (preflight checked that very version); another writer's commits in
    between cost the checks on the table's metadata, never a read of the staged files."""
    from pyspark_txn.sinks import delta_recheck

    s = _sink(tmp_path)
    checks, reads = [], []
    problems, read_rows = delta_recheck.table_problems, delta_target.DeltaTarget._staged_rows
    monkeypatch.setattr(
        delta_recheck, "table_problems", lambda *a, **k: checks.append(1) or problems(*a, **k)
    )
    monkeypatch.setattr(
        delta_target.DeltaTarget,
        "_staged_rows",
        lambda self, t: reads.append(t) or read_rows(self, t),
    )
    for b in range(2, 5):
        s.batch(b, [10 * b])
    assert checks == [] and reads == []
    write_deltalake(s.target, pa.table({"id": [-1], "v": ["other"]}, schema=SCHEMA), mode="append")
    at_fault_point(
        monkeypatch,
        "after_record",
        5,
        lambda: write_deltalake(
            s.target, pa.table({"id": [-2], "v": ["other"]}, schema=SCHEMA), mode="append"
        ),
    )
    s.batch(5, [50])
    assert len(checks) == 1 and reads == []
    assert s.ids() == [-2, -1, 1, 2, 3, 4, 20, 30, 40, 50]


# --- F4: another writer cleans the target's log under a cached table object -----------


def _other_writer_cleans(uri):
    write_deltalake(uri, pa.table({"id": [-1], "v": ["f"]}, schema=SCHEMA), mode="append")
    dt = DeltaTable(uri)
    dt.create_checkpoint()
    dt.cleanup_metadata()
    assert not os.path.exists(os.path.join(uri, "_delta_log", f"{1:020d}.json"))


def test_log_cleanup_between_the_planners_look_and_its_allocation(tmp_path, monkeypatch):
    """The review's F4 through the Spark writer class, as Spark drives it: built and
    pickled (allocating) on a planner thread, ``commit`` on another: two thread-local
    table caches, as Spark's two Python workers have."""
    pytest.importorskip("pyspark")
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    from pyspark_txn.sinks.delta import DeltaSinkOptions, TxnDeltaStreamWriter

    spark_schema = StructType([StructField("id", LongType()), StructField("v", StringType())])
    chk, uri = str(tmp_path / "chk"), str(tmp_path / "table")
    os.makedirs(f"{chk}/offsets")
    with open(f"{chk}/metadata", "w") as f:
        f.write('{"id": "q-1"}')
    opts = DeltaSinkOptions.parse({"path": uri, "checkpointLocation": chk})
    planner, committer = ThreadPoolExecutor(1), ThreadPoolExecutor(1)

    def run_batch(b, ids):
        with open(f"{chk}/offsets/{b}", "w") as f:
            f.write("v1\n{}\n" + json.dumps({"offset": b}))
        blob = planner.submit(lambda: pickle.dumps(TxnDeltaStreamWriter(opts, spark_schema)))
        rows = pa.record_batch(
            [pa.array(ids, pa.int64()), pa.array([f"v{i}" for i in ids])], schema=SCHEMA
        )
        msg = pickle.loads(blob.result()).write(iter([rows]))
        msg.run_id = "run-1"
        committer.submit(lambda: TxnDeltaStreamWriter(opts, spark_schema).commit([msg], b)).result()

    try:
        run_batch(0, [0, 1])
        DeltaTable(uri).alter.set_table_properties(
            {"delta.logRetentionDuration": "interval 0 seconds"}
        )
        run_batch(1, [10, 11])
        at_fault_point(monkeypatch, "allocate", None, lambda: _other_writer_cleans(uri))
        run_batch(2, [20, 21])  # failed with DeltaError "File not found ...001.json"
        run_batch(3, [30])
    finally:
        planner.shutdown()
        committer.shutdown()
    table = DeltaTable(uri)
    ids = sorted(table.to_pyarrow_table().column("id").to_pylist())
    assert ids == [-1, 0, 1, 10, 11, 20, 21, 30]  # every batch once, the other row kept
    assert table.transaction_version(opts.sink_id) == 3


def test_a_cached_table_whose_log_was_cleaned_is_reopened_once(tmp_path):
    """Inside one step (a table checked once is not checked again): the app version
    and the record's base come from a reopened table, not a "File not found"."""
    s = _sink(tmp_path)
    DeltaTable(s.target).alter.set_table_properties(
        {"delta.logRetentionDuration": "interval 0 seconds"}
    )
    target = s.opts.target()
    out: dict = {}

    def step():  # a fresh thread: its own cache, as a new Python worker
        with delta_tables.one_check_per_step():
            target.check_stream_schema(SCHEMA, False)  # the step's look: checked
            _other_writer_cleans(s.target)
            try:
                out["recent"] = target.committed_batch_recent(s.sink_id)
                out["base"] = target.base()
            except Exception as e:
                out["error"] = e

    t = threading.Thread(target=step)
    t.start()
    t.join()
    assert out.get("recent") == 1, out
    assert out["base"]["base_batch"] == 1 and out["base"]["base_version"] == 3


def test_a_second_not_found_after_the_reopen_is_raised(tmp_path):
    s = _sink(tmp_path)
    calls = []

    def gone(dt):  # a read that fails every time, as a log that keeps losing files would
        calls.append(dt)
        raise OSError(f"Kernel error: File not found: {s.target}/_delta_log/{1:020d}.json")

    with pytest.raises(OSError, match="File not found"):
        delta_tables.read_table(s.target, None, gone, refresh=False)
    assert len(calls) == 2

    def other(dt):  # anything else is not retried
        calls.append(dt)
        raise OSError("denied")

    calls.clear()
    with pytest.raises(OSError, match="denied"):
        delta_tables.read_table(s.target, None, other, refresh=False)
    assert len(calls) == 1
