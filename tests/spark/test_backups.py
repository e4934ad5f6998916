"""Backups of a running three-query chain: an exact cut, restored row for row."""

import time

import pytest
from deltalake import DeltaTable
from pipeline_checks import run_to_end

from pyspark_txn import backups
from pyspark_txn.errors import ConfigError

pytestmark = pytest.mark.spark

TOTAL = 600


def _a(spark, chk, target, **trigger):
    reader = spark.readStream.format("txn-sequence")
    for k, v in {
        "rowsPerBatch": 30,
        "totalRows": TOTAL,
        "width": 1,
        **trigger.pop("seq", {}),
    }.items():
        reader = reader.option(k, v)
    w = reader.load().writeStream.format("txn-delta")
    return w.option("checkpointLocation", chk).option("path", target)


def _link(spark, src, chk, target):
    """A downstream query: reads the upstream table, derives a column, writes its own."""
    df = spark.readStream.format("txn-delta").option("path", src).load()
    df = df.selectExpr("id", "c1", "id * 2 + 1 AS derived")
    w = df.writeStream.format("txn-delta")
    return w.option("checkpointLocation", chk).option("path", target)


def _rows(path):
    return sorted(tuple(r.values()) for r in DeltaTable(path).to_pyarrow_table().to_pylist())


def _run_chain(spark, base, chks=None, paths=None):
    """The chain run to the end, one query after the other (availableNow)."""
    chks = chks or [str(base / f"chk{i}") for i in range(3)]
    paths = paths or [str(base / f"t{i}") for i in range(3)]
    run_to_end(_a(spark, chks[0], paths[0]))
    run_to_end(_link(spark, paths[0], chks[1], paths[1]))
    run_to_end(_link(spark, paths[1], chks[2], paths[2]))
    return paths


def _wait(q, batch, timeout=240):
    deadline = time.time() + timeout
    while not (q.lastProgress and q.lastProgress["batchId"] >= batch):
        assert time.time() < deadline and q.isActive, q.exception()
        time.sleep(0.2)


def test_backups_of_a_running_chain_are_exact_cuts_and_restore_row_for_row(spark, tmp_path):
    expected = _rows(_run_chain(spark, tmp_path / "reference")[2])
    assert len(expected) == TOTAL

    chks = [str(tmp_path / f"chk{i}") for i in range(3)]
    paths = [str(tmp_path / f"t{i}") for i in range(3)]
    to = str(tmp_path / "backups")
    reads = {chks[1]: [paths[0]], chks[2]: [paths[1]]}
    queries = []
    try:
        a = (
            _a(spark, chks[0], paths[0], seq={"rowsPerSecond": 25})
            .trigger(processingTime="400 milliseconds")
            .start()
        )
        queries.append(a)
        _wait(a, 0)
        b = _link(spark, paths[0], chks[1], paths[1]).trigger(processingTime="500 milliseconds")
        queries.append(b.start())
        _wait(queries[1], 0)
        c = _link(spark, paths[1], chks[2], paths[2]).trigger(processingTime="700 milliseconds")
        queries.append(c.start())
        _wait(queries[2], 1)
        taken = [backups.take(None, chks, to, reads=reads)]
        _wait(queries[2], queries[2].lastProgress["batchId"] + 2)
        taken.append(backups.take(None, chks, to, reads=reads))
        # a used or smaller id is refused, naming the highest so far
        with pytest.raises(ConfigError, match="highest so far in .* is 2"):
            backups.take(1, chks, to, reads=reads)
    finally:
        for q in queries:
            q.stop()
    assert [t.backup_id for t in taken] == [1, 2]
    for t in taken:
        assert t.state == "completed", t
        a_part, b_part, c_part = t.members
        # the exact cut: each downstream part consumed exactly its upstream part's version
        for down, up in ((b_part, a_part), (c_part, b_part)):
            (offset,) = down.source_offsets
            assert offset["index"] == 0 and not offset["snapshot"]
            assert offset["version"] - 1 == up.target_version
        assert backups.verify(t.backup_id, to).ok
    assert taken[0].members[0].batch_id < taken[1].members[0].batch_id
    assert [b.backup_id for b in backups.list_backups(to)] == [1, 2]

    restored = backups.restore(2, to, str(tmp_path / "restored"), spark=spark)
    assert [r.original for r in restored] == chks
    # the restored parts hold what the parts hold, and downstream holds nothing more
    new_chks = [r.checkpoint for r in restored]
    new_paths = [r.path for r in restored]
    # a restored query started on the original upstream table (only the sink's options
    # changed) is refused: its offsets name the restored upstream's table id
    with pytest.raises(Exception, match="another table's versions as its own"):
        run_to_end(_link(spark, paths[0], new_chks[1], new_paths[1]))
    assert len(_rows(new_paths[1])) == len(_rows(f"{taken[1].members[1].location}/data"))
    assert restored[1].reads == {0: new_paths[0]} and restored[2].reads == {0: new_paths[1]}
    # each restored table is a strict prefix-derived subset: C's rows come from A's part
    a_ids = {r[0] for r in _rows(new_paths[0])}
    assert {r[0] for r in _rows(new_paths[2])} <= {r[0] for r in _rows(new_paths[1])} <= a_ids
    _run_chain(spark, None, new_chks, new_paths)
    assert _rows(new_paths[2]) == expected
    # restore is idempotent: run again, it finds every member done
    again = backups.restore(2, to, str(tmp_path / "restored"), spark=spark)
    assert [r.checkpoint for r in again] == new_chks

    # delete: every part goes, the id stays used
    gone = backups.delete(1, to)
    assert gone.state == "deleted"
    with pytest.raises(ConfigError, match="highest so far"):
        backups.take(2, chks, to, reads=reads)
    assert backups.take(None, chks, to, reads=reads).backup_id == 3


