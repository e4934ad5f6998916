"""``pyspark_txn.admin`` and the ``pyspark-txn stuck|abandon|verify`` commands, on real
Delta tables (delta-rs) in tmp dirs. A sink's history is made by driving the real
protocol without Spark: allocate, stage parquet files, commit; faults are injected
at protocol steps or by changing files behind the sink's back."""

from __future__ import annotations

import io
import json
import os
import shutil
from dataclasses import replace

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from pyspark_txn import admin, cli
from pyspark_txn.errors import ConfigError, CorruptSnapshotError, TargetGoneError, TxnError
from pyspark_txn.faults import FaultPlan, InjectedFault
from pyspark_txn.sinks.delta import DeltaSinkOptions
from pyspark_txn.sinks.delta_target import schema_to_b64
from pyspark_txn.sinks.staging import STAGING_ROOT, snapshot_dir, stage_partition

SCHEMA = pa.schema([pa.field("id", pa.int64()), pa.field("v", pa.string())])


class SinkDriver:
    """One txn-delta sink driven like Spark would: allocate, stage, commit."""

    def __init__(self, tmp_path, name="a", *, target=None, chk=None, **options):
        self.tmp_path = tmp_path
        self.target = target or str(tmp_path / f"table-{name}")
        self.chk = chk or str(tmp_path / f"chk-{name}")
        opts = DeltaSinkOptions.parse(
            {"path": self.target, "checkpointLocation": self.chk, **options}
        )
        self.opts = opts.with_checkpoint_sink_id()  # writes <chk>/pyspark_txn/sink.json
        self.opts.record_store().log.create_if_missing()

    @property
    def sink_id(self):
        return self.opts.sink_id

    def committer(self, faults=None):
        return replace(self.opts, faults=FaultPlan.parse(faults)).committer()

    def batch(self, batch_id, ids, *, faults=None, run_id="run-1", source_offsets=None):
        """Stage ``ids`` under a new allocation and commit them as ``batch_id``."""
        committer = self.committer(faults)
        snapshot_id, token = committer.allocate({"uri": self.opts.path})  # as the sinks do
        rows = pa.record_batch(
            [pa.array(ids, pa.int64()), pa.array([f"v{i}" for i in ids])], schema=SCHEMA
        )
        handles = stage_partition([rows], self.opts.staging(), snapshot_id, token, 0, SCHEMA)
        return committer.commit(
            batch_id,
            snapshot_id,
            token,
            handles,
            run_id=run_id,
            query_id="q",
            source_offsets=source_offsets,
            target_meta=self.opts.target_meta(SCHEMA, committer.target.base()),
        )

    def record(self, snapshot_id):
        return self.opts.record_store().load_sink(self.sink_id).record_for_snapshot(snapshot_id)

    def path(self, handle):
        return os.path.join(self.target, handle)

    def staged_dir(self, rec):
        return os.path.join(self.target, snapshot_dir(self.sink_id, rec.snapshot_id, rec.token))

    def ids(self):
        return sorted(DeltaTable(self.target).to_pyarrow_table().column("id").to_pylist())

    def handle(self):
        return admin.open_sink(self.chk)


def stuck_after_record(sink, batch_id, ids):
    """Batch ``batch_id`` is recorded (safe), but the driver died before phase 2."""
    with pytest.raises(InjectedFault):
        sink.batch(batch_id, ids, faults=f"after_record:raise@batch={batch_id}")
    state = sink.opts.record_store().load_sink(sink.sink_id)
    return state.last_record


@pytest.fixture
def sink(tmp_path):
    s = SinkDriver(tmp_path)
    s.batch(0, list(range(0, 10)))
    s.batch(1, list(range(10, 20)))
    return s


def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


class FakeTty(io.StringIO):
    def isatty(self):
        return True


# --- open_sink ----------------------------------------------------------------------------


def test_open_sink_from_checkpoint_and_from_record_table(sink):
    h = admin.open_sink(sink.chk)
    assert h.sink_id == sink.sink_id
    assert h.record_table == os.path.join(sink.chk, "pyspark_txn", "records")
    assert h.target_uri == sink.target
    assert h.checkpoint == sink.chk
    assert h.partition_by == ()
    assert h.target().committed_batch(h.sink_id) == 1
    assert h.committer().load().snapshot_id == 1

    direct = admin.open_sink(h.record_table)
    assert (direct.sink_id, direct.target_uri, direct.checkpoint) == (
        h.sink_id,
        h.target_uri,
        sink.chk,
    )


def test_open_sink_with_several_sinks_names_them_and_skips_offset_logs(tmp_path):
    records = str(tmp_path / "shared-records")
    a = SinkDriver(tmp_path, "a", recordTable=records, sinkId="sink-a")
    b = SinkDriver(tmp_path, "b", recordTable=records, sinkId="sink-b")
    a.batch(0, [1, 2])
    b.batch(0, [3])
    a.opts.record_store().claim("source-x", ["m1", "m2"])  # an offset-log stream

    with pytest.raises(ConfigError, match="several sinks: sink-a, sink-b"):
        admin.open_sink(records)
    assert admin.open_sink(records, "sink-b").target_uri == b.target
    with pytest.raises(ConfigError, match="no sink 'source-x'"):
        admin.open_sink(records, "source-x")
    # A custom recordTable lives outside the checkpoint: sink.json says where.
    handle = admin.open_sink(a.chk)
    assert (handle.sink_id, handle.record_table) == ("sink-a", records)
    assert admin.kept_sink_id(a.chk) == "sink-a"


