"""Backups of sinks driven without Spark (SinkDriver): where parts live, what is refused
before anything is written, and the messages (issue 25's trial)."""

import json
import os
import re
import shutil

import pytest
from backup_pipe import restore_killed_at
from deltalake import DeltaTable
from support import run_cli_process
from test_admin import SinkDriver

from pyspark_txn.errors import BackupError, ConfigError
from pyspark_txn.operations import backups


@pytest.fixture
def sink(tmp_path):
    s = SinkDriver(tmp_path)
    for b in range(2):
        s.batch(b, list(range(b * 10, b * 10 + 10)))
    return s


def ids_of(uri):
    return sorted(DeltaTable(uri).to_pyarrow_table().column("id").to_pylist())


def test_the_same_id_in_two_locations_are_two_backups(sink, tmp_path):
    x, y = str(tmp_path / "X"), str(tmp_path / "Y")
    x1 = backups.take(1, [sink.chk], x)
    assert x1.state == "completed" and x1.members[0].batch_id == 1
    sink.batch(2, list(range(20, 30)))
    y1 = backups.take(1, [sink.chk], y)
    # Y's part is its own copy, of the newer batch, not X's part found by name
    assert y1.state == "completed"
    assert y1.members[0].location.startswith(y) and y1.members[0].batch_id == 2
    backups.delete(1, y)
    # deleting Y's backup 1 leaves X's alone
    x1 = backups.status(1, x)
    assert x1.state == "completed" and x1.members[0].location.startswith(x)
    assert ids_of(os.path.join(x1.members[0].location, "data")) == list(range(20))
    assert backups.verify(1, x).ok


def test_a_wiped_location_does_not_find_its_old_parts(sink, tmp_path):
    x = str(tmp_path / "X")
    backups.take(1, [sink.chk], x)
    shutil.rmtree(x)
    sink.batch(2, list(range(20, 30)))
    again = backups.take(1, [sink.chk], x)
    assert again.state == "completed" and again.members[0].batch_id == 2
    assert ids_of(os.path.join(again.members[0].location, "data")) == list(range(30))


def _reader(tmp_path, upstream, *, offsets):
    """A sink whose one batch recorded ``offsets`` as its sources' end offsets."""
    s = SinkDriver(tmp_path, name="b")
    s.batch(0, [1, 2], source_offsets=offsets)
    return s


def _delta_offset(version):
    return json.dumps({"version": version, "index": 0, "snapshot": False})


def _nothing_written(to):
    return not os.path.exists(to)


def test_reads_are_checked_against_the_sources_before_anything_is_written(sink, tmp_path):
    # sink's table is at version 1 (two commits after creation... read it)
    up_version = DeltaTable(sink.target).version()
    b = _reader(tmp_path, sink, offsets=[_delta_offset(up_version + 1)])
    to = str(tmp_path / "backups")
    cases = [
        # more tables than sources (was an IndexError after the id was used)
        ({b.chk: [sink.target, sink.target]}, "2 tables given, but the query has 1 source"),
        # a txn-delta source without --reads (docs: refused before anything is written)
        ({}, "source 0 is a txn-delta source; say which table it reads"),
        # a table that does not exist
        ({b.chk: [str(tmp_path / "nowhere")]}, "is not a Delta table"),
        # a table behind what the source has read: not the table it reads
        ({b.chk: [_young_table(tmp_path)]}, "it is not the table this source reads"),
    ]
    for reads, message in cases:
        with pytest.raises(ConfigError, match=message):
            backups.take(1, [sink.chk, b.chk], to, reads=reads)
        assert _nothing_written(to), reads
    # a table given for a source that is not txn-delta
    c = SinkDriver(tmp_path, name="c")
    c.batch(0, [1], source_offsets=[json.dumps({"start": 0, "end": 5})])
    with pytest.raises(ConfigError, match="source 0 is not a txn-delta source"):
        backups.take(1, [sink.chk, c.chk], to, reads={c.chk: [sink.target]})
    assert _nothing_written(to)
    # right: the id 1 was never used
    st = backups.take(1, [sink.chk, b.chk], to, reads={b.chk: [sink.target]})
    assert st.backup_id == 1 and st.state == "completed"


def _young_table(tmp_path):
    young = SinkDriver(tmp_path, name="young")
    young.batch(0, [1])
    return young.target


def test_to_around_a_member_is_refused_before_the_catalog(sink, tmp_path):
    for to in (sink.target, f"{sink.target}/backups", sink.chk, f"{sink.chk}/b", str(tmp_path)):
        with pytest.raises(ConfigError, match="backups need a location outside"):
            backups.take(1, [sink.chk], to)
        assert not os.path.exists(os.path.join(to, "_catalog")), to
    st = backups.take(1, [sink.chk], str(tmp_path / "backups"))
    assert st.backup_id == 1


