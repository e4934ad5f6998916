"""Named snapshots: export, list, show, verify, delete, on real Delta tables (no Spark)."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable
from test_admin import SinkDriver, run_cli

from pyspark_txn import admin, snapshots
from pyspark_txn.errors import ConfigError, TxnError
from pyspark_txn.sinks.staging import snapshot_dir


@pytest.fixture
def sink(tmp_path):
    s = SinkDriver(tmp_path)
    for b in range(4):
        s.batch(b, list(range(b * 10, b * 10 + 10)))
    return s


def ids_of(uri):
    return sorted(DeltaTable(uri).to_pyarrow_table().column("id").to_pylist())


def test_export_the_latest_snapshot_as_standalone_tables(sink, tmp_path):
    to = str(tmp_path / "exports" / "nightly")
    named = snapshots.export(sink.chk, "nightly", to)
    assert named.batch_id == 3 and named.details["rows"] == 40
    assert ids_of(f"{to}/data") == list(range(40))
    (row,) = DeltaTable(f"{to}/manifest").to_pyarrow_table().to_pylist()
    assert row["batch_id"] == 3 and row["name"] == "nightly" and row["rows"] == 40
    assert row["snapshot_id"] == named.snapshot_id and row["sink_id"] == sink.sink_id
    assert row["data_checksum"] == named.details["data_checksum"]
    # the export is its own table: it stays readable when the source table is gone
    import shutil

    shutil.rmtree(sink.target)
    assert ids_of(f"{to}/data") == list(range(40))
    assert snapshots.verify(sink.chk, "nightly").ok
    assert [n.name for n in snapshots.list_snapshots(sink.chk)] == ["nightly"]
    # its own snapshot id, above every id the sink had allocated
    assert named.snapshot_id > named.of_snapshot_id


def test_export_of_an_older_snapshot_is_the_table_as_of_that_batch(sink, tmp_path):
    state = sink.handle().load()
    second = state.records[1]
    named = snapshots.export(sink.chk, "b1", str(tmp_path / "b1"), snapshot=second.snapshot_id)
    assert named.batch_id == 1 and ids_of(str(tmp_path / "b1" / "data")) == list(range(20))
    with pytest.raises(ConfigError, match="no kept record of snapshot 99"):
        snapshots.export(sink.chk, "nope", str(tmp_path / "nope"), snapshot=99)


def test_verify_names_a_deleted_and_an_altered_file(sink, tmp_path):
    to = tmp_path / "x"
    named = snapshots.export(sink.chk, "x", str(to))
    first, second = sorted(p for p, _, _ in named.details["files"])[:2]
    os.remove(to / "data" / first)
    path = to / "data" / second
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    path.write_bytes(bytes(data))
    check = snapshots.verify(sink.chk, "x")
    assert not check.ok
    assert any(first in p and "missing" in p for p in check.problems)
    assert any(second in p and "CRC32" in p for p in check.problems)


def test_names_are_checked_and_unique(sink, tmp_path):
    for bad in ["", "../up", "a/b", ".hidden", "x" * 129, "sp ace"]:
        with pytest.raises(ConfigError, match="snapshot name"):
            snapshots.export(sink.chk, bad, str(tmp_path / "bad"))
    snapshots.export(sink.chk, "same", str(tmp_path / "one"))
    with pytest.raises(ConfigError, match="already has a snapshot named 'same'"):
        snapshots.export(sink.chk, "same", str(tmp_path / "two"))
    with pytest.raises(ConfigError, match="is not empty"):
        (tmp_path / "busy").mkdir()
        (tmp_path / "busy" / "f").write_text("x")
        snapshots.export(sink.chk, "other", str(tmp_path / "busy"))


def test_delete_then_list_and_the_name_is_free_again(sink, tmp_path):
    to = tmp_path / "d"
    snapshots.export(sink.chk, "d", str(to))
    snapshots.delete(sink.chk, "d")
    assert snapshots.list_snapshots(sink.chk) == [] and not to.exists()
    again = snapshots.export(sink.chk, "d", str(to))
    assert again.details["rows"] == 40


def test_kill_9_during_export_leaves_nothing_registered_or_visible(sink, tmp_path):
    to = tmp_path / "k"
    script = textwrap.dedent(
        f"""
        import os, signal
        from pyspark_txn import snapshots
        copy, n = snapshots._copy, [0]
        def dying_copy(*a):
            if n[0] == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            n[0] += 1
            return copy(*a)
        snapshots._copy = dying_copy
        snapshots.export({sink.chk!r}, "k", {str(to)!r})
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert snapshots.list_snapshots(sink.chk) == []
    assert (to / "data").exists() and not (to / "data" / "_delta_log").exists()
    assert not DeltaTable.is_deltatable(str(to / "data"))
    named = snapshots.export(sink.chk, "k", str(to))  # the retry removes the partial copy
    assert ids_of(str(to / "data")) == list(range(40)) and snapshots.verify(sink.chk, "k").ok
    assert named.snapshot_id not in {
        n.snapshot_id for n in sink.handle().load().named.values() if n.name != "k"
    }