def test_open_sink_skips_an_offset_log_stream(tmp_path):
    records = str(tmp_path / "records")
    s = SinkDriver(tmp_path, "a", recordTable=records, sinkId="only-sink")
    s.batch(0, [1])
    s.opts.record_store().claim("source-x", ["m1"])
    assert admin.sink_streams(s.opts.record_store()) == ["only-sink"]
    assert admin.open_sink(records).sink_id == "only-sink"


def test_open_sink_refuses_a_location_without_a_record_table(tmp_path):
    with pytest.raises(ConfigError, match="no record table"):
        admin.open_sink(str(tmp_path / "nothing"))


# --- stuck and abandon ----------------------------------------------------------------------


def test_healthy_sink_has_nothing_stuck(sink):
    assert admin.stuck_snapshots(sink.handle()) == []


def test_a_last_batch_without_rows_is_not_stuck(sink, capsys):
    """A run that ended on an empty batch (an empty file, a batch of duplicates only):
    its phase 2 makes no Delta commit, so the table cannot show it, and nothing is left
    to land. status said NEEDS ATTENTION and stuck offered to abandon it (a trial)."""
    rec = sink.batch(2, [])
    assert (
        rec.txns == ()
        and rec.snapshot_id not in sink.opts.record_store().load_sink(sink.sink_id).committed
    )
    assert admin.stuck_snapshots(sink.handle()) == []
    status = admin.snapshot_status(sink.handle(), rec.snapshot_id)
    assert status.state == "committed" and "wrote no rows" in (status.refusal or "")
    code, out, _ = run_cli(capsys, "status", sink.chk)
    assert code == 0 and "healthy" in out.splitlines()[0], out
    code, out, _ = run_cli(capsys, "stuck", sink.chk)
    assert code == 0 and "pending" not in out, out
    # a batch with rows whose phase 2 did not land is still stuck, after the empty one
    pending = stuck_after_record(sink, 3, [30, 31])
    assert [s.snapshot_id for s in admin.stuck_snapshots(sink.handle())] == [pending.snapshot_id]


def test_stuck_record_is_listed_and_abandoned_then_the_batch_is_decided_anew(sink):
    rec = stuck_after_record(sink, 2, list(range(20, 30)))
    # Phase 2 can no longer succeed: one of its staged files is lost.
    os.remove(sink.path(rec.txns[0].handle))
    with pytest.raises(CorruptSnapshotError):  # a restart's recovery cannot finish it
        sink.batch(2, list(range(20, 30)), run_id="run-2")

    handle = sink.handle()
    (stuck,) = admin.stuck_snapshots(handle)
    assert stuck.record.snapshot_id == rec.snapshot_id
    assert (stuck.state, stuck.record.batch_id, stuck.record.rows) == ("pending", 2, 10)
    assert stuck.target_batch == 1 and not stuck.target_holds_batch
    assert stuck.refusal is None and stuck.to_json()["abandonable"] is True

    assert os.path.isdir(sink.staged_dir(rec))
    state = admin.abandon_snapshot(handle, rec.snapshot_id, "staged file lost")
    assert rec.snapshot_id in state.abandoned
    assert state.last_record.snapshot_id == 1  # the record is withdrawn
    assert not os.path.exists(sink.staged_dir(rec))
    assert admin.stuck_snapshots(handle) == []
    events = handle.record_store().events(sink.sink_id)
    assert events[-1].kind.value == "abandoned"
    assert events[-1].payload["reason"] == "staged file lost"
    # Idempotent: abandoning it again changes nothing.
    again = admin.abandon_snapshot(handle, rec.snapshot_id, "twice")
    assert again.next_seq == state.next_seq

    # The restart: Spark replays batch 2 under a new allocation; it is decided anew.
    new = sink.batch(2, list(range(20, 30)), run_id="run-3")
    assert new.snapshot_id > rec.snapshot_id and new.batch_id == 2
    assert sink.ids() == list(range(30))  # every row exactly once
    assert admin.stuck_snapshots(handle) == []
    assert admin.verify(handle).ok


def test_a_deleted_table_is_named_and_never_silently_started_anew(sink, capsys):
    """The table is deleted while batch 2 is stuck: stuck and abandon say the table is
    gone and what a restart does, and the sink refuses to write a new table without
    batches 0 and 1 (issue 23 item 9: it once landed batch 3 at version 0)."""
    rec = stuck_after_record(sink, 2, list(range(20, 30)))
    shutil.rmtree(sink.target)
    with pytest.raises(TargetGoneError, match="the table is gone") as e:
        sink.batch(2, list(range(20, 30)), run_id="run-2")  # a restart's recovery
    assert "batches up to 1 were committed" in str(e.value)
    assert not os.path.exists(os.path.join(sink.target, "_delta_log"))  # no new table

    code, out, _ = run_cli(capsys, "stuck", sink.chk)
    assert code == 0 and "no Delta table at" in out and "the table is gone" in out
    assert "A restart of the query refuses to write" in out
    # whether batch 2's phase 2 landed can only be read from the table: not abandonable
    assert "otherwise restarting the query finishes it" not in out
    assert "not abandonable" in out and "Restore the table where it was" in out
    code, out, _ = run_cli(capsys, "stuck", sink.chk, "--json")
    (entry,) = json.loads(out)["stuck"]
    assert "no Delta table at" in entry["target_gone"] and entry["abandonable"] is False
    code, out, err = run_cli(capsys, "abandon", sink.chk, "--snapshot", rec.snapshot_id, "--yes")
    assert code == 2 and "cannot be abandoned" in err and "Restore the table" in err
    assert "Spark replays" not in out
    with pytest.raises(TargetGoneError):  # never a silent new table
        sink.batch(3, list(range(30, 40)), run_id="run-3")
    assert not os.path.exists(sink.target)  # no new table, no staged files there


