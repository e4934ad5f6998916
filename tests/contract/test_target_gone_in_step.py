"""The target deleted between the step's lost-table check and its phase 2
(another process deletes it while a batch commits) must be refused, never started
anew at version 0 with only the new batch (seen live on moto S3: batch 10 of a query
landed as version 0 of a new table, batches 0-9 gone, the query ran on)."""

import os
import shutil

import pytest
from deltalake import DeltaTable
from support import at_fault_point

from pyspark_txn.errors import TargetGoneError


@pytest.mark.parametrize("point", ["before_record", "after_record"])
def test_a_target_deleted_during_a_commit_step_is_not_started_anew(tmp_path, monkeypatch, point):
    from test_admin import SinkDriver

    sink = SinkDriver(tmp_path)
    sink.batch(0, [0, 1])
    sink.batch(1, [2, 3])
    at_fault_point(monkeypatch, point, 2, lambda: shutil.rmtree(sink.target))
    try:
        sink.batch(2, [4, 5])
    except TargetGoneError:
        pass
    log_dir = os.path.join(sink.target, "_delta_log")
    assert not os.path.isdir(log_dir), (
        f"a new table was started (version {DeltaTable(sink.target).version()}) with only "
        f"batch 2, whose staged file went with the old table: {sorted(os.listdir(log_dir))}"
    )
    with pytest.raises(TargetGoneError):
        sink.batch(3, [6, 7])


@pytest.mark.parametrize("commits", [1, 3, 5])
def test_a_target_recreated_during_a_commit_step_gets_no_phase_two(tmp_path, monkeypatch, commits):
    """Deleted and re-created by another writer (same schema) after the record: phase 2
    must not append batch 2 to that other table (it did, and every later batch too:
    the table says batch 2 is in, the record agrees, batches 0-1 are silently gone)."""
    import pyarrow as pa
    from deltalake import write_deltalake
    from test_admin import SCHEMA, SinkDriver

    sink = SinkDriver(tmp_path)
    sink.batch(0, [0, 1])
    sink.batch(1, [2, 3])

    def recreate():
        shutil.rmtree(sink.target)
        for i in range(commits):
            write_deltalake(
                sink.target,
                pa.table({"id": pa.array([100 + i], pa.int64()), "v": ["x"]}, schema=SCHEMA),
                mode="append",
            )

    at_fault_point(monkeypatch, "after_record", 2, recreate)
    try:
        sink.batch(2, [4, 5])
    except TargetGoneError:
        pass
    assert DeltaTable(sink.target).transaction_version(sink.sink_id) is None, (
        "batch 2 went into the other table (its add names a staged file that went "
        "with the old table: the table cannot be read)"
    )
