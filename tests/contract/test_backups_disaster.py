"""Backups the day the pipeline is lost (issue 34): status, verify and restore from the
backup location alone; restore in place; deletes that never leave a registered part
without its files; a backup's part deleted as a snapshot; reads checked by table id.

The pipeline: tests/backup_pipe.py (two sinks driven without Spark, the second fed by
the real txn-delta stream reader)."""

from __future__ import annotations

import importlib
import json
import os
import shutil

import pytest
from backup_pipe import Pipe, ids, lose_everything, restore_killed_at
from deltalake import DeltaTable, write_deltalake
from support import run_cli_process
from test_admin import SinkDriver

from pyspark_txn.errors import BackupError, ConfigError, SourceError
from pyspark_txn.operations import backups, snapshots


@pytest.fixture
def pipe(tmp_path):
    p = Pipe(tmp_path)
    p.step_a(2)
    p.step_b()
    return p


def test_backups_restore_from_their_location_alone_and_the_chain_converges(pipe, tmp_path):
    to = str(tmp_path / "backups")
    one = backups.take(None, pipe.chks, to, reads=pipe.declared)
    pipe.step_a(2)
    pipe.step_b()
    pipe.step_a()
    two = backups.take(None, pipe.chks, to, reads=pipe.declared)
    assert (one.state, two.state) == ("completed", "completed")
    held = {t.backup_id: [ids(f"{m.location}/data") for m in t.members] for t in (one, two)}
    assert held[1] == [list(range(10)), list(range(10))]
    # a is cut back to the version b consumed, not its latest batch (the exact cut)
    assert held[2] == [list(range(20)), list(range(20))]
    lose_everything(pipe)

    # status, list, show and verify from the backup location alone
    for t in (one, two):
        st = backups.status(t.backup_id, to)
        assert st.state == "completed", st
        assert [m.batch_id for m in st.members] == [m.batch_id for m in t.members]
        assert backups.verify(t.backup_id, to).ok
    assert [b.state for b in backups.list_backups(to)] == ["completed", "completed"]
    code, out, err = run_cli_process("backups", "verify", "2", "--to", to)
    assert code == 0 and out.splitlines()[0].startswith(f"{pipe.a.chk}: "), (out, err)

    # restore each one and run the restored chain on: the same rows as never losing it
    for t in (one, two):
        restored = backups.restore(t.backup_id, to, str(tmp_path / f"r{t.backup_id}"))
        again = Pipe.restored(tmp_path / f"r{t.backup_id}", restored)
        assert [ids(r.path) for r in restored] == held[t.backup_id]
        # b's offsets name the restored a: its id and the version after the part's
        assert again.b_offset["tableId"] == str(DeltaTable(restored[0].path).metadata().id)
        assert again.b_offset["version"] == 1 and again.b_offset["index"] == 0
        again.step_b()  # nothing new yet: nothing read twice
        again.step_a(6 - again.next_a)
        again.step_b()
        assert ids(again.b.target) == ids(again.a.target) == list(range(30))
        started = json.loads(open(f"{restored[1].checkpoint}/pyspark_txn/started_from.json").read())
        assert started["backup"]["backup_id"] == t.backup_id
        assert started["reads"] == {"0": restored[0].path}
    # the other backups are untouched by all of it
    assert [b.state for b in backups.list_backups(to)] == ["completed", "completed"]
    # a backup location moved whole (to another disk, another bucket) still restores
    moved = str(tmp_path / "elsewhere" / "backups")
    shutil.move(to, moved)
    assert [b.state for b in backups.list_backups(moved)] == ["completed", "completed"]
    assert backups.verify(2, moved).ok
    restored = backups.restore(2, moved, str(tmp_path / "r-moved"))
    assert [ids(r.path) for r in restored] == held[2]


def test_a_restored_reader_on_the_original_upstream_is_refused(pipe, tmp_path):
    to = str(tmp_path / "backups")
    backups.take(None, pipe.chks, to, reads=pipe.declared)
    pipe.step_a(2)  # the original a moves on
    restored = backups.restore(1, to, str(tmp_path / "r"))
    wrong = Pipe.restored(tmp_path / "r", restored, b_reads=pipe.a.target)
    with pytest.raises(SourceError) as e:
        wrong.step_b()
    original_id = str(DeltaTable(pipe.a.target).metadata().id)
    restored_id = str(DeltaTable(restored[0].path).metadata().id)
    assert restored_id in str(e.value) and original_id in str(e.value)
    assert ids(restored[1].path) == list(range(10))  # nothing was written