def _empty_table(path):
    write_deltalake(path, pa.Table.from_batches([], schema=SCHEMA))


def _events(sink):
    return sink.opts.record_store().events(sink.sink_id)


def test_a_table_recreated_empty_is_named_and_never_written(sink, capsys):
    """Bug E (issue 23 trial): the table is deleted and re-created empty by someone else.
    The restart used to land batches 3.. in the new table and record a false commit; it
    is refused before phase 1 and before any phase 2, and nothing is recorded."""
    sink.batch(2, list(range(20, 30)))  # batches 0-1 confirmed, 2's phase 2 done
    committer = sink.committer()  # batch 3 is planned and staged while the table is there
    sid, token = committer.allocate({"uri": sink.target})
    rows = pa.record_batch([pa.array([30], pa.int64()), pa.array(["x"])], schema=SCHEMA)
    staged = stage_partition([rows], sink.opts.staging(), sid, token, 0, SCHEMA)
    shutil.rmtree(sink.target)
    _empty_table(sink.target)
    before = len(_events(sink))

    # the running query's commit refuses: no record, no phase 2 into the new table
    meta = {"uri": sink.target, "arrow_schema": schema_to_b64(SCHEMA), "merge_schema": False}
    with pytest.raises(TargetGoneError, match="no longer holds"):
        committer.commit(3, sid, token, staged, run_id="run-1", target_meta=meta)
    assert len(_events(sink)) == before

    code, out, _ = run_cli(capsys, "status", sink.chk)
    assert code == 1 and "holds no batch of this sink" in out and "up to None" not in out
    assert "no longer holds this sink's batches up to 1" in out
    assert "will refuse to start" in out

    for run in ("run-2", "run-1"):  # a restart's recovery, and the running query
        with pytest.raises(TargetGoneError) as e:
            sink.batch(3, list(range(30, 40)), run_id=run)
        msg = str(e.value)
        assert f"the table at {sink.target} no longer holds this sink's batches up to 1" in msg
        assert "deleted or replaced" in msg and "batch 2 may have been too" in msg
    # refused at planning: no allocation, no staged files; nothing recorded, nothing written
    assert len(_events(sink)) == before
    assert not os.path.exists(os.path.join(sink.target, STAGING_ROOT))
    dt = DeltaTable(sink.target)
    assert dt.version() == 0 and dt.to_pyarrow_table().num_rows == 0
    assert dt.transaction_version(sink.sink_id) is None


def test_a_table_restored_to_an_older_version_is_refused(sink):
    """A table put back from a backup older than what the record table proves committed
    holds batches only up to 0 of 0-2: writing on would leave 1-2 out silently."""
    backup = str(sink.tmp_path / "backup")
    shutil.copytree(sink.target, backup)  # holds batches 0-1
    sink.batch(2, list(range(20, 30)))
    sink.batch(3, list(range(30, 40)))  # confirms 2
    shutil.rmtree(sink.target)
    shutil.copytree(backup, sink.target)
    with pytest.raises(TargetGoneError, match=r"batches up to 2 \(it holds batches only up to 1"):
        sink.batch(4, list(range(40, 50)), run_id="run-2")
    with pytest.raises(TxnError, match="cannot be abandoned"):
        admin.abandon_snapshot(sink.handle(), sink.handle().load().snapshot_id, "x")
    assert sink.ids() == list(range(20))


def test_a_deleted_table_restored_after_a_refused_abandon_restarts(sink, capsys):
    """Bug F (issue 23 trial): batch 2 landed (Spark's commit log says 2) but the next
    record never confirmed it, then the table was deleted. Messages used to say "up to 1",
    `abandon` withdrew batch 2, and restoring the table (as advised) then wedged every
    start with CheckpointMismatchError. Now batch 2 is named, abandon is refused, and a
    restart after the restore finishes batch 2 and goes on."""
    sink.batch(2, list(range(20, 30)))  # phase 2 done, not yet confirmed
    backup = str(sink.tmp_path / "backup")
    shutil.copytree(sink.target, backup)
    shutil.rmtree(sink.target)

    with pytest.raises(TargetGoneError) as e:
        sink.batch(3, list(range(30, 40)), run_id="run-2")
    assert "batches up to 1 were committed to it, and batch 2 may have been too" in str(e.value)
    assert not os.path.exists(sink.target)  # no txn-staged/ left at the deleted path

    handle = sink.handle()
    (stuck,) = admin.stuck_snapshots(handle)
    assert stuck.record.batch_id == 2 and stuck.refusal is not None
    assert stuck.to_json()["abandonable"] is False
    code, out, _ = run_cli(capsys, "stuck", sink.chk)
    assert "batch 2 may have been too" in out and "not abandonable" in out
    assert "otherwise restarting the query finishes it" not in out
    code, _, err = run_cli(capsys, "abandon", sink.chk, "--snapshot", stuck.snapshot_id, "--yes")
    assert code == 2 and "restore the table" in err.lower()
    with pytest.raises(TargetGoneError, match="cannot be abandoned"):
        admin.abandon_snapshot(handle, stuck.snapshot_id, "table deleted")
    assert stuck.snapshot_id not in handle.load().abandoned

    shutil.copytree(backup, sink.target)  # the restore every message advises
    sink.batch(3, list(range(30, 40)), run_id="run-3")
    assert sink.ids() == list(range(40))
    assert admin.stuck_snapshots(handle) == [] and admin.verify(handle).ok


