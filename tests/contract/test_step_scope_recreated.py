"""A record table deleted and re-created between two steps of ONE protocol
step (one_check_per_step) must not get an append built on the old table's object."""

import contextlib
import os
import shutil
import subprocess
import sys

import pytest
from deltalake import DeltaTable
from support import allocated_event, at_fault_point

from pyspark_txn.state import AppendRejected, DeltaEventLog
from pyspark_txn.storage import delta_tables

_scope = delta_tables.one_check_per_step


def _recreate_elsewhere(uri, n):
    """Another process makes a new record table there with ``n`` events."""
    code = (
        "import sys\n"
        "from support import allocated_event\n"
        "from pyspark_txn.state import DeltaEventLog\n"
        "log = DeltaEventLog(sys.argv[1])\n"
        "for seq in range(int(sys.argv[2])):\n"
        "    log.append(allocated_event(seq, stream='other', query_id='new'))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code, uri, str(n)], check=True, env=env)


def test_record_table_recreated_inside_one_step_is_not_appended_to(tmp_path):
    uri = str(tmp_path / "records")
    log = DeltaEventLog(uri)
    for seq in range(5):
        log.append(allocated_event(seq, query_id="old"))  # versions 0..5
    with _scope():
        assert [e.seq for e in log.read("s")] == list(range(5))  # the step's read (checked)
        # another process deletes the record table and re-creates it, as many commits
        shutil.rmtree(uri)
        _recreate_elsewhere(uri, 7)
        # the step goes on: its append must see the new table (seq 5 is not next there)
        with pytest.raises(AppendRejected):
            log.append(allocated_event(5, query_id="old"))
    fresh = DeltaTable(uri)
    assert fresh.transaction_version("s") is None, (
        f"s#5 landed in the re-created table (version {fresh.version()}) on top of the "
        "old table's object"
    )


def test_a_commit_step_does_not_record_into_a_record_table_recreated_during_it(
    tmp_path, monkeypatch
):
    """Through the protocol (TxnDeltaStreamWriter.commit's scope): the record table is
    deleted and re-created by another process (with more commits than ours had) after
    the step read it and before it writes the batch's record. The record must not land
    in that other table (it did: seq 5 of our stream in a table that has none of 0..4,
    and the next batch then dies on "invariant broken: event sequence numbers are
    gap-free" instead of the record-table-replaced refusal)."""
    from test_admin import SinkDriver

    sink = SinkDriver(tmp_path)
    sink.batch(0, [0, 1])
    sink.batch(1, [2, 3])
    records = sink.opts.record_table

    def recreate():
        shutil.rmtree(records)
        _recreate_elsewhere(records, 30)

    at_fault_point(monkeypatch, "before_record", 2, recreate)
    with contextlib.suppress(Exception), _scope():
        sink.batch(2, [4, 5])
    assert DeltaTable(records).transaction_version(sink.sink_id) is None, (
        "batch 2's record landed in the re-created record table"
    )