def test_retention_keeps_named_snapshots(tmp_path):
    driver = SinkDriver(tmp_path, "r", retainSnapshots="1")
    driver.batch(0, [0, 1])
    snapshots.export(driver.chk, "early", str(tmp_path / "early"))
    for b in range(1, 90):
        driver.batch(b, [b + 1])
    events = driver.opts.record_store().events(driver.sink_id)
    assert events[0].kind.value == "summary"
    (named,) = snapshots.list_snapshots(driver.chk)
    assert named.name == "early" and named.batch_id == 0
    assert snapshots.verify(driver.chk, "early").ok
    assert ids_of(str(tmp_path / "early" / "data")) == [0, 1]
    table = DeltaTable(driver.target).to_pyarrow_table()
    assert pc.count_distinct(table.column("id")).as_py() == table.num_rows == 91


def test_cli_snapshots(sink, tmp_path, capsys):
    code, out, _ = run_cli(capsys, "snapshots", "list", sink.chk)
    assert code == 0 and "no named snapshots" in out
    to = tmp_path / "cli"
    code, out, _ = run_cli(capsys, "snapshots", "export", sink.chk, "cli", "--to", to, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["name"] == "cli" and doc["details"]["rows"] == 40
    code, out, _ = run_cli(capsys, "snapshots", "show", sink.chk, "cli")
    assert code == 0 and "40 rows" in out and "batch 3" in out
    code, out, _ = run_cli(capsys, "snapshots", "verify", sink.chk, "cli")
    assert code == 0 and out.strip().endswith("OK")
    os.remove(to / "data" / doc["details"]["files"][0][0])
    code, out, _ = run_cli(capsys, "snapshots", "verify", sink.chk, "cli", "--json")
    assert code == 1 and json.loads(out)["ok"] is False
    code, _, err = run_cli(capsys, "snapshots", "show", sink.chk, "missing")
    assert code == 2 and "no snapshot named 'missing'" in err
    code, _, err = run_cli(capsys, "snapshots", "delete", sink.chk, "cli")
    assert code == 2 and "--yes" in err  # no terminal to confirm on
    code, out, _ = run_cli(capsys, "snapshots", "delete", sink.chk, "cli", "--yes")
    assert code == 0 and not to.exists()


def test_export_requested_at_the_next_commit_cuts_at_that_batch(sink, tmp_path):
    to = tmp_path / "next"
    request = snapshots.request_export(sink.chk, "next", str(to))
    assert request.name == "next" and not to.exists()  # nothing happens until a commit
    with pytest.raises(ConfigError, match="is requested for the next commit"):
        snapshots.export(sink.chk, "next", str(tmp_path / "other"))
    with pytest.raises(ConfigError, match="is requested for the next commit"):
        snapshots.request_export(sink.chk, "next", str(tmp_path / "other"))
    sink.batch(4, list(range(40, 50)))
    named = snapshots.wait_for_export(sink.chk, "next", timeout=5)
    assert named.batch_id == 4 and named.details["requested_seq"] == request.requested_seq
    assert ids_of(f"{to}/data") == list(range(50)) and snapshots.verify(sink.chk, "next").ok
    state = sink.handle().load()
    assert not state.export_requests and named.target_version == state.committed.get(
        state.records[4].snapshot_id, named.target_version
    )
    # later batches do not export again
    sink.batch(5, [50])
    assert [n.name for n in snapshots.list_snapshots(sink.chk)] == ["next"]


def test_a_failed_requested_export_is_recorded_and_never_fails_the_batch(sink, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    snapshots.request_export(sink.chk, "bad", str(blocker))
    sink.batch(4, list(range(40, 50)))  # committed although the export fails
    assert sink.ids() == list(range(50))
    with pytest.raises(TxnError, match="requested export 'bad' failed: .*is a file"):
        snapshots.wait_for_export(sink.chk, "bad", timeout=5)
    with pytest.raises(TxnError, match="was not taken within"):
        snapshots.request_export(sink.chk, "late", str(tmp_path / "late"))
        snapshots.wait_for_export(sink.chk, "late", timeout=0.2, poll_s=0.05)


def test_a_request_served_by_an_empty_batch_cuts_at_it_with_the_last_commits_data(sink, tmp_path):
    before = snapshots.export(sink.chk, "before", str(tmp_path / "b"))
    snapshots.request_export(sink.chk, "empty", str(tmp_path / "e"))
    sink.batch(4, [], source_offsets=[{"index": 50}])
    named = snapshots.wait_for_export(sink.chk, "empty", timeout=5)
    # the cut is the empty batch (its offsets moved on); the table did not change
    assert named.batch_id == 4 and named.details["source_offsets"] == [{"index": 50}]
    assert named.target_version == before.target_version
    assert ids_of(str(tmp_path / "e" / "data")) == list(range(40))


def test_plain_export_after_empty_batches_pins_the_newest_batch(sink, tmp_path):
    sink.batch(4, [])
    sink.batch(5, [])
    latest = snapshots.export(sink.chk, "latest", str(tmp_path / "l"))
    assert latest.batch_id == 5 and ids_of(str(tmp_path / "l" / "data")) == list(range(40))
    four = admin.open_sink(sink.chk).load().last_record.snapshot_id - 1
    older = snapshots.export(sink.chk, "four", str(tmp_path / "f"), snapshot=four)
    assert older.batch_id == 4 and older.target_version == latest.target_version
    assert snapshots.verify(sink.chk, "four").ok


def test_a_sink_that_never_wrote_a_row_has_nothing_to_export(tmp_path):
    empty = SinkDriver(tmp_path, name="empty")
    empty.batch(0, [])
    with pytest.raises(ConfigError, match="wrote no rows"):
        snapshots.export(empty.chk, "none", str(tmp_path / "none"))
    assert not os.path.exists(tmp_path / "none")


def test_stateful_checkpoints_need_spark_or_state_skip(sink, tmp_path, monkeypatch):
    state_dir = tmp_path / "chk-a" / "state" / "0" / "0"
    state_dir.mkdir(parents=True)
    (state_dir / "1.delta").write_bytes(b"x")
    with pytest.raises(ConfigError, match="stateful.*state='skip'"):
        snapshots.request_export(sink.chk, "s", str(tmp_path / "s"))
    with pytest.raises(ConfigError, match="state='maybe': choose one of auto, include, skip"):
        snapshots.export(sink.chk, "s", str(tmp_path / "s"), state="maybe")
    from pyspark.sql import SparkSession

    monkeypatch.setattr(SparkSession, "getActiveSession", staticmethod(lambda: None))
    with pytest.raises(ConfigError, match="is stateful: exporting its state tables needs a Spark"):
        snapshots.export(sink.chk, "s", str(tmp_path / "s"))
    named = snapshots.export(sink.chk, "s", str(tmp_path / "s"), state="skip")
    assert named.details["state_tables"] == []
    with pytest.raises(ConfigError, match="stateful query"):
        snapshots.prepare_query(sink.chk, "s", str(tmp_path / "c2"), str(tmp_path / "t2"))


def test_settle_finishes_a_safe_record_and_deletes_unrecorded_staging(sink, tmp_path):
    from test_admin import stuck_after_record

    rec = stuck_after_record(sink, 4, list(range(40, 50)))
    orphan = sink.committer().allocate()
    orphan_dir = os.path.join(sink.target, snapshot_dir(sink.sink_id, *orphan))
    os.makedirs(orphan_dir)
    with open(os.path.join(orphan_dir, "part-0.parquet"), "wb") as f:
        f.write(b"half a file")
    state = admin.settle(sink.chk, reason="test")
    assert sink.ids() == list(range(50)) and rec.snapshot_id in state.committed
    assert not os.path.exists(orphan_dir) and orphan[0] in state.abandoned
    # the query restarts: a new run takes the sink back
    sink.batch(5, [50], run_id="run-2")
    assert sink.ids() == list(range(51))


def test_kafka_offsets_and_prepare_query_without_spark(tmp_path):
    driver = SinkDriver(tmp_path, "k")
    kafka = {"orders": {"0": 17, "1": 4}}
    driver.batch(0, [0, 1], source_offsets=[kafka, {"index": 2}])
    snapshots.export(driver.chk, "k0", str(tmp_path / "k0"))
    assert json.loads(snapshots.kafka_starting_offsets(driver.chk, "k0")) == kafka
    with pytest.raises(ConfigError, match="source 1 of snapshot 'k0' is not a Kafka source"):
        snapshots.kafka_starting_offsets(driver.chk, "k0", source=1)
    with pytest.raises(ConfigError, match="source=2: snapshot 'k0' has 2 source"):
        snapshots.kafka_starting_offsets(driver.chk, "k0", source=2)
    prepared = snapshots.prepare_query(
        driver.chk, "k0", str(tmp_path / "new-chk"), str(tmp_path / "new-table")
    )
    assert prepared.batch_id == 0 and prepared.rows == 2
    assert ids_of(str(tmp_path / "new-table")) == [0, 1]
    lines = (tmp_path / "new-chk" / "offsets" / "0").read_text().splitlines()
    assert lines[0] == "v1" and [json.loads(x) for x in lines[2:]] == [kafka, {"index": 2}]
    assert (tmp_path / "new-chk" / "commits" / "0").read_text().startswith("v1\n")
    with pytest.raises(ConfigError, match="must be a new or empty directory"):
        snapshots.prepare_query(driver.chk, "k0", str(tmp_path / "new-chk"), str(tmp_path / "t3"))


def test_cli_requests_offsets_and_prepare(sink, tmp_path, capsys):
    code, out, _ = run_cli(
        capsys, "snapshots", "export", sink.chk, "req", "--to", tmp_path / "req", "--at-next-commit"
    )
    assert code == 0 and "requested req" in out
    sink.batch(4, [40])
    code, out, _ = run_cli(capsys, "snapshots", "show", sink.chk, "req")
    assert code == 0 and "batch 4" in out
    code, _, err = run_cli(
        capsys, "snapshots", "export", sink.chk, "w", "--to", tmp_path / "w", "--wait", "1"
    )
    assert code == 2 and "--wait needs --at-next-commit" in err
    code, out, _ = run_cli(capsys, "snapshots", "offsets", sink.chk, "req", "--json")
    assert code == 0 and json.loads(out) == []
    code, out, _ = run_cli(
        capsys,
        "snapshots",
        "prepare-query",
        sink.chk,
        "req",
        "--checkpoint",
        tmp_path / "c",
        "--path",
        tmp_path / "p",
    )
    assert (
        code == 0
        and "resumes after batch 4" in out
        and ids_of(str(tmp_path / "p")) == list(range(41))
    )