def test_a_table_deleted_under_a_running_query_is_not_started_anew(sink):
    shutil.rmtree(sink.target)
    with pytest.raises(TargetGoneError, match="the table is gone"):
        sink.batch(2, list(range(20, 30)))  # the same run: no takeover, no recovery
    assert not os.path.exists(os.path.join(sink.target, "_delta_log"))


def test_an_attempt_for_another_path_is_refused_before_anything_is_allocated(sink):
    """A restart with another path= is refused when the batch is planned, before phase 1
    leaves markers and files in the other path (issue 23 item 16)."""
    before = sink.handle().load().next_seq
    other = str(sink.tmp_path / "other")
    with pytest.raises(ConfigError, match=r"writes to .*table-a.*but this writer writes to"):
        sink.committer().allocate({"uri": other})
    assert sink.handle().load().next_seq == before
    sink.committer().allocate({"uri": sink.target})  # its own path: allocated


def test_a_dead_attempt_is_reported_once_not_at_every_takeover(sink, caplog):
    sid, token = sink.committer().allocate()  # a killed run's attempt, files staged
    rows = pa.record_batch([pa.array([99], pa.int64()), pa.array(["x"])], schema=SCHEMA)
    stage_partition([rows], sink.opts.staging(), sid, token, 0, SCHEMA)
    with caplog.at_level("WARNING", logger="pyspark_txn"):
        for b, run in ((2, "run-2"), (3, "run-3"), (4, "run-4")):  # three takeovers
            sink.batch(b, [b * 10], run_id=run)
    said = [r for r in caplog.records if "rolling back dead staged snapshot" in r.message]
    assert [r.message.split()[-2] for r in said] == [str(sid)]
    assert 99 not in sink.ids()


def test_staged_files_lost_with_the_table_s_folder_say_so(sink):
    rec = stuck_after_record(sink, 2, list(range(20, 30)))
    shutil.rmtree(sink.target)
    with pytest.raises(CorruptSnapshotError, match="is gone .*the table is gone"):
        sink.committer().target.verify_staged(rec.snapshot_id, rec.token, rec.txns)


def test_abandon_refuses_a_committed_snapshot(sink):
    handle = sink.handle()
    before = len(handle.record_store().events(sink.sink_id))
    with pytest.raises(TxnError, match="snapshot 1 cannot be abandoned"):
        admin.abandon_snapshot(handle, 1, "oops")
    status = admin.snapshot_status(handle, 1)
    assert status.state == "committed" and "committed" in status.refusal
    assert len(handle.record_store().events(sink.sink_id)) == before
    assert sink.ids() == list(range(20))


def test_abandon_refuses_a_record_whose_batch_the_target_holds(sink):
    # Phase 2 landed but nothing in the record table says so yet (as for every last
    # record of a running query: the next record confirms it).
    with pytest.raises(InjectedFault):
        sink.batch(2, list(range(20, 30)), faults="after_phase2:raise@batch=2")
    handle = sink.handle()
    last = handle.load().last_record
    assert last.batch_id == 2 and last.snapshot_id not in handle.load().committed
    assert admin.stuck_snapshots(handle) == []
    status = admin.snapshot_status(handle, last.snapshot_id)
    assert status.state == "committed" and status.target_holds_batch
    assert "target holds batch 2" in status.refusal
    with pytest.raises(TxnError, match="holds batch 2"):
        admin.abandon_snapshot(handle, last.snapshot_id, "oops")
    assert last.snapshot_id not in handle.load().abandoned

    # A restart (Spark replays batch 2) writes the committed event.
    sink.batch(2, list(range(20, 30)), run_id="run-2")
    assert last.snapshot_id in handle.load().committed
    assert sink.ids() == list(range(30))


def test_abandon_refuses_an_older_committed_record_and_an_unknown_id(sink):
    handle = sink.handle()
    status = admin.snapshot_status(handle, 0)
    assert status.state == "committed" and status.refusal is not None
    with pytest.raises(TxnError, match="target already holds batch 1 >= 0"):
        admin.abandon_snapshot(handle, 0, "oops")
    # Even with the target dropped (it holds nothing now), a confirmed record stays committed.
    shutil.rmtree(sink.target)
    assert admin.snapshot_status(handle, 1).target_batch is None
    with pytest.raises(TxnError, match="committed snapshot can never be abandoned"):
        admin.abandon_snapshot(handle, 0, "oops")
    assert handle.load().abandoned == frozenset()
    # The last record's phase 2 is confirmed by the next record; with the target gone
    # nothing proves it landed, so it shows as pending (an operator may abandon it).
    assert admin.snapshot_status(handle, 1).state == "pending"
    assert admin.snapshot_status(handle, 99).state == "unknown"
    with pytest.raises(TxnError, match="never allocated"):
        admin.abandon_snapshot(handle, 99, "typo")