@pytest.mark.slow
def test_a_fan_out_is_cut_where_its_slowest_reader_stands(spark, tmp_path):
    # A's table is read by B and C; B has read further than C
    names = ("a", "b", "c")
    ref = {n: str(tmp_path / f"ref-{n}") for n in names}
    run_to_end(_a(spark, ref["a"] + "-chk", ref["a"]))
    for n in "bc":
        run_to_end(_link(spark, ref["a"], ref[n] + "-chk", ref[n]))
    chk = {n: str(tmp_path / f"chk-{n}") for n in names}
    path = {n: str(tmp_path / f"t-{n}") for n in names}
    run_to_end(_a(spark, chk["a"], path["a"], seq={"totalRows": 300}))
    for n in "bc":
        run_to_end(_link(spark, path["a"], chk[n], path[n]))
    run_to_end(_a(spark, chk["a"], path["a"], seq={"totalRows": 450}))
    run_to_end(_link(spark, path["a"], chk["b"], path["b"]))

    to = str(tmp_path / "backups")
    reads = {chk["b"]: [path["a"]], chk["c"]: [path["a"]]}
    st = backups.take(None, [chk[n] for n in names], to, reads=reads)
    a_part, b_part, c_part = st.members
    assert st.state == "completed"
    for reader in (b_part, c_part):  # both cut at the version C (the slowest) consumed
        assert reader.source_offsets[0]["version"] - 1 == a_part.target_version
    assert len(_rows(f"{b_part.location}/data")) == 300 < len(_rows(path["b"]))
    assert backups.verify(st.backup_id, to).ok

    restored = backups.restore(st.backup_id, to, str(tmp_path / "restored"), spark=spark)
    new = dict(zip(names, restored, strict=True))
    run_to_end(_a(spark, new["a"].checkpoint, new["a"].path))
    for n in "bc":
        assert new[n].reads == {0: new["a"].path}
        run_to_end(_link(spark, new["a"].path, new[n].checkpoint, new[n].path))
        assert _rows(new[n].path) == _rows(ref[n]) and len(_rows(ref[n])) == TOTAL


def test_a_lost_pipeline_is_restored_from_its_backups_alone(spark, tmp_path):
    """The disaster a backup is for: two backups, then every checkpoint, record table and
    table of the chain is gone. Each backup restores from its location alone (one into
    new locations, one in place), and the restored chain run to the end equals an
    uninterrupted run row for row."""
    import shutil

    expected = _rows(_run_chain(spark, tmp_path / "reference")[2])
    chks = [str(tmp_path / f"chk{i}") for i in range(3)]
    paths = [str(tmp_path / f"t{i}") for i in range(3)]
    to = str(tmp_path / "backups")
    reads = {chks[1]: [paths[0]], chks[2]: [paths[1]]}
    for total in (240, 420):  # the chain part of the way, a backup; further, a backup
        run_to_end(_a(spark, chks[0], paths[0], seq={"totalRows": total}))
        run_to_end(_link(spark, paths[0], chks[1], paths[1]))
        run_to_end(_link(spark, paths[1], chks[2], paths[2]))
        assert backups.take(None, chks, to, reads=reads).state == "completed"
    for place in (*chks, *paths):
        shutil.rmtree(place)
    assert [b.state for b in backups.list_backups(to)] == ["completed", "completed"]
    for backup_id in (1, 2):
        assert backups.verify(backup_id, to).ok
    into = backups.restore(1, to, str(tmp_path / "restored"), spark=spark)
    _run_chain(spark, None, [r.checkpoint for r in into], [r.path for r in into])
    assert _rows(into[2].path) == expected
    in_place = backups.restore(2, to, in_place=True, spark=spark)
    assert [(r.checkpoint, r.path) for r in in_place] == list(zip(chks, paths, strict=True))
    _run_chain(spark, None, chks, paths)  # the original queries, unchanged
    assert _rows(paths[2]) == expected
    # both backups are still completed and verify after all of it
    assert [b.state for b in backups.list_backups(to)] == ["completed", "completed"]
    assert backups.verify(1, to).ok and backups.verify(2, to).ok