def test_relative_checkpoints_are_stored_absolute(sink, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    to = str(tmp_path / "backups")
    st = backups.take(None, [os.path.relpath(sink.chk)], to)
    assert st.members[0].checkpoint == sink.chk
    monkeypatch.chdir("/")  # status from elsewhere still finds the member
    assert backups.status(st.backup_id, to).state == "completed"
    started = [r for r in backups._rows(backups._open_catalog(to)) if r["event"] == "started"]
    assert started[0]["body"]["members"][0]["checkpoint"] == sink.chk


def test_restore_into_the_backup_or_the_pipeline_is_refused(sink, tmp_path):
    to = str(tmp_path / "backups")
    st = backups.take(1, [sink.chk], to)
    part = st.members[0].location
    for into in (
        to,
        f"{to}/restored",
        str(tmp_path),
        part,
        f"{part}/r",
        sink.target,
        f"{sink.chk}/r",
    ):
        with pytest.raises(ConfigError, match="restore into a location of its own"):
            backups.restore(1, to, into)
    assert not os.path.exists(f"{to}/restored") and not os.path.exists(f"{sink.chk}/r")


@pytest.mark.parametrize("char", ["#", "?", "%", "["])
def test_a_location_delta_rs_reads_as_a_url_is_refused_before_any_id_is_used(sink, tmp_path, char):
    """Trial 2026-11-28: backups.take never checked ``to``: a '?' in it created the
    catalog, used up an id per try and recorded each as failed ('[' panicked in delta-rs)."""
    bad = str(tmp_path / f"b{char}1")
    with pytest.raises(ConfigError, match=f"option to=.*{re.escape(repr(char))} cannot be used"):
        backups.take(None, [sink.chk], bad)
    assert not os.path.exists(bad)
    to = str(tmp_path / "backups")
    backups.take(1, [sink.chk], to)
    into = str(tmp_path / f"r{char}1")
    with pytest.raises(ConfigError, match=f"option into=.*{re.escape(repr(char))} cannot be used"):
        backups.restore(1, to, into)
    assert not os.path.exists(into)


def test_messages_deleted_id_huge_id_and_vacuumed_files(sink, tmp_path):
    to = str(tmp_path / "backups")
    backups.take(1, [sink.chk], to)
    backups.delete(1, to)
    with pytest.raises(ConfigError, match=r"\(backup 1 is deleted\)"):
        backups.take(1, [sink.chk], to)
    with pytest.raises(ConfigError, match=r"at most 9223372036854775807"):
        backups.take(2**63, [sink.chk], to)
    with pytest.raises(ConfigError, match=r"at most 9223372036854775807"):
        backups.status(2**63, to)
    assert backups.take(2**63 - 1, [sink.chk], to).state == "completed"
    # every id used up (re-trial: an OverflowError traceback on every automatic take)
    with pytest.raises(ConfigError, match="no backup id is left"):
        backups.take(None, [sink.chk], to)
    code, out, err = run_cli_process("backups", "take", sink.chk, "--to", to)
    assert code == 2 and "no backup id is left" in err and "Traceback" not in err, err
    code, out, err = run_cli_process("backups", "take", str(2**64), sink.chk, "--to", to)
    assert code == 2 and "at most" in err and "Traceback" not in err
    code, out, err = run_cli_process("backups", "status", str(2**64), "--to", to)
    assert code == 2 and "at most" in err and "Traceback" not in err
    # the files of the version to back up are gone (as after VACUUM)
    for f in os.listdir(sink.target):
        if f.endswith(".parquet"):
            os.remove(os.path.join(sink.target, f))
    other = str(tmp_path / "other")
    with pytest.raises(BackupError) as e:
        backups.take(None, [sink.chk], other)
    assert "Take a new backup" in str(e.value) and "Export a newer snapshot" not in str(e.value)


def test_a_resumed_restore_reads_on_from_the_version_it_restored(sink, tmp_path, monkeypatch):
    """Re-trial of issue 25 (data loss): a restore killed after its upstream part, the
    restored upstream query started (its table moves on), then the restore run again. The
    reader's offsets pointed past the upstream table's version *now*, so the rows the
    upstream wrote meanwhile were never read (silent gaps). They point past the version
    the restore left."""
    from deltalake import write_deltalake

    up_version = DeltaTable(sink.target).version()
    b = _reader(tmp_path, sink, offsets=[_delta_offset(up_version + 1)])
    to, into = str(tmp_path / "backups"), str(tmp_path / "restored")
    assert backups.take(1, [sink.chk, b.chk], to, reads={b.chk: [sink.target]}).state == (
        "completed"
    )
    restore_killed_at(monkeypatch, "exit_after_restore_part", 1, to, into)
    restored_up = os.path.join(into, "part-0", "table")
    left_at = DeltaTable(restored_up).version()
    # the user starts the restored upstream query: its table moves on
    one_row = DeltaTable(restored_up).to_pyarrow_table().slice(0, 1)
    write_deltalake(restored_up, one_row, mode="append")
    assert DeltaTable(restored_up).version() == left_at + 1

    (up, down) = backups.restore(1, to, into)
    assert up.path == restored_up and down.reads == {0: restored_up}
    with open(os.path.join(down.checkpoint, "offsets", str(down.batch_id))) as f:
        offset = json.loads(f.read().split("\n")[2])
    assert offset["version"] == left_at + 1, (offset, left_at)


def test_a_light_mode_member_is_refused_in_a_backups_words(sink, tmp_path):
    """Re-trial: the refusal was the admin text ("nothing to inspect here")."""
    from pyspark_txn.storage.checkpoint import persisted_sink_id

    light = str(tmp_path / "light-chk")
    persisted_sink_id(light, "light-sink", mode="light")  # as a light sink's first batch
    to = str(tmp_path / "backups")
    with pytest.raises(ConfigError, match="runs with mode=light.*snapshots mode") as e:
        backups.take(1, [sink.chk, light], to)
    assert "nothing to inspect" not in str(e.value)
    assert _nothing_written(to)