def test_abandon_an_open_allocation(sink):
    committer = sink.committer()
    sid, token = committer.allocate()
    handle = sink.handle()
    assert admin.snapshot_status(handle, sid).state == "allocated"
    state = admin.abandon_snapshot(handle, sid, "planner died")
    assert sid in state.abandoned and state.last_record.snapshot_id == 1
    assert admin.snapshot_status(handle, sid).state == "abandoned"


# --- verify -------------------------------------------------------------------------------


def test_verify_is_ok_on_a_healthy_sink_and_reports_progress(sink):
    calls = []
    report = admin.verify(sink.handle(), lambda done, total: calls.append((done, total)))
    assert report.ok and report.problems == []
    assert [s.snapshot_id for s in report.snapshots] == [0, 1]
    assert all(s.committed and s.files == 1 for s in report.snapshots)
    total = sum(s.bytes for s in report.snapshots)
    assert total > 0
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    assert all(d1 <= d2 for (d1, _), (d2, _) in zip(calls, calls[1:], strict=False))


def test_verify_reports_a_flipped_byte_and_a_missing_file(sink):
    rec0, rec1 = sink.record(0), sink.record(1)
    flipped = sink.path(rec0.txns[0].handle)
    with open(flipped, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    assert os.path.getsize(flipped) == rec0.txns[0].bytes  # same size
    os.remove(sink.path(rec1.txns[0].handle))

    report = admin.verify(sink.handle())
    assert not report.ok
    by_snapshot = {s.snapshot_id: s for s in report.snapshots}
    (p0,) = by_snapshot[0].problems
    assert (p0.severity, p0.kind, p0.handle) == ("error", "checksum", rec0.txns[0].handle)
    assert rec0.txns[0].checksum in p0.message
    (p1,) = by_snapshot[1].problems
    assert (p1.severity, p1.kind, p1.handle) == ("error", "missing", rec1.txns[0].handle)
    assert len(report.errors) == 2 and report.warnings == []


def test_verify_checks_the_staged_files_of_a_stuck_record(sink):
    rec = stuck_after_record(sink, 2, list(range(20, 30)))
    assert admin.verify(sink.handle()).ok
    with open(sink.path(rec.txns[0].handle), "ab") as f:
        f.write(b"x")
    report = admin.verify(sink.handle())
    (check,) = [s for s in report.snapshots if s.snapshot_id == rec.snapshot_id]
    assert not check.committed
    assert [p.kind for p in check.problems] == ["size"]


def test_verify_warns_about_files_a_later_delete_removed(sink):
    DeltaTable(sink.target).delete("id < 10")  # rewrites/removes batch 0's file
    report = admin.verify(sink.handle())
    assert report.ok  # warnings only
    kinds = {(sid, p.kind, p.severity) for sid, p in report.problems}
    assert kinds == {(0, "not-in-table", "warning")}
    assert "not in the current table version" in report.warnings[0][1].message


# --- the command line ------------------------------------------------------------------------


def test_cli_status_of_a_healthy_then_a_stuck_sink(sink, capsys):
    code, out, _ = run_cli(capsys, "status", sink.chk)
    assert code == 0 and f"sink {sink.sink_id}: healthy" in out
    assert "last batch 1 (snapshot 1, 10 rows)" in out
    assert "holds this sink's batches up to 1" in out

    code, out, _ = run_cli(capsys, "status", sink.chk, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["healthy"] is True and doc["stuck"] == []
    assert doc["last_batch"] == 1 and doc["target_batch"] == 1 and doc["run_id"] == "run-1"
    assert doc["record_table_events"] > 0 and doc["record_table_files"] > 0
    assert doc["lag_seconds"] >= 0 and doc["target_uri"] == sink.target

    rec = stuck_after_record(sink, 2, list(range(20, 30)))
    code, out, _ = run_cli(capsys, "status", sink.chk)
    assert code == 1 and "NEEDS ATTENTION" in out
    assert f"snapshot {rec.snapshot_id} of sink {sink.sink_id}: pending" in out
    code, out, _ = run_cli(capsys, "status", sink.chk, "--json")
    assert code == 1 and [s["batch_id"] for s in json.loads(out)["stuck"]] == [2]


def test_cli_status_after_a_failed_first_batch_and_a_killed_run(tmp_path, capsys):
    """No Python None in the text, and not a plain "healthy" while an attempt is left
    unfinished (issue 23 item 13)."""
    sink = SinkDriver(tmp_path)
    sink.committer().allocate()  # the first batch failed after its allocation
    code, out, _ = run_cli(capsys, "status", sink.chk)
    assert "None" not in out, out
    assert f"sink {sink.sink_id}: healthy, with a batch in flight or left unfinished" in out
    assert "unfinished: snapshot(s) 0 allocated and not recorded" in out
    assert "no run holds the sink yet" in out
    sink.batch(0, [1, 2])
    code, out, _ = run_cli(capsys, "status", sink.chk)
    assert code == 0 and out.splitlines()[0] == f"sink {sink.sink_id}: healthy"
    # a killed run's attempt; the ids reserved ahead with it (a lease, docs/protocol.md)
    # are no unfinished batches until something is staged under one
    sid, token = sink.committer().allocate()
    reserved = sink.committer().allocate()
    assert reserved[0] > sid and reserved[1].startswith("r")
    code, out, _ = run_cli(capsys, "status", sink.chk, "--json")
    assert json.loads(out)["open_attempts"] == [sid]
    rows = pa.record_batch([pa.array([7], pa.int64()), pa.array(["v7"])], schema=SCHEMA)
    stage_partition([rows], sink.opts.staging(), *reserved, 0, SCHEMA)
    code, out, _ = run_cli(capsys, "status", sink.chk, "--json")
    assert json.loads(out)["open_attempts"] == [sid, reserved[0]]


def test_cli_status_after_spark_aborted_the_first_batch(tmp_path, capsys):
    """Trial 23 bug C: Spark planned batch 0 and aborted its only attempt (the query
    failed): not "healthy", and no Python None anywhere in the text."""
    sink = SinkDriver(tmp_path)
    committer = sink.committer()
    sid, token = committer.allocate()
    committer.abort(sid, token)  # as Spark's abort of a failed write does
    os.makedirs(os.path.join(sink.chk, "offsets"))
    with open(os.path.join(sink.chk, "offsets", "0"), "w") as f:
        f.write("v1\n{}\n")  # Spark's offset log: batch 0 planned
    code, out, _ = run_cli(capsys, "status", sink.chk)
    assert "None" not in out, out
    assert code == 1 and out.splitlines()[0] == f"sink {sink.sink_id}: NEEDS ATTENTION", out
    assert "failed: Spark planned batch 0, but its last attempt was aborted" in out
    assert "batch 0 planned, no batch committed" in out
    code, out, _ = run_cli(capsys, "status", sink.chk, "--json")
    assert code == 1 and json.loads(out)["failed_attempt"] is True
    code, out, _ = run_cli(capsys, "records", sink.chk)
    assert "None" not in out, out
    sink.batch(0, [1, 2])  # the restarted query replays and records batch 0
    code, out, _ = run_cli(capsys, "status", sink.chk)
    assert code == 0 and out.splitlines()[0] == f"sink {sink.sink_id}: healthy", out


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("as_json", [False, True])
def test_a_full_output_is_cannot_write_output_exit_2(sink, as_json):
    """`pyspark-txn ... > /dev/full` said "the store failed: OSError" (with --json: a
    traceback, exit 1)."""
    import subprocess
    import sys

    argv = ["status", sink.chk, *(["--json"] if as_json else [])]
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "pyspark_txn", *argv],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "pyspark-txn: error: cannot write output (OSError(28, 'No space left on device'))"
    ], proc.stderr


