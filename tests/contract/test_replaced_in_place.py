"""A table replaced in place (delta-rs ``DeltaTable.create(mode="overwrite")``, Delta's
CREATE OR REPLACE): a new commit on the same log, history and app transactions kept, a
new Delta table id. Between two commit steps the sink goes on (its txn is still there);
between a record and its phase 2 the new id check refuses the batch, at every restart."""

import pytest
from deltalake import DeltaTable
from support import at_fault_point

from pyspark_txn.errors import TargetGoneError


def _replace(target):
    from test_admin import SCHEMA

    DeltaTable.create(target, schema=SCHEMA, mode="overwrite")


def test_replaced_in_place_between_batches_goes_on(tmp_path):
    from test_admin import SinkDriver

    sink = SinkDriver(tmp_path)
    sink.batch(0, [0, 1])
    sink.batch(1, [2, 3])
    _replace(sink.target)
    assert DeltaTable(sink.target).transaction_version(sink.sink_id) == 1
    sink.batch(2, [4, 5])
    sink.batch(3, [6, 7])
    ids = sorted(DeltaTable(sink.target).to_pyarrow_table()["id"].to_pylist())
    assert ids == [4, 5, 6, 7]


@pytest.mark.parametrize("point", ["after_record"])
def test_replaced_in_place_during_a_commit_step_is_not_refused(tmp_path, monkeypatch, point):
    from test_admin import SinkDriver

    sink = SinkDriver(tmp_path)
    sink.batch(0, [0, 1])
    sink.batch(1, [2, 3])
    at_fault_point(monkeypatch, point, 2, lambda: _replace(sink.target))
    errors = []
    try:
        sink.batch(2, [4, 5])
    except TargetGoneError as e:
        errors.append(str(e))
    for b in (3, 4):  # a restart: the pending record's phase 2 again
        try:
            sink.batch(b, [2 * b, 2 * b + 1], run_id=f"run-{b}")
        except TargetGoneError as e:
            errors.append(f"batch {b}: {e}")
    assert not errors, "\n".join(errors)
