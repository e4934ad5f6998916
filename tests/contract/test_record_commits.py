"""The record table's appends and catch-up written by this package (record_commits):
what delta-rs reads of them, races between processes and with the compaction, a table
deleted and created again, a lost answer, and tables it leaves to delta-rs."""

import json
import multiprocessing as mp
import os
import shutil

import pytest
from deltalake import DeltaTable
from support import allocated_event as ev

from pyspark_txn.state import DeltaEventLog, RecordStore
from pyspark_txn.state.backends import delta_log
from pyspark_txn.state.backends.record_commits import apply_actions
from pyspark_txn.state.events import events_to_arrow
from pyspark_txn.storage import fs as _fs


def _commit(uri: str, version: int) -> list[dict]:
    with open(os.path.join(uri, "_delta_log", f"{version:020d}.json")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _writer(uri: str, version: int) -> str:
    info = next(a["commitInfo"] for a in _commit(uri, version) if "commitInfo" in a)
    return str(info.get("clientVersion", ""))


def _log_of(tmp_path, count: int) -> tuple[str, DeltaEventLog]:
    """A record table with ``count`` events of stream ``s``, then one of ``other``."""
    uri = str(tmp_path / "records")
    log = DeltaEventLog(uri, compact_every=0)
    for seq in range(count):
        log.append(ev(seq))
    log.append(ev(0, stream="other"))
    return uri, log


def test_delta_rs_reads_the_commits_written_here(tmp_path):
    uri, _ = _log_of(tmp_path, 5)
    dt = DeltaTable(uri)
    assert dt.version() == 6
    assert all(_writer(uri, v) == "pyspark-txn" for v in range(1, 7))
    assert dt.transaction_version("s") == 4 and dt.transaction_version("other") == 0
    rows = dt.to_pyarrow_dataset().to_table(use_threads=False).to_pylist()
    assert sorted((r["stream"], r["seq"]) for r in rows) == [("other", 0)] + [
        ("s", i) for i in range(5)
    ]
    add = next(a["add"] for a in _commit(uri, 3) if "add" in a)
    assert json.loads(add["stats"])["numRecords"] == 1
    history = dt.history()
    assert [h["operation"] for h in history[:6]] == ["WRITE"] * 6
    # delta-rs's own operations on top of them: a delete that skips files by stats
    dt.delete("stream = 's' AND seq < 2")
    assert [e.seq for e in DeltaEventLog(uri).read("s")] == [2, 3, 4]


def test_a_compaction_and_a_delete_by_delta_rs_are_followed(tmp_path):
    uri = str(tmp_path / "records")
    log = DeltaEventLog(uri, compact_every=4)
    for seq in range(11):  # compactions at versions 4 and 8 (then 9, 10 by delta-rs)
        log.append(ev(seq))
    assert [e.seq for e in log.read("s")] == list(range(11))
    assert any(
        "remove" in a for v in range(DeltaTable(uri).version() + 1) for a in _safe_commit(uri, v)
    )
    log.truncate("s", 6)
    assert [e.seq for e in log.read("s")] == list(range(6, 11))
    log.append(ev(11))
    assert [e.seq for e in DeltaEventLog(uri).read("s")] == list(range(6, 12))
    assert DeltaTable(uri).transaction_version("s") == 11


def _safe_commit(uri, v):
    try:
        return _commit(uri, v)
    except FileNotFoundError:
        return []


def _compact(uri: str) -> None:
    """Another process compacts the table now."""
    DeltaEventLog(uri, compact_every=1)._maintain(1)


def _appender(uri: str, stream: str, count: int, compact_every: int, done) -> None:
    try:
        store = RecordStore(DeltaEventLog(uri, compact_every=compact_every), backoff_s=0.01)
        for seq in range(count):
            store.safe_append(ev(seq, stream=stream))
        done.put((stream, "ok"))
    except Exception as e:  # reported, and the assertion below fails on it
        done.put((stream, repr(e)))


def test_processes_appending_at_once_with_compactions_between(tmp_path):
    """Three processes append to their own streams at once while the compaction (every 4
    versions, by whichever appender lands there) rewrites and deletes the files the
    others are reading: every event lands once, in order, and delta-rs agrees."""
    uri = str(tmp_path / "records")
    DeltaEventLog(uri).create_if_missing()
    ctx = mp.get_context("spawn")
    done = ctx.Queue()
    streams = ["a", "b", "c"]
    workers = [ctx.Process(target=_appender, args=(uri, s, 25, 4, done)) for s in streams]
    for w in workers:
        w.start()
    for w in workers:
        w.join(300)
    outcome = dict(done.get(timeout=5) for _ in workers)
    assert outcome == dict.fromkeys(streams, "ok"), outcome
    fresh = DeltaEventLog(uri)
    for s in streams:
        assert [e.seq for e in fresh.read(s)] == list(range(25))
        assert DeltaTable(uri).transaction_version(s) == 24
    rows = DeltaTable(uri).to_pyarrow_dataset().to_table(use_threads=False)
    assert rows.num_rows == 75  # delta-rs's optimize in two processes at once doubled some
    # compactions landed between the appends, and none removed a file already gone
    live: set[str] = set()
    compactions = 0
    for v in range(DeltaTable(uri).version() + 1):
        actions = _safe_commit(uri, v)
        removed = [a["remove"]["path"] for a in actions if "remove" in a]
        assert set(removed) <= live, f"commit {v} removes files no longer in the table"
        compactions += bool(removed)
        live -= set(removed)
        live |= {a["add"]["path"] for a in actions if "add" in a}
    assert compactions >= 5


def test_a_table_deleted_and_created_again_is_not_mixed_with_the_old(tmp_path):
    uri = str(tmp_path / "records")
    log = DeltaEventLog(uri, compact_every=0)
    for seq in range(4):
        log.append(ev(seq))
    shutil.rmtree(uri)  # another process deletes the table and starts over
    DeltaTable.create(
        uri,
        DeltaTable  # noqa: E501 - the schema of the record table
        and __import__("pyspark_txn.state.events", fromlist=["x"]).arrow_schema(),
    )
    log.append(ev(0, stream="new"))
    log.append(ev(1, stream="new"))
    dt = DeltaTable(uri)
    assert dt.version() == 2  # no commit 5 after a gap
    assert sorted(os.listdir(os.path.join(uri, "_delta_log"))) == [
        f"{v:020d}.json" for v in range(3)
    ]
    assert [e.seq for e in DeltaEventLog(uri).read("new")] == [0, 1]
    assert DeltaEventLog(uri).read("s") == []


def test_a_commit_whose_answer_was_lost_counts_as_landed(tmp_path, monkeypatch):
    """The commit file was created but the store's answer said it was there already
    (a retried PUT): the append finds its own data file in the log and returns."""
    uri = str(tmp_path / "records")
    log = DeltaEventLog(uri, compact_every=0)
    log.append(ev(0))
    real = _fs.create_new
    lost = []

    def create_then_lose_the_answer(fs, path, data):
        created = real(fs, path, data)
        if path.endswith(".json") and not lost:
            lost.append(path)
            return False, None
        return created

    monkeypatch.setattr(_fs, "create_new", create_then_lose_the_answer)
    log.append(ev(1))
    assert lost
    assert [e.seq for e in DeltaEventLog(uri).read("s")] == [0, 1]
    assert DeltaTable(uri).version() == 2


def test_a_commit_taken_by_another_writer_is_read_and_the_next_version_tried(tmp_path):
    """An append of another stream lands between this process's check and its commit:
    the append reads that commit and lands on the version after it."""
    uri = str(tmp_path / "records")
    log = DeltaEventLog(uri, compact_every=0)
    log.append(ev(0))
    # another writer's commit at version 2, written through delta-rs behind our back
    from deltalake import write_deltalake

    write_deltalake(uri, events_to_arrow([ev(0, stream="other")]), mode="append")
    log.append(ev(1))
    assert DeltaTable(uri).version() == 3
    assert [e.seq for e in log.read("s")] == [0, 1]
    assert [e.seq for e in log.read("other")] == [0]


def test_a_table_with_a_newer_protocol_is_appended_to_by_delta_rs(tmp_path):
    uri = str(tmp_path / "records")
    log = DeltaEventLog(uri, compact_every=0)
    log.append(ev(0))
    DeltaTable(uri).alter.set_table_properties({"delta.enableChangeDataFeed": "true"})
    log.append(ev(1))
    dt = DeltaTable(uri)
    assert dt.protocol().min_writer_version > 2
    assert _writer(uri, dt.version()) != "pyspark-txn"  # delta-rs wrote it
    assert [e.seq for e in DeltaEventLog(uri).read("s")] == [0, 1]


def test_a_commit_from_a_store_with_delta_rs_only_keys_is_left_to_delta_rs():
    log = DeltaEventLog("s3://b/records", {"AWS_S3_LOCKING_PROVIDER": "dynamodb"})
    assert log._own_io() is None
    log = DeltaEventLog("s3://b/records", {"AWS_CONDITIONAL_PUT": "dynamo:table"})
    assert log._own_io() is None
    assert DeltaEventLog("s3://b/records", {"AWS_REGION": "x"})._own_io() is not None


def test_apply_actions_follows_files_and_refuses_what_it_cannot_follow():
    files = dict.fromkeys(["a", "b"])
    assert apply_actions(files, [{"commitInfo": {}}, {"add": {"path": "c%20d"}}])
    assert apply_actions(files, [{"remove": {"path": "a"}}])
    assert list(files) == ["b", "c d"]
    assert not apply_actions(dict(files), [{"protocol": {"minReaderVersion": 3}}])
    assert not apply_actions(dict(files), [{"add": {"path": "x", "deletionVector": {"a": 1}}}])
    assert not apply_actions(dict(files), [{"add": {"path": "x", "partitionValues": {"p": "1"}}}])
    assert not apply_actions(dict(files), [{"metaData": {"partitionColumns": ["p"]}}])
    assert apply_actions(dict(files), [{"metaData": {"partitionColumns": []}}])


@pytest.mark.parametrize("checkpoint_ahead", [True])
def test_a_commit_at_or_below_the_last_checkpoint_is_unknown(tmp_path, checkpoint_ahead):
    """Short log retention: a commit that landed at or below the last checkpoint (its
    version's file cleaned up, then written again) is an unknown outcome."""
    uri = str(tmp_path / "records")
    log = DeltaEventLog(uri, compact_every=0)
    log.append(ev(0))
    with open(os.path.join(uri, "_delta_log", "_last_checkpoint"), "w") as f:
        json.dump({"version": 5, "size": 1}, f)
    with pytest.raises(delta_log.InvisibleCommit):
        log.append(ev(1))


def test_a_rewrite_that_lands_at_or_below_the_last_checkpoint_deletes_no_file(tmp_path):
    """A rewrite (here deleting summarized events) whose commit readers starting at the
    checkpoint would never see: the files it removes stay, since those readers still
    list them."""
    uri = str(tmp_path / "records")
    log = DeltaEventLog(uri, compact_every=0)
    for seq in range(3):
        log.append(ev(seq))
    data = sorted(f for f in os.listdir(uri) if f.endswith(".parquet"))
    with open(os.path.join(uri, "_delta_log", "_last_checkpoint"), "w") as f:
        json.dump({"version": 10, "size": 1}, f)
    log.truncate("s", 2)
    assert os.path.exists(os.path.join(uri, "_delta_log", f"{4:020d}.json"))  # it landed
    assert all(os.path.exists(os.path.join(uri, f)) for f in data)


def test_deleting_summarized_events_rewrites_only_the_files_holding_them(tmp_path):
    uri, log = _log_of(tmp_path, 4)
    before = set(f for f in os.listdir(uri) if f.endswith(".parquet"))
    log.truncate("s", 2)
    after = set(f for f in os.listdir(uri) if f.endswith(".parquet"))
    assert len(before - after) == 2 and after - before == set()  # two files held only those
    assert [e.seq for e in DeltaEventLog(uri).read("s")] == [2, 3]
    assert [e.seq for e in DeltaEventLog(uri).read("other")] == [0]
    ops = [h["operation"] for h in DeltaTable(uri).history(1)]
    assert ops == ["DELETE"]


def test_an_append_only_table_is_left_to_delta_rs(tmp_path):
    """``delta.appendOnly``: our rewrites remove files with ``dataChange``, which the
    table forbids; delta-rs then appends and refuses the delete (found by a trial)."""
    uri, log = _log_of(tmp_path, 3)
    DeltaTable(uri).alter.set_table_properties({"delta.appendOnly": "true"})
    log.append(ev(3))
    log.truncate("s", 2)  # delta-rs refuses it: housekeeping, logged
    dt = DeltaTable(uri)
    assert _writer(uri, dt.version()) != "pyspark-txn"  # the append: delta-rs's
    assert [e.seq for e in DeltaEventLog(uri).read("s")] == [0, 1, 2, 3]
    assert not any(
        a.get("remove", {}).get("dataChange")
        for v in range(dt.version() + 1)
        for a in _commit(uri, v)
    )


def test_a_lost_answer_then_a_compaction_still_counts_as_landed(tmp_path, monkeypatch):
    """The commit landed but its answer was lost, and a compaction took its file into a
    new one before the append read the table again: the append finds its event by id
    (found by a trial: it said the seq was taken)."""
    uri, log = _log_of(tmp_path, 2)
    real = _fs.create_new

    def create_then_compact(fs, path, data):
        created = real(fs, path, data)
        if path.endswith(".json") and b'"WRITE"' in data:
            monkeypatch.setattr(_fs, "create_new", real)
            other = mp.get_context("spawn").Process(target=_compact, args=(uri,))
            other.start()
            other.join(120)
            assert other.exitcode == 0
            return False, None
        return created

    monkeypatch.setattr(_fs, "create_new", create_then_compact)
    log.append(ev(2))
    assert [e.seq for e in DeltaEventLog(uri).read("s")] == [0, 1, 2]
    compacted = [v for v in range(5, DeltaTable(uri).version() + 1) if _writer(uri, v)]
    assert any("remove" in a for v in compacted for a in _commit(uri, v))  # after ours