def test_status_after_retention_still_names_the_target(tmp_path, capsys):
    driver = SinkDriver(tmp_path, "r", retainSnapshots="1")
    for b in range(80):
        driver.batch(b, [b])
    events = driver.opts.record_store().events(driver.sink_id)
    assert events[0].kind.value == "summary"
    status = admin.sink_status(admin.open_sink(driver.chk))
    assert status.target_uri == driver.target and status.healthy
    assert status.last_record.batch_id == 79 and status.target_batch == 79
    assert status.record_events == len(events) < 80


def test_cli_stuck_text_and_json(sink, capsys):
    code, out, _ = run_cli(capsys, "stuck", sink.chk)
    assert code == 0 and "no stuck snapshots" in out

    rec = stuck_after_record(sink, 2, list(range(20, 30)))
    code, out, _ = run_cli(capsys, "stuck", sink.chk)
    assert code == 0
    assert f"snapshot {rec.snapshot_id}" in out and "batch 2, 10 rows in 1 files" in out
    assert f"abandon {sink.chk} --snapshot {rec.snapshot_id}" in out

    code, out, _ = run_cli(capsys, "stuck", sink.chk, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["sink_id"] == sink.sink_id and doc["target_uri"] == sink.target
    (entry,) = doc["stuck"]
    assert entry["snapshot_id"] == rec.snapshot_id and entry["batch_id"] == 2
    assert entry["rows"] == 10 and entry["files"] == 1 and entry["target_batch"] == 1
    assert entry["abandonable"] is True and entry["created_at"]


def test_cli_abandon_without_yes_and_without_a_tty_refuses(sink, capsys, monkeypatch):
    rec = stuck_after_record(sink, 2, list(range(20, 30)))
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))
    code, _, err = run_cli(capsys, "abandon", sink.chk, "--snapshot", rec.snapshot_id)
    assert code == 2 and "--yes" in err and "not a terminal" in err
    assert rec.snapshot_id not in sink.handle().load().abandoned
    assert os.path.isdir(sink.staged_dir(rec))


def test_cli_abandon_asks_and_respects_the_answer(sink, capsys, monkeypatch):
    rec = stuck_after_record(sink, 2, list(range(20, 30)))
    monkeypatch.setattr("sys.stdin", FakeTty("n\n"))
    code, out, _ = run_cli(capsys, "abandon", sink.chk, "--snapshot", rec.snapshot_id)
    assert code == 1 and "not abandoned" in out
    assert rec.snapshot_id not in sink.handle().load().abandoned

    monkeypatch.setattr("sys.stdin", FakeTty("y\n"))
    code, out, _ = run_cli(
        capsys, "abandon", sink.chk, "--snapshot", rec.snapshot_id, "--reason", "target dropped"
    )
    assert code == 0 and "is abandoned" in out and "Restart the query" in out
    state = sink.handle().load()
    assert rec.snapshot_id in state.abandoned
    assert sink.handle().record_store().events(sink.sink_id)[-1].payload["reason"] == (
        "target dropped"
    )