def test_restore_in_place_and_earlier_backups_still_restore(pipe, tmp_path):
    to = str(tmp_path / "backups")
    backups.take(None, pipe.chks, to, reads=pipe.declared)
    pipe.step_a(2)
    pipe.step_b()
    backups.take(None, pipe.chks, to, reads=pipe.declared)
    # in place over a live pipeline: refused before anything is written
    with pytest.raises(ConfigError, match="is not empty. Stop the pipeline and move"):
        backups.restore(2, to, in_place=True)
    with pytest.raises(ConfigError, match="either into"):
        backups.restore(2, to)
    moved = tmp_path / "old"
    moved.mkdir()
    for path in (pipe.a.chk, pipe.a.target, pipe.b.chk, pipe.b.target):
        shutil.move(path, moved)
    restored = backups.restore(2, to, in_place=True)
    assert [(r.checkpoint, r.path) for r in restored] == [
        (pipe.a.chk, pipe.a.target),
        (pipe.b.chk, pipe.b.target),
    ]
    assert restored[1].reads == {0: pipe.a.target}
    # the same queries, unchanged, go on
    again = Pipe.restored(tmp_path, restored)
    again.step_a(6 - again.next_a)
    again.step_b()
    assert ids(pipe.b.target) == ids(pipe.a.target) == list(range(30))
    # restore in place again: every member is done, nothing is redone
    assert [r.checkpoint for r in backups.restore(2, to, in_place=True)] == pipe.chks
    # the earlier backups are still completed and restore, although their parts are in
    # no live registry any more
    assert [b.state for b in backups.list_backups(to)] == ["completed", "completed"]
    r1 = backups.restore(1, to, str(tmp_path / "r1"))
    assert [ids(r.path) for r in r1] == [list(range(10)), list(range(10))]
    # and a new backup of the restored pipeline
    three = backups.take(None, pipe.chks, to, reads=pipe.declared)
    assert three.state == "completed" and backups.verify(3, to).ok


def _as_legacy(to):
    """The catalog as a backup taken before parts were kept in it: no member_completed."""
    dt = backups._open_catalog(to)
    table = dt.to_pyarrow_table()
    keep = [e != backups.MEMBER_COMPLETED for e in table.column("event").to_pylist()]
    write_deltalake(dt, table.filter(keep), mode="overwrite")


def test_a_legacy_backup_restores_from_its_manifests(pipe, tmp_path):
    to = str(tmp_path / "backups")
    backups.take(None, pipe.chks, to, reads=pipe.declared)
    _as_legacy(to)
    lose_everything(pipe)
    st = backups.status(1, to)
    assert st.state == "completed" and [m.batch_id for m in st.members] == [1, 0]
    assert backups.verify(1, to).ok
    restored = backups.restore(1, to, str(tmp_path / "r"))
    again = Pipe.restored(tmp_path / "r", restored)
    again.step_a(4)
    again.step_b()
    assert ids(again.b.target) == ids(again.a.target) == list(range(30))
    # a flipped byte in a part: the derived CRC32s no longer match the manifest's checksum
    data = f"{st.members[0].location}/data"
    part = next(f for f in os.listdir(data) if f.endswith(".parquet"))
    with open(f"{data}/{part}", "r+b") as f:
        f.seek(10)
        byte = f.read(1)
        f.seek(10)
        f.write(bytes([byte[0] ^ 0xFF]))
    check = backups.verify(1, to)
    assert not check.ok and any("checksum" in p for p in check.problems), check.problems


