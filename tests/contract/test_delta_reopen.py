"""Cached Delta tables (pyspark_txn.storage.delta_tables) must never outlive a re-created table."""

import shutil
import threading

import pyarrow as pa
import pytest
from deltalake import write_deltalake
from support import allocated_event

from pyspark_txn.state import DeltaEventLog
from pyspark_txn.storage.delta_tables import open_table


def _events(log, n, who):
    for seq in range(n):
        log.append(allocated_event(seq, query_id=who))


@pytest.mark.parametrize("new_count", [1, 3, 7], ids=["fewer", "same", "more"])
def test_record_table_recreated_in_the_same_process(tmp_path, new_count):
    uri = str(tmp_path / "records")
    log = DeltaEventLog(uri)
    _events(log, 3, "old")
    assert [e.query_id for e in log.read("s")] == ["old"] * 3
    shutil.rmtree(uri)
    assert log.read("s") == []
    fresh = DeltaEventLog(uri)  # a new log object, as a restarted query would make
    _events(fresh, new_count, "new")
    assert [e.query_id for e in log.read("s")] == ["new"] * new_count
    # The old seq numbers are free again in the new table, and taken ones are refused.
    assert [e.seq for e in log.read("s")] == list(range(new_count))


def test_table_recreated_with_another_schema_is_seen(tmp_path):
    uri = str(tmp_path / "t")
    write_deltalake(uri, pa.table({"a": [1]}))
    write_deltalake(uri, pa.table({"a": [2]}), mode="append")
    assert open_table(uri).version() == 1
    shutil.rmtree(uri)
    assert open_table(uri) is None
    write_deltalake(uri, pa.table({"b": ["x"]}))
    write_deltalake(uri, pa.table({"b": ["y"]}), mode="append")
    dt = open_table(uri)
    assert pa.schema(dt.schema().to_arrow()).names == ["b"]
    assert sorted(pa.table(dt.to_pyarrow_table())["b"].to_pylist()) == ["x", "y"]


def test_cached_table_catches_up_and_threads_do_not_share(tmp_path):
    uri = str(tmp_path / "t")
    write_deltalake(uri, pa.table({"a": [1]}))
    first = open_table(uri)
    write_deltalake(uri, pa.table({"a": [2]}), mode="append")
    again = open_table(uri)
    assert again is first and again.version() == 1
    other = []
    t = threading.Thread(target=lambda: other.append(open_table(uri)))
    t.start()
    t.join()
    assert other[0] is not first and other[0].version() == 1


def test_record_table_keeps_few_files(tmp_path):
    """Compaction + vacuum: one commit per event must not mean one file per event forever."""
    uri = tmp_path / "records"
    log = DeltaEventLog(str(uri), compact_every=4)
    _events(log, 40, "q")
    assert [e.seq for e in log.read("s")] == list(range(40))
    files = list(uri.glob("*.parquet"))
    assert len(files) <= 8, sorted(f.name for f in files)


@pytest.mark.parametrize("new_count", [2, 4, 6], ids=["fewer", "same", "more"])
def test_memoized_fold_restarts_on_a_recreated_table(tmp_path, new_count):
    """The per-process fold memo continues only the same history, never another table's."""
    from pyspark_txn.state import MemoryEventLog, RecordStore, allocate, fold_sink, take_over

    uri = str(tmp_path / "records")
    store = RecordStore(DeltaEventLog(uri))
    store.update("s", fold_sink, lambda s: take_over(s, "old-run", None, "q-old"))
    for _ in range(3):
        store.update("s", fold_sink, allocate)
    assert store.load_sink("s").query_id == "q-old"
    shutil.rmtree(uri)
    # Another process re-creates the table: its events reach this process only by reading.
    other = RecordStore(MemoryEventLog())
    other.update("s", fold_sink, lambda s: take_over(s, "new-run", None, "q-new"))
    for _ in range(new_count - 1):
        other.update("s", fold_sink, allocate)
    fresh = DeltaEventLog(uri)
    for event in other.events("s"):
        fresh.append(event)
    state = store.load_sink("s")
    assert (state.query_id, state.next_seq) == ("q-new", new_count)
    assert state == fold_sink("s", fresh.read("s"))


def test_a_cached_table_is_opened_afresh_after_a_long_catch_up(tmp_path, monkeypatch):
    """delta-rs's catch-up keeps the log segment it opened with, and every commit on it
    replays that segment: a commit cost grew with every batch (issue 26). After
    REBASE_AFTER commits the table is opened again, from its latest checkpoint."""
    from deltalake import DeltaTable

    from pyspark_txn.storage import delta_tables

    monkeypatch.setattr(delta_tables, "REBASE_AFTER", 3)
    uri = str(tmp_path / "t")
    write_deltalake(uri, pa.table({"a": [0]}))
    first = open_table(uri)
    for i in range(1, 3):
        write_deltalake(uri, pa.table({"a": [i]}), mode="append")
        assert open_table(uri) is first  # caught up in place
    write_deltalake(uri, pa.table({"a": [3]}), mode="append")
    assert open_table(uri) is first and first.version() == 3
    DeltaTable(uri).create_checkpoint()
    fresh = open_table(uri)  # 3 commits caught up: opened again
    assert fresh is not first and fresh.version() == 3
    assert sorted(pa.table(fresh.to_pyarrow_table())["a"].to_pylist()) == [0, 1, 2, 3]
    assert open_table(uri) is fresh


def test_our_checkpoint_makes_the_next_open_start_from_it(tmp_path):
    """After the sink writes a target checkpoint, this thread's next open reads from it
    instead of catching up the old segment further."""
    from pyspark_txn.sinks.delta_target import maintain_log

    uri = str(tmp_path / "t")
    write_deltalake(uri, pa.table({"a": [0]}), configuration={"delta.checkpointInterval": "2"})
    first = open_table(uri)
    write_deltalake(uri, pa.table({"a": [1]}), mode="append")
    write_deltalake(uri, pa.table({"a": [2]}), mode="append")
    dt = open_table(uri)
    assert dt is first and dt.version() == 2
    maintain_log(dt, uri)  # version 2: a checkpoint is due
    assert (tmp_path / "t" / "_delta_log" / "00000000000000000002.checkpoint.parquet").exists()
    again = open_table(uri)
    assert again is not first and again.version() == 2
