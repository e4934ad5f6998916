"""A commit's cost must not grow with the table's history (issue 22, item 4).

The target gets a Delta checkpoint every ``delta.checkpointInterval`` versions
(Delta's default 10), readers get the same table from the checkpoint as from
the commits, and the driver's cached tables on an object store (moto's S3
server on loopback) catch up incrementally but are never mixed with a table
re-created under the same URI.
"""

from __future__ import annotations

import json
import os
import shutil

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from pyspark_txn.sinks.delta import DeltaSinkOptions
from pyspark_txn.sinks.delta_target import schema_to_b64
from pyspark_txn.sinks.staging import stage_partition
from pyspark_txn.state import SnapshotKind, SnapshotRecord, new_token
from pyspark_txn.storage.delta_tables import open_table

SINK = "sink-ckpt"
SCHEMA = pa.schema([pa.field("id", pa.int64())])


def _sink(tmp_path, **options):
    uri = str(tmp_path / "table")
    opts = DeltaSinkOptions.parse(
        {"path": uri, "checkpointLocation": "/unused", "sinkId": SINK, **options}
    )
    return uri, opts.staging(), opts.target()


def _commit_batches(staging, target, batches, mode):
    for b in batches:
        tok = new_token()
        batch = pa.record_batch([pa.array([b], pa.int64())], schema=SCHEMA)
        txns = stage_partition([batch], staging, b, tok, 0, SCHEMA)
        meta = {"arrow_schema": schema_to_b64(SCHEMA), **target.base()}
        if mode == "light":
            target.commit_batch(b, txns, None, meta)
            continue
        rec = SnapshotRecord(
            sink_id=SINK,
            snapshot_id=b,
            batch_id=b,
            epoch=1,
            kind=SnapshotKind.AUTOMATIC,
            txns=tuple(txns),
            target=meta,
            token=tok,
        )
        target.commit(rec)


def _checkpoints(uri):
    log_dir = os.path.join(uri, "_delta_log")
    return sorted(int(name.split(".")[0]) for name in os.listdir(log_dir) if ".checkpoint." in name)


def _from_checkpoint_only(uri, dest):
    """A copy of the table whose log starts at its last checkpoint: what a reader sees
    once older commits are cleaned up."""
    shutil.copytree(uri, dest)
    with open(os.path.join(dest, "_delta_log", "_last_checkpoint")) as f:
        last = json.load(f)["version"]
    for name in os.listdir(os.path.join(dest, "_delta_log")):
        if name.endswith(".json") and int(name.split(".")[0]) <= last:
            os.remove(os.path.join(dest, "_delta_log", name))
    return last


@pytest.mark.parametrize(
    ("options", "mode", "expected"),
    [
        ({}, "snapshots", [10, 20]),
        ({"delta.checkpointInterval": "4"}, "light", [4, 8, 12, 16, 20, 24]),
    ],
    ids=["default-10", "interval-4-light"],
)
def test_the_target_gets_a_checkpoint_every_interval(tmp_path, options, mode, expected):
    uri, staging, target = _sink(tmp_path, **options)
    _commit_batches(staging, target, range(25), mode)
    assert _checkpoints(uri) == expected
    with open(os.path.join(uri, "_delta_log", "_last_checkpoint")) as f:
        assert json.load(f)["version"] == expected[-1]
    # Readers get every row and the sink's app transaction from the checkpoint alone.
    for where in (uri, str(tmp_path / "copy")):
        if where != uri:
            assert _from_checkpoint_only(uri, where) == expected[-1]
        dt = DeltaTable(where)
        assert dt.version() == 24
        assert dt.transaction_version(SINK) == 24
        assert sorted(dt.to_pyarrow_table().column("id").to_pylist()) == list(range(25))
    # ... and the sink's replay of a committed batch is still a no-op there.
    _, staging2, target2 = _sink(tmp_path, **options)
    target2.uri = str(tmp_path / "copy")
    assert target2.committed_batch(SINK) == 24


def test_a_table_that_says_no_log_cleanup_keeps_its_log(tmp_path):
    uri, staging, target = _sink(
        tmp_path,
        **{
            "delta.checkpointInterval": "2",
            "delta.logRetentionDuration": "interval 0 seconds",
            "delta.enableExpiredLogCleanup": "false",
        },
    )
    _commit_batches(staging, target, range(7), "light")
    assert _checkpoints(uri) == [2, 4, 6]
    commits = [n for n in os.listdir(os.path.join(uri, "_delta_log")) if n.endswith(".json")]
    assert len(commits) == 7