def test_a_part_deleted_as_a_snapshot_is_refused_unless_forced(pipe, tmp_path):
    to = str(tmp_path / "backups")
    st = backups.take(None, pipe.chks, to, reads=pipe.declared)
    name = backups.part_name(1, backups._catalog_id(backups._open_catalog(to)))
    with pytest.raises(ConfigError, match=f"part of backup 1 in {to}.*backups delete 1"):
        snapshots.delete(pipe.b.chk, name)
    code, out, err = run_cli_process("snapshots", "delete", pipe.b.chk, name, "--yes")
    assert code == 2 and "--force" in err and "Traceback" not in err, err
    assert backups.verify(1, to).ok  # nothing was deleted
    code, out, err = run_cli_process("snapshots", "delete", pipe.b.chk, name, "--yes", "--force")
    assert code == 0, err
    assert not os.path.exists(st.members[1].location)
    after = backups.status(1, to)
    assert after.state == "failed"
    assert "files are gone" in after.members[1].reason and after.members[0].state == "completed"
    assert "taker died" not in (after.members[1].reason or "")


def _failing_registry(monkeypatch, chk):
    """The registry of the sink at ``chk`` cannot be read (a reset connection)."""
    parts = importlib.import_module("pyspark_txn.operations.backups.parts")
    real = parts.snapshots.list_snapshots

    def flaky(location, *args, **kwargs):
        if location == chk:
            raise OSError("connection reset by peer")
        return real(location, *args, **kwargs)

    monkeypatch.setattr(parts.snapshots, "list_snapshots", flaky)


def test_a_delete_never_leaves_a_registered_part_without_its_files(pipe, tmp_path, monkeypatch):
    to = str(tmp_path / "backups")
    st = backups.take(None, pipe.chks, to, reads=pipe.declared)
    name = backups.part_name(1, backups._catalog_id(backups._open_catalog(to)))
    with monkeypatch.context() as m:
        _failing_registry(m, pipe.b.chk)
        assert backups.status(1, to).state == "completed"  # the catalog alone says so
        with pytest.raises(BackupError, match="cannot be read now.*nothing of that part"):
            backups.delete(1, to)
    # b's part is still registered and whole; the backup says a delete is unfinished
    assert name in [n.name for n in snapshots.list_snapshots(pipe.b.chk)]
    assert snapshots.verify(pipe.b.chk, name).ok
    assert backups.status(1, to).state == "deleting"
    with pytest.raises(ConfigError, match="only a completed backup restores"):
        backups.restore(1, to, str(tmp_path / "r"))
    with pytest.raises(ConfigError, match="backup 1 is being deleted"):
        backups.take(1, pipe.chks, to, reads=pipe.declared)
    # run again: it finishes, and both names and all files are gone
    assert backups.delete(1, to).state == "deleted"
    for chk in pipe.chks:
        assert name not in [n.name for n in snapshots.list_snapshots(chk)]
    assert not os.path.exists(os.path.dirname(st.members[0].location))


def test_a_taker_that_reads_an_unreadable_sink_is_unknown_never_failed(pipe, tmp_path, monkeypatch):
    to = str(tmp_path / "backups")
    code, out, err = run_cli_process(
        "backups",
        "take",
        *pipe.chks,
        "--to",
        to,
        "--reads",
        f"{pipe.b.chk}={pipe.a.target}",
        env={backups.FAULT_ENV: "exit_after_register"},
    )
    assert code == 86, err
    # the first part (b, downstream first) is registered, the catalog never heard of it
    with monkeypatch.context() as m:
        _failing_registry(m, pipe.b.chk)
        st = backups.status(1, to)
        assert st.members[0].state == "doesNotExist" and st.members[1].state == "unknown"
        assert st.state == "unknown" and "ask again" in st.members[1].reason
    # resumed with the same id: the registered part is taken into the catalog, a is taken
    done = backups.take(1, pipe.chks, to, reads=pipe.declared)
    assert done.state == "completed"
    lose_everything(pipe)
    assert backups.status(1, to).state == "completed" and backups.verify(1, to).ok


def test_a_wrong_reads_is_refused_by_table_id(pipe, tmp_path):
    other = SinkDriver(tmp_path, name="other")
    for n in range(4):  # as far along as a: only its id tells it apart
        other.batch(n, [100 + n])
    to = str(tmp_path / "backups")
    with pytest.raises(ConfigError, match="reads the Delta table with id .* it is not the table"):
        backups.take(None, [*pipe.chks, other.chk], to, reads={pipe.b.chk: [other.target]})
    assert not os.path.exists(to)
    code, out, err = run_cli_process("backups", "take", *pipe.chks, "--to", to)
    assert code == 2 and f"--reads {pipe.b.chk}=TABLE" in err and "{" not in err, err