def test_cli_abandon_yes_exit_codes(sink, capsys):
    rec = stuck_after_record(sink, 2, list(range(20, 30)))
    code, _, err = run_cli(capsys, "abandon", sink.chk, "--snapshot", 1, "--yes")
    assert code == 2 and "committed" in err
    code, out, _ = run_cli(capsys, "abandon", sink.chk, "--snapshot", rec.snapshot_id, "--yes")
    assert code == 0 and "is abandoned" in out
    assert not os.path.exists(sink.staged_dir(rec))
    code, out, _ = run_cli(capsys, "abandon", sink.chk, "--snapshot", rec.snapshot_id, "--yes")
    assert code == 0 and "already abandoned" in out


def test_cli_verify_exit_codes_and_json(sink, capsys):
    code, out, err = run_cli(capsys, "verify", sink.chk)
    assert code == 0 and "OK" in out and "2 live snapshot records, 2 files" in out
    assert err == ""  # no progress bar when stderr is not a terminal
    code, out, _ = run_cli(capsys, "verify", sink.chk, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"] is True and len(doc["snapshots"]) == 2

    missing = sink.record(1).txns[0].handle
    os.remove(sink.path(missing))
    code, out, _ = run_cli(capsys, "verify", sink.chk)
    assert code == 1 and f"error: snapshot 1: {missing}: file is missing" in out
    code, out, _ = run_cli(capsys, "verify", sink.chk, "--json")
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False
    (bad,) = [s for s in doc["snapshots"] if not s["ok"]]
    assert bad["snapshot_id"] == 1 and bad["problems"][0]["kind"] == "missing"


def test_cli_several_sinks_need_sink_option(tmp_path, capsys):
    records = str(tmp_path / "shared")
    SinkDriver(tmp_path, "a", recordTable=records, sinkId="sink-a").batch(0, [1])
    SinkDriver(tmp_path, "b", recordTable=records, sinkId="sink-b").batch(0, [2])
    code, _, err = run_cli(capsys, "verify", records)
    assert code == 2 and "sink-a, sink-b" in err
    code, out, _ = run_cli(capsys, "verify", records, "--sink", "sink-b")
    assert code == 0 and "sink sink-b" in out


def test_cli_records_of_a_checkpoint_shows_its_own_sink_of_a_shared_record_table(tmp_path, capsys):
    """Two queries share one recordTable: `records <checkpoint>` shows that checkpoint's
    sink only (a trial saw the other query's sink first); the table itself lists both."""
    records = str(tmp_path / "shared")
    a = SinkDriver(tmp_path, "a", recordTable=records, sinkId="sink-a")
    a.batch(0, [1])
    SinkDriver(tmp_path, "b", recordTable=records, sinkId="sink-b").batch(0, [2])
    code, out, _ = run_cli(capsys, "records", a.chk)
    sinks = [line for line in out.splitlines() if line.startswith("sink ")]
    assert code == 0 and sinks == ["sink sink-a"]
    code, out, _ = run_cli(capsys, "records", records)
    sinks = [line for line in out.splitlines() if line.startswith("sink ")]
    assert code == 0 and sinks == ["sink sink-a", "sink sink-b"]


def test_cli_records_still_works(sink, capsys):
    rec = stuck_after_record(sink, 2, list(range(20, 30)))
    admin.abandon_snapshot(sink.handle(), rec.snapshot_id, "test")
    code, out, _ = run_cli(capsys, "records", sink.chk)
    assert code == 0 and f"sink {sink.sink_id}" in out
    assert "last recorded batch: 1; phase 2 confirmed in the record table through batch 1" in out
    assert "reason: test" in out
    # batch 0's allocation reserved 2 ids (a lease), the next one 4 (docs/protocol.md)
    assert "reserves snapshots 0-1 (a planner's lease)" in out
    assert "reserves snapshots 2-5 (a planner's lease)" in out


def test_cli_database_options_are_for_postgres_sinks_and_records_names_the_target(sink, capsys):
    code, _, err = run_cli(capsys, "status", sink.chk, "--url", "postgresql://u@db/x")
    assert code == 2 and "--url and --password-file apply to txn-postgres sinks" in err
    code, out, _ = run_cli(capsys, "records", sink.chk)
    assert code == 0 and f"target: Delta table {sink.target}" in out
    assert admin.open_sink(sink.chk).kind == admin.DELTA


@pytest.mark.parametrize(
    "command, expected",
    [("stuck", "--json"), ("abandon", "--snapshot"), ("verify", "--json"), ("records", "--sink")],
)
def test_cli_help_on_each_command(capsys, command, expected):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert f"pyspark-txn {command}" in out and expected in out


def test_staging_root_is_where_abandon_deletes(sink):
    # abandon deletes <table>/txn-staged/<sink>/<id>-<token>/ and nothing else there
    rec = stuck_after_record(sink, 2, list(range(20, 30)))
    root = os.path.join(sink.target, STAGING_ROOT, sink.sink_id)
    before = set(os.listdir(root))
    admin.abandon_snapshot(sink.handle(), rec.snapshot_id, "test")
    assert before - set(os.listdir(root)) == {os.path.basename(sink.staged_dir(rec))}
    assert sink.ids() == list(range(20))


def test_demo_never_deletes_a_directory_it_did_not_make(tmp_path, capsys):
    (tmp_path / "precious.txt").write_text("keep me")
    assert cli.main(["demo", "--dir", str(tmp_path)]) == 2
    assert (tmp_path / "precious.txt").read_text() == "keep me"
    assert "not made by the demo" in capsys.readouterr().err


def test_a_copied_checkpoint_is_read_from_its_own_record_table(tmp_path):
    """The copy's tools must never act on the original query's (possibly live) history."""
    original = SinkDriver(tmp_path, "a")
    original.batch(0, [1])
    shutil.copytree(original.chk, tmp_path / "chk-copy")
    copy_opts = DeltaSinkOptions.parse(
        {"path": original.target, "checkpointLocation": str(tmp_path / "chk-copy")}
    ).with_checkpoint_sink_id()
    assert copy_opts.sink_id == original.sink_id
    copy = admin.open_sink(str(tmp_path / "chk-copy"))
    assert copy.record_table == str(tmp_path / "chk-copy" / "pyspark_txn" / "records")
    assert admin.open_sink(original.chk).record_table.startswith(original.chk)


def test_a_delta_table_that_is_not_a_record_table_is_named(tmp_path, capsys):
    driver = SinkDriver(tmp_path, "a")
    driver.batch(0, [1])
    for command in ("records", "stuck"):
        assert cli.main([command, driver.target]) == 2
        assert "not a pyspark-txn record table" in capsys.readouterr().err


def test_verify_fails_when_the_target_was_recreated_and_lost_committed_data(tmp_path):
    driver = SinkDriver(tmp_path, "a")
    driver.batch(0, [1, 2])
    driver.batch(1, [3])
    shutil.rmtree(driver.target)
    write_deltalake(driver.target, pa.table({"id": [9], "v": ["new"]}, schema=SCHEMA))
    report = admin.verify(admin.open_sink(driver.chk))
    assert not report.ok
    assert any("re-created or restored" in p.message for _, p in report.errors)


def test_status_needs_attention_when_the_target_is_ahead_of_the_records(sink, capsys):
    # another writer with this sink id (or a switch from light mode) moved the target on
    from deltalake.transaction import CommitProperties, Transaction

    write_deltalake(
        sink.target,
        pa.table({"id": [99], "v": ["x"]}, schema=SCHEMA),
        mode="append",
        commit_properties=CommitProperties(
            app_transactions=[Transaction(app_id=sink.sink_id, version=5)]
        ),
    )
    code, out, _ = run_cli(capsys, "status", sink.chk)
    assert code == 1 and "NEEDS ATTENTION" in out
    assert "holds batch 5 of this sink but the record table ends at batch 1" in out


def test_cli_errors_are_json_too_and_light_checkpoints_are_named(tmp_path, capsys):
    code, out, err = run_cli(capsys, "status", tmp_path / "nowhere", "--json")
    assert code == 2 and "no record table" in err
    assert json.loads(out)["type"] == "ConfigError"
    code, _, err = run_cli(capsys, "status", "")
    assert code == 2 and "location is empty" in err
    light = DeltaSinkOptions.parse(
        {"path": str(tmp_path / "t"), "checkpointLocation": str(tmp_path / "lc"), "mode": "light"}
    ).with_checkpoint_sink_id()
    code, _, err = run_cli(capsys, "records", light.checkpoint_location)
    assert code == 2 and "runs with mode=light" in err
    with pytest.raises(ConfigError, match="ran with mode=light"):
        DeltaSinkOptions.parse(
            {"path": str(tmp_path / "t"), "checkpointLocation": str(tmp_path / "lc")}
        ).with_checkpoint_sink_id()


def test_locations_delta_rs_cannot_read_are_refused_by_name():
    for bad, option in (("/tmp/x[1]/t", "path"), ("/tmp/p%20q/c", "checkpointLocation")):
        opts = {"path": "/tmp/t", "checkpointLocation": "/tmp/c", option: bad}
        with pytest.raises(ConfigError, match=f"option {option}="):
            DeltaSinkOptions.parse(opts)
    assert (
        DeltaSinkOptions.parse(
            {"path": "/tmp/t", "checkpointLocation": "/tmp/c", "logLevel": "warn"}
        ).log_level
        == "WARNING"
    )


# --- the stream's schema against an existing table ----------------------------------------


@pytest.mark.parametrize("nullable", [True, False])
def test_a_column_of_the_table_missing_from_the_stream(tmp_path, nullable):
    """As Spark's Delta sink: a nullable column the stream lacks is null in its rows; a
    NOT NULL one is refused before anything is written (issue 23 item 14)."""
    sink = SinkDriver(tmp_path)
    wide = pa.schema([*SCHEMA, pa.field("extra", pa.int32(), nullable=nullable)])
    write_deltalake(
        sink.target,
        pa.table({"id": [-1], "v": ["old"], "extra": pa.array([7], pa.int32())}, schema=wide),
    )
    if not nullable:
        with pytest.raises(ConfigError, match="'extra' of the table is NOT NULL and missing"):
            sink.batch(0, [1, 2])
        assert DeltaTable(sink.target).version() == 0
        return
    sink.batch(0, [1, 2])
    got = DeltaTable(sink.target).to_pyarrow_table().sort_by("id").to_pylist()
    assert got == [
        {"id": -1, "v": "old", "extra": 7},
        {"id": 1, "v": "v1", "extra": None},
        {"id": 2, "v": "v2", "extra": None},
    ]
    assert [f.name for f in pa.schema(DeltaTable(sink.target).schema().to_arrow())] == [
        "id",
        "v",
        "extra",
    ]
    assert admin.verify(sink.handle()).ok