def test_expired_log_entries_go_as_the_tables_retention_says(tmp_path):
    uri, staging, target = _sink(
        tmp_path,
        **{"delta.checkpointInterval": "2", "delta.logRetentionDuration": "interval 0 seconds"},
    )
    _commit_batches(staging, target, range(7), "light")
    commits = sorted(
        int(n.split(".")[0])
        for n in os.listdir(os.path.join(uri, "_delta_log"))
        if n.endswith(".json")
    )
    assert commits[0] > 0 and commits[-1] == 6
    dt = DeltaTable(uri)
    assert dt.transaction_version(SINK) == 6
    assert sorted(dt.to_pyarrow_table().column("id").to_pylist()) == list(range(7))


# --- the driver's cache on an object store ------------------------------------------------


def test_a_local_table_is_caught_up_only_when_it_has_a_new_commit(tmp_path):
    """On a local disk a cached table is not caught up (delta-rs would list the whole
    _delta_log folder) unless the next commit file exists; then it is."""
    uri = str(tmp_path / "t")
    write_deltalake(uri, pa.table({"a": [1]}))
    first = open_table(uri)
    assert open_table(uri) is first and first.version() == 0
    write_deltalake(uri, pa.table({"a": [2]}), mode="append")
    write_deltalake(uri, pa.table({"a": [3]}), mode="append")
    again = open_table(uri)
    assert again is first and again.version() == 2
    assert sorted(pa.table(again.to_pyarrow_table())["a"].to_pylist()) == [1, 2, 3]
    shutil.rmtree(uri)  # re-created with as many commits: not mixed with the cached one
    for i in range(3):
        write_deltalake(uri, pa.table({"b": [f"x{i}"]}), mode="append")
    dt = open_table(uri)
    assert pa.schema(dt.schema().to_arrow()).names == ["b"] and dt.version() == 2


def test_a_remote_table_is_cached_and_caught_up(s3):
    options = s3.options
    uri = "s3://cost/cached"
    write_deltalake(uri, pa.table({"a": [1]}), storage_options=options)
    first = open_table(uri, options)
    write_deltalake(uri, pa.table({"a": [2]}), storage_options=options, mode="append")
    again = open_table(uri, options)
    assert again is first and again.version() == 1
    assert sorted(pa.table(again.to_pyarrow_table())["a"].to_pylist()) == [1, 2]


@pytest.mark.parametrize("new_count", [1, 2, 4], ids=["fewer", "same", "more"])
def test_a_remote_table_recreated_under_the_same_uri_is_not_mixed(s3, new_count):
    options, delete = s3.options, s3.delete
    uri = f"s3://cost/recreated-{new_count}"
    write_deltalake(uri, pa.table({"a": [1]}), storage_options=options)
    write_deltalake(uri, pa.table({"a": [2]}), storage_options=options, mode="append")
    assert open_table(uri, options).version() == 1
    delete(uri[len("s3://cost/") :])
    for i in range(new_count):
        write_deltalake(uri, pa.table({"b": [f"x{i}"]}), storage_options=options, mode="append")
    dt = open_table(uri, options)
    assert dt.version() == new_count - 1
    assert pa.schema(dt.schema().to_arrow()).names == ["b"]
    assert sorted(pa.table(dt.to_pyarrow_table())["b"].to_pylist()) == [
        f"x{i}" for i in range(new_count)
    ]


def test_a_remote_record_table_gets_a_checkpoint_with_each_compaction(s3, tmp_path):
    """Compaction comes every 32 versions, and a checkpoint with it (more often, every
    process that keeps the table open reads each checkpoint again). Readers get every
    event from the checkpoint alone."""
    from support import allocated_event

    from pyspark_txn.state import DeltaEventLog

    uri = "s3://cost/records-ckpt"
    log = DeltaEventLog(uri, s3.options)
    for seq in range(40):
        log.append(allocated_event(seq, query_id="q"))
    bucket = s3.bucket
    local = tmp_path / "records"
    for obj in bucket.objects.filter(Prefix="records-ckpt/"):
        dest = local / obj.key[len("records-ckpt/") :]
        dest.parent.mkdir(parents=True, exist_ok=True)
        bucket.download_file(obj.key, str(dest))
    assert _checkpoints(str(local)) == [33]  # the compaction's own commit is 33
    copy = str(tmp_path / "copy")
    assert _from_checkpoint_only(str(local), copy) == 33
    assert DeltaTable(copy).transaction_version("s") == 39
    assert [e.seq for e in DeltaEventLog(copy).read("s")] == list(range(40))