def test_list_of_a_location_without_a_catalog_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="no backup catalog there"):
        backups.list_backups(str(tmp_path / "typo"))
    code, out, err = run_cli_process("backups", "list", "--to", str(tmp_path / "typo"))
    assert code == 2 and "no backup catalog there" in err and not out


def test_a_query_never_starts_on_a_half_restored_checkpoint(pipe, tmp_path, monkeypatch):
    """Trial 2, finding 1: a restore killed after a member's table was copied, then the
    queries started before the restore was run again: the member started as a new query
    into the table that held the part, and wrote every row a second time."""
    to = str(tmp_path / "backups")
    backups.take(None, pipe.chks, to, reads=pipe.declared)
    lose_everything(pipe)
    restore_killed_at(monkeypatch, "restore_after_checkpoint:1", 1, to, in_place=True)
    # b's table and checkpoint are written, its mark says unfinished: its sink refuses
    with pytest.raises(ConfigError, match="restore of backup 1 .* is unfinished: run"):
        SinkDriver(tmp_path, name="b")
    code, out, err = run_cli_process("status", pipe.b.chk)
    assert code == 1 and "unfinished" in out, (out, err)
    # run again: it finishes, and the same queries go on to the same rows
    restored = backups.restore(1, to, in_place=True)
    assert [r.earlier for r in restored] == [True, False]
    again = Pipe.restored(tmp_path, restored)
    again.step_a(6 - again.next_a)
    again.step_b()
    assert ids(pipe.b.target) == ids(pipe.a.target) == list(range(30))
    # another backup in place over the restored (and since run) pipeline: refused as a
    # live checkpoint, not as "an unfinished restore"
    backups.take(None, pipe.chks, to, reads=pipe.declared)
    with pytest.raises(ConfigError, match="restored from backup 1 .* which may have run since"):
        backups.restore(2, to, in_place=True)
    # a rerun of a finished restore whose tables were moved away since does not report
    # success: it says the table is gone
    shutil.rmtree(pipe.a.target)
    with pytest.raises(ConfigError, match="no longer holds that table \\(gone\\)"):
        backups.restore(1, to, in_place=True)


def test_a_copy_of_a_member_s_table_or_of_the_backup_location_is_refused(pipe, tmp_path):
    """Trial 2, findings 3, 5, 6: a copied table keeps its Delta id (a declared copy of
    the upstream was accepted and the reader cut as outside the backup); a copied backup
    location keeps its catalog (a take into the copy spoilt the id in the original); a
    part deleted with --force: take said "completed" where status said "failed"."""
    copy = str(tmp_path / "a-copy")
    shutil.copytree(pipe.a.target, copy)
    to = str(tmp_path / "backups")
    with pytest.raises(ConfigError, match=f"has the Delta table id of {pipe.a.target}.*copy"):
        backups.take(None, pipe.chks, to, reads={pipe.b.chk: [copy]})
    assert not os.path.exists(to)
    backups.take(None, pipe.chks, to, reads=pipe.declared)
    replica = str(tmp_path / "replica")
    shutil.copytree(to, replica)
    assert backups.verify(1, replica).ok  # a copy restores
    with pytest.raises(ConfigError, match=f"is a copy of {to}.*Take them into {to}"):
        backups.take(None, pipe.chks, replica, reads=pipe.declared)
    shutil.rmtree(to)  # the original gone: the copy was a move, and takes on
    assert backups.take(None, pipe.chks, replica, reads=pipe.declared).backup_id == 2
    name = backups.part_name(2, backups._catalog_id(backups._open_catalog(replica)))
    snapshots.delete(pipe.b.chk, name, force=True)
    with pytest.raises(ConfigError, match=r"\(backup 2 is failed\)"):
        backups.take(2, pipe.chks, replica, reads=pipe.declared)
    with open(tmp_path / "a-file", "w") as f:
        f.write("x")
    with pytest.raises(ConfigError, match="is a file; backups need a directory"):
        backups.take(None, pipe.chks, str(tmp_path / "a-file"), reads=pipe.declared)