def test_an_append_after_a_read_takes_its_seq_from_the_read(tmp_path, monkeypatch):
    """delta-rs finds an app transaction's version by replaying the log since the
    checkpoint at every call (on S3 a GET of each commit): an append right after the
    read that made its event knows the stream's last seq from the events read."""
    from support import allocated_event

    from pyspark_txn.state import AppendRejected, DeltaEventLog

    log = DeltaEventLog(str(tmp_path / "records"))
    for seq in range(3):
        log.append(allocated_event(seq))
    asked = _count_replays(monkeypatch)
    assert [e.seq for e in log.read("s")] == [0, 1, 2]
    log.append(allocated_event(3))
    log.append(allocated_event(4))  # after our own append: the cache has it too
    with pytest.raises(AppendRejected):
        log.append(allocated_event(4))  # a taken seq is still refused
    assert asked == []
    log.append(allocated_event(0, stream="new"))  # a stream with no events: delta-rs says
    assert asked == ["new"]
    assert [e.seq for e in log.read("s")] == [0, 1, 2, 3, 4]


def _count_replays(monkeypatch) -> list[str]:
    """The app ids delta-rs's ``transaction_version`` (a replay of the log since the
    checkpoint) is asked for from now on."""
    asked: list[str] = []
    replay = DeltaTable.transaction_version
    monkeypatch.setattr(
        DeltaTable, "transaction_version", lambda self, app: asked.append(app) or replay(self, app)
    )
    return asked


def test_phase_two_reads_the_sinks_txn_from_new_commits_not_a_log_replay(tmp_path, monkeypatch):
    """Phase 2 reads the sink's app transaction (is the batch there?) and then commits
    it. Asked of the same table object at the same version, or after our own commit
    was the only one, the answer is known; after someone else's commits it is read
    from those commit files (one GET each), not from delta-rs's replay of the log since
    the checkpoint, and the version phase 2 reports is still the one carrying the
    batch."""
    uri, staging, target = _sink(tmp_path)
    _commit_batches(staging, target, [0, 1], "snapshots")  # created, then appended to
    asked = _count_replays(monkeypatch)
    _commit_batches(staging, target, [2, 3], "snapshots")
    assert target.committed_batch(SINK) == 3
    assert asked == []
    write_deltalake(uri, pa.table({"id": pa.array([99], pa.int64())}), mode="append")  # foreign
    assert target.committed_batch(SINK) == 3 and asked == []
    history = {h["version"]: h for h in DeltaTable(uri).history()}
    assert history[3]["pyspark_txn.batch_id"] == 3  # versions 1..3 are batches 1..3


def _foreign_txn(uri, app_id, version):
    """A commit by another writer that carries an app transaction (as Spark's Delta
    sink or another delta-rs writer would)."""
    from deltalake.transaction import CommitProperties, Transaction

    write_deltalake(
        uri,
        pa.table({"id": pa.array([version], pa.int64())}),
        mode="append",
        commit_properties=CommitProperties(
            app_transactions=[Transaction(app_id=app_id, version=version)]
        ),
    )


def test_the_sinks_txn_in_a_foreign_commit_is_seen_without_a_replay(tmp_path, monkeypatch):
    uri, staging, target = _sink(tmp_path)
    _commit_batches(staging, target, [0, 1], "snapshots")
    assert target.committed_batch(SINK) == 1
    asked = _count_replays(monkeypatch)
    _foreign_txn(uri, "someone-else", 4)
    _foreign_txn(uri, SINK, 7)  # the same app id written by another writer: it counts
    _foreign_txn(uri, "someone-else", 5)
    assert target.committed_batch(SINK) == 7 and asked == []
    assert DeltaTable(uri).transaction_version(SINK) == 7  # what delta-rs would say


def test_unreadable_or_many_new_commits_are_left_to_delta_rs(tmp_path, monkeypatch):
    from pyspark_txn.sinks.delta_target import APP_VERSION_CATCH_UP

    uri, staging, target = _sink(tmp_path)
    _commit_batches(staging, target, [0, 1], "snapshots")
    assert target.committed_batch(SINK) == 1
    asked = _count_replays(monkeypatch)
    for i in range(APP_VERSION_CATCH_UP + 1):
        _foreign_txn(uri, "someone-else", i)
    _foreign_txn(uri, SINK, 9)
    assert target.committed_batch(SINK) == 9 and asked == [SINK]
    monkeypatch.setattr("pyspark_txn.sinks.delta_commit.read_commit_actions", lambda *a, **k: None)
    _foreign_txn(uri, SINK, 10)
    assert target.committed_batch(SINK) == 10 and asked == [SINK, SINK]


def _operations(uri, options=None):
    return [
        h.get("operation") for h in reversed(DeltaTable(uri, storage_options=options).history())
    ]


def test_compacted_files_are_deleted_directly_and_vacuumed_every_eighth_time(tmp_path, monkeypatch):
    """Compaction deletes the files its commit removed (one GET of that commit) instead
    of running delta-rs' vacuum, which re-read the log and wrote two commits (47 requests
    on S3). Every VACUUM_EVERY compactions a vacuum still runs: it deletes what a
    compaction removed but did not get to delete (here: its delete failed)."""
    from support import allocated_event

    from pyspark_txn.state import DeltaEventLog
    from pyspark_txn.state.backends import delta_log
    from pyspark_txn.storage import fs as _fs

    uri = tmp_path / "records"
    log = DeltaEventLog(str(uri), compact_every=4)

    def on_disk():
        return sorted(p.name for p in uri.glob("*.parquet"))

    def listed():
        return sorted(u.rsplit("/", 1)[1] for u in DeltaTable(str(uri)).file_uris())

    def failing_delete(fs, paths):
        raise OSError("the store went away")

    log.append(allocated_event(0))
    seq = 1
    left: list[str] = []
    while DeltaTable(str(uri)).version() < 4 * delta_log.VACUUM_EVERY - 1:
        compacted_before = _operations(str(uri)).count("OPTIMIZE")
        if compacted_before == 2:  # the third compaction cannot delete its files
            monkeypatch.setattr(_fs, "delete_files", failing_delete)
        log.append(allocated_event(seq))
        seq += 1
        monkeypatch.undo()
        if _operations(str(uri)).count("OPTIMIZE") > compacted_before:
            if compacted_before == 2:
                left = sorted(set(on_disk()) - set(listed()))
                assert len(left) == 4
            assert sorted(set(on_disk()) - set(listed())) == left  # the others: deleted
    ops = _operations(str(uri))
    assert ops.count("OPTIMIZE") == delta_log.VACUUM_EVERY - 1 and "VACUUM START" not in ops
    while "VACUUM END" not in _operations(str(uri)):
        log.append(allocated_event(seq))
        seq += 1
    assert on_disk() == listed()
    assert [e.seq for e in DeltaEventLog(str(uri)).read("s")] == list(range(seq))


def test_a_remote_record_table_deletes_what_its_compaction_removed(s3):
    from support import allocated_event

    from pyspark_txn.state import DeltaEventLog

    uri = "s3://cost/records-upkeep"
    log = DeltaEventLog(uri, s3.options, compact_every=4)
    for seq in range(10):
        log.append(allocated_event(seq))
    keys = {o.key for o in s3.bucket.objects.filter(Prefix="records-upkeep/")}
    data = {k.rsplit("/", 1)[1] for k in keys if k.endswith(".parquet") and "_delta_log" not in k}
    table = DeltaTable(uri, storage_options=s3.options)
    assert data == {u.rsplit("/", 1)[1] for u in table.file_uris()}
    assert len(data) < 10  # compacted, and the compacted files deleted
    assert [e.seq for e in DeltaEventLog(uri, s3.options).read("s")] == list(range(10))


def test_summarized_events_deleted_take_their_old_files_with_them(tmp_path):
    """Truncating a stream rewrites the files that held its old events; those are
    deleted at once, not left to a vacuum that comes every 8th compaction only."""
    from support import allocated_event

    from pyspark_txn.state import DeltaEventLog

    uri = tmp_path / "records"
    log = DeltaEventLog(str(uri), compact_every=4)
    for seq in range(6):
        log.append(allocated_event(seq))
    log.append(allocated_event(0, stream="other"))
    log.truncate("s", 5)
    assert "DELETE" in _operations(str(uri))
    on_disk = sorted(p.name for p in uri.glob("*.parquet"))
    assert on_disk == sorted(u.rsplit("/", 1)[1] for u in DeltaTable(str(uri)).file_uris())
    assert [e.seq for e in DeltaEventLog(str(uri)).read("s")] == [5]
    assert [e.seq for e in DeltaEventLog(str(uri)).read("other")] == [0]
