"""Named snapshots: export, list, show, verify, delete, on real Delta tables (no Spark)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable
from support import FaultyLog, run_cli_process
from test_admin import SinkDriver, run_cli

from pyspark_txn import admin, snapshots
from pyspark_txn.errors import (
    ConfigError,
    CorruptSnapshotError,
    IndeterminateCommitError,
    TxnError,
)
from pyspark_txn.operations.snapshots import copy as copying
from pyspark_txn.sinks.staging import snapshot_dir
from pyspark_txn.state import EventKind


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


def test_export_by_spark_batch_id(sink, tmp_path, capsys):
    sink.batch(4, [], source_offsets=[{"index": 50}])  # snapshot ids and batch ids part ways
    sink.batch(5, [50])
    state = sink.handle().load()
    (rec,) = [r for r in state.records.values() if r.batch_id == 2]
    named = snapshots.export(sink.chk, "b2", str(tmp_path / "b2"), batch=2)
    assert named.batch_id == 2 and named.of_snapshot_id == rec.snapshot_id
    assert ids_of(str(tmp_path / "b2" / "data")) == list(range(30))
    code, out, _ = run_cli(
        capsys,
        "snapshots",
        "export",
        sink.chk,
        "b4",
        "--to",
        tmp_path / "b4",
        "--batch",
        "4",
        "--json",
    )
    assert code == 0 and json.loads(out)["batch_id"] == 4
    with pytest.raises(ConfigError, match="no kept record of batch 9 .kept: batches 0 to 5"):
        snapshots.export(sink.chk, "b9", str(tmp_path / "b9"), batch=9)
    with pytest.raises(ConfigError, match="exclude each other"):
        snapshots.export(sink.chk, "b9", str(tmp_path / "b9"), batch=1, snapshot=1)


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
        from pyspark_txn.operations.snapshots import copy as copying
        copy, n = copying._copy, [0]
        def dying_copy(*a):
            if n[0] == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            n[0] += 1
            return copy(*a)
        copying._copy = dying_copy
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


def test_the_command_s_exit_status_is_its_result_in_every_run(sink, tmp_path, capsys):
    """A new process each run, as users run it: the native libraries' teardown at
    interpreter exit once aborted ~1 run in 6 with status 134 after printing OK
    (issue 23 item 10). 20 runs; and a usage error is still 2."""
    code, _, _ = run_cli(capsys, "snapshots", "export", sink.chk, "s", "--to", tmp_path / "s")
    assert code == 0
    codes = []
    for _ in range(20):
        code, out, err = run_cli_process("snapshots", "verify", sink.chk, "s")
        codes.append(code)
        assert out.strip().endswith("OK"), err
    assert codes == [0] * 20
    code, _, err = run_cli_process("snapshots", "verify", sink.chk)
    assert code == 2 and "required" in err


@pytest.mark.parametrize("to", ["dbfs:/exports/s", "s3:bucket/s"])
def test_export_to_a_location_the_sink_refuses_is_refused(sink, tmp_path, capsys, monkeypatch, to):
    monkeypatch.chdir(tmp_path)
    before = set(os.listdir(tmp_path))
    code, out, err = run_cli(capsys, "snapshots", "export", sink.chk, "s", "--to", to, "--json")
    assert code == 2 and f"--to={to!r}" in err
    assert json.loads(out)["type"] == "ConfigError"
    assert set(os.listdir(tmp_path)) == before  # no ./dbfs: folder
    assert snapshots.list_snapshots(sink.chk) == []


def test_an_unwritable_to_is_named_with_exit_2_and_json(sink, tmp_path, capsys):
    (tmp_path / "a-file").write_text("x")
    before = sink.handle().load()
    for to in (tmp_path / "a-file" / "s", "/proc/pyspark-txn-export"):
        code, out, err = run_cli(capsys, "snapshots", "export", sink.chk, "s", "--to", to, "--json")
        assert code == 2 and f"--to='{to}': cannot create or write a folder there" in err
        assert json.loads(out)["type"] == "ConfigError"
    state = sink.handle().load()
    assert snapshots.list_snapshots(sink.chk) == []
    assert (state.next_seq, state.ongoing_snapshot_id) == (
        before.next_seq,
        before.ongoing_snapshot_id,
    )  # nothing allocated for it


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
    with pytest.raises(ConfigError, match="is a file"):  # checked when requested
        blocker.write_text("not a directory")
        snapshots.request_export(sink.chk, "bad", str(blocker))
    blocker.unlink()
    snapshots.request_export(sink.chk, "bad", str(blocker))
    blocker.write_text("not a directory")  # taken after the request: the export fails
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


def test_a_sink_whose_batches_wrote_no_rows_exports_an_empty_table(tmp_path):
    # one empty batch or two: the same answer (its commit created the empty table)
    for batches in (1, 2):
        empty = SinkDriver(tmp_path, name=f"empty{batches}")
        for b in range(batches):
            empty.batch(b, [])
        named = snapshots.export(empty.chk, "none", str(tmp_path / f"none{batches}"))
        assert named.batch_id == batches - 1 and named.details["rows"] == 0
        assert ids_of(str(tmp_path / f"none{batches}" / "data")) == []
        assert snapshots.verify(empty.chk, "none").ok
    never = SinkDriver(tmp_path, name="never")  # no batch at all: nothing to export
    with pytest.raises(ConfigError, match="has no sink"):
        snapshots.export(never.chk, "none", str(tmp_path / "never"))
    assert not os.path.exists(tmp_path / "never")


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


def test_exporting_a_version_whose_files_were_vacuumed_says_so(sink, tmp_path):
    table = DeltaTable(sink.target)
    table.optimize.compact()  # rewrites the files: the sink's last version is history now
    DeltaTable(sink.target).vacuum(
        retention_hours=0, enforce_retention_duration=False, dry_run=False
    )
    with pytest.raises(CorruptSnapshotError, match=r"is gone \(a VACUUM"):
        snapshots.export(sink.chk, "late", str(tmp_path / "late"))
    assert not (tmp_path / "late").exists() and snapshots.list_snapshots(sink.chk) == []


def test_prepare_query_refuses_a_snapshot_of_spark_s_file_source(tmp_path):
    driver = SinkDriver(tmp_path, "f")
    driver.batch(0, [0, 1], source_offsets=[{"logOffset": 0}])
    snapshots.export(driver.chk, "f0", str(tmp_path / "f0"))
    with pytest.raises(ConfigError, match=r"source 0 of snapshot 'f0' is Spark's file source"):
        snapshots.prepare_query(driver.chk, "f0", str(tmp_path / "c2"), str(tmp_path / "t2"))
    assert not (tmp_path / "c2").exists() and not (tmp_path / "t2").exists()


@pytest.mark.parametrize("offset", ["164", 164])
def test_prepare_query_refuses_a_snapshot_of_spark_s_rate_source(tmp_path, offset):
    """rate's offset counts seconds from a start time under the checkpoint's sources/: a
    prepared (or restored) query died in Spark on its first batch (found by a trial)."""
    driver = SinkDriver(tmp_path, "n")
    driver.batch(0, [0, 1], source_offsets=[offset])
    snapshots.export(driver.chk, "n0", str(tmp_path / "n0"))
    with pytest.raises(ConfigError, match=r"source 0 of snapshot 'n0' has a plain number"):
        snapshots.prepare_query(driver.chk, "n0", str(tmp_path / "c2"), str(tmp_path / "t2"))
    assert not (tmp_path / "c2").exists() and not (tmp_path / "t2").exists()


@pytest.mark.parametrize(
    "offset",
    [
        '{"claim":3,"source":"redis:g:orders"}',  # as Spark hands it to the sink
        {"claim": 3, "source": "redis:g:orders"},
    ],
)
def test_prepare_query_refuses_a_snapshot_of_an_acknowledging_source(tmp_path, capsys, offset):
    """txn-redis offsets are claim numbers in a claim log the export does not hold: a
    prepared query could never start, so prepare-query refuses before writing anything."""
    driver = SinkDriver(tmp_path, "r")
    driver.batch(0, [0, 1], source_offsets=[offset])
    snapshots.export(driver.chk, "r0", str(tmp_path / "r0"))
    with pytest.raises(ConfigError, match=r"source 0 of snapshot 'r0' is an acknowledging source"):
        snapshots.prepare_query(driver.chk, "r0", str(tmp_path / "c2"), str(tmp_path / "t2"))
    code, _, err = run_cli(
        capsys, "snapshots", "prepare-query", driver.chk, "r0",
        "--checkpoint", tmp_path / "c2", "--path", tmp_path / "t2",
    )  # fmt: skip
    assert code == 2 and "claim log" in err, err
    assert not (tmp_path / "c2").exists() and not (tmp_path / "t2").exists()


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


# --- two exports, one place -------------------------------------------------------------


def _paused_export(chk, name, to, go, before_file: int | None = None):
    """A second process that exports, then waits for the file ``go``: before registering,
    or (``before_file``) before copying that data file (0-based). It prints how many
    files it copied."""
    script = textwrap.dedent(
        f"""
        import os, sys, time
        from pyspark_txn import snapshots
        def pause():
            print("PAUSED", flush=True)
            while not os.path.exists({str(go)!r}):
                time.sleep(0.05)
        from pyspark_txn.operations.snapshots import copy as copying, exports
        register, copy, copies = exports.register_named, copying._copy, []
        def slow_register(*a, **k):
            if {before_file!r} is None:
                pause()
            return register(*a, **k)
        def slow_copy(*a, **k):
            if len(copies) == {before_file!r}:
                pause()
            copies.append(a[1])
            return copy(*a, **k)
        exports.register_named, copying._copy = slow_register, slow_copy
        try:
            named = snapshots.export({chk!r}, {name!r}, {str(to)!r})
        except Exception as e:
            print("FAILED", type(e).__name__, e, "COPIED", len(copies), flush=True)
            sys.exit(3)
        print("DONE", named.name, flush=True)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "PAUSED", line + proc.stderr.read()[-2000:]
    return proc


def test_an_export_never_removes_the_copy_of_a_live_export(sink, tmp_path):
    to, go = tmp_path / "shared", tmp_path / "go"
    first = _paused_export(sink.chk, "first", to, go)  # tables committed, not registered
    try:
        with pytest.raises(ConfigError, match=rf"pid {first.pid} on host .*replace-unfinished"):
            snapshots.export(sink.chk, "second", str(to))
        assert ids_of(f"{to}/data") == list(range(40))  # the first's copy is untouched
        go.touch()
        out, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 0 and "DONE first" in out, out + err[-2000:]
    assert snapshots.verify(sink.chk, "first").ok
    assert [n.name for n in snapshots.list_snapshots(sink.chk)] == ["first"]
    with pytest.raises(ConfigError, match="is the location of snapshot 'first'"):
        snapshots.export(sink.chk, "second", str(to))


def test_settle_during_an_export_fails_the_export_and_never_wedges_the_record_table(sink, tmp_path):
    """settle withdraws the export's reserved id while it copies: the registration is
    refused (not landed on a withdrawn id, which no later load could fold)."""
    to, go = tmp_path / "e", tmp_path / "go"
    first = _paused_export(sink.chk, "e", to, go)  # copied, about to register
    try:
        admin.settle(sink.chk)
        go.touch()
        out, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 3, out + err[-2000:]
    assert "SnapshotWithdrawnError" in out and "withdrawn" in out, out
    assert snapshots.list_snapshots(sink.chk) == [] and not to.exists()
    assert admin.open_sink(sink.chk).load().snapshot_id >= 0  # the record table still loads
    sink.batch(4, list(range(40, 50)), run_id="run-2")  # and a restarted query goes on
    assert snapshots.export(sink.chk, "e", str(to)).details["rows"] == 50


def test_replace_unfinished_wins_and_the_live_export_refuses_to_register(sink, tmp_path):
    to, go = tmp_path / "shared", tmp_path / "go"
    first = _paused_export(sink.chk, "first", to, go)
    try:
        second = snapshots.export(sink.chk, "second", str(to), replace_unfinished=True)
        go.touch()
        out, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 3 and "marker was replaced by another export" in out, out + err
    assert [n.name for n in snapshots.list_snapshots(sink.chk)] == ["second"]
    assert second.location == str(to) and snapshots.verify(sink.chk, "second").ok
    assert ids_of(f"{to}/data") == list(range(40))  # the loser left the winner's data alone


def test_an_export_replaced_while_it_copies_stops_before_its_next_file(sink, tmp_path):
    to, go = tmp_path / "shared", tmp_path / "go"
    # paused as it starts its second file (the marker was still its own): it finishes that
    # file and stops before the third (four batches, four files)
    first = _paused_export(sink.chk, "first", to, go, before_file=1)
    try:
        second = snapshots.export(sink.chk, "second", str(to), replace_unfinished=True)
        go.touch()
        out, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 3, out + err[-2000:]
    assert "marker was replaced by another export" in out and "COPIED 2" in out, out
    assert [n.name for n in snapshots.list_snapshots(sink.chk)] == ["second"]
    assert second.location == str(to) and snapshots.verify(sink.chk, "second").ok
    assert ids_of(f"{to}/data") == list(range(40))


# --- nested locations --------------------------------------------------------------------


def test_exports_are_never_nested_in_or_around_other_places(sink, tmp_path):
    outer = tmp_path / "exports" / "outer"
    snapshots.export(sink.chk, "outer", str(outer))
    handle = sink.handle()
    cases = {
        str(outer / "inner"): "is inside the location of snapshot 'outer'",
        str(outer / "data" / "x"): "is inside the location of snapshot 'outer'",
        str(tmp_path / "exports"): "contains the location of snapshot 'outer'",
        str(outer): "is the location of snapshot 'outer'",
        f"{sink.chk}/exp": "is inside the query's checkpoint",
        f"{handle.record_table}/exp": "is inside the query's checkpoint",
        str(tmp_path): "contains the sink's target",
        f"{sink.target}/x": "is inside the sink's target",
    }
    for to, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            snapshots.export(sink.chk, "n", to)
        with pytest.raises(ConfigError, match=message):
            snapshots.request_export(sink.chk, "n", to)
    link = tmp_path / "link"
    os.symlink(sink.target, link)  # a symlink reaching into the target
    with pytest.raises(ConfigError, match="is inside the sink's target"):
        snapshots.export(sink.chk, "n", str(link / "x"))
    assert not os.path.exists(os.path.join(sink.target, "x"))
    assert not (outer / "inner").exists() and [
        n.name for n in snapshots.list_snapshots(sink.chk)
    ] == ["outer"]


def test_exports_never_go_inside_an_unfinished_export_or_any_delta_table(sink, tmp_path):
    """A folder holding an export marker (a live export still copying, or any sink's export)
    and any Delta table are refused as places around a new export: their removal, a failed
    export's cleanup or a VACUUM would take the new export with them."""
    running = tmp_path / "running"
    running.mkdir()
    marker = {"sink_id": "another-sink", "snapshot_id": 7, "name": "slow", "owner": None}
    (running / snapshots.EXPORT_MARKER).write_text(json.dumps(marker))
    other_table = tmp_path / "other_table"
    DeltaTable.create(str(other_table), schema=DeltaTable(sink.target).schema())
    other_sink = SinkDriver(tmp_path, name="other")  # another sink's checkpoint
    spark_chk = tmp_path / "spark_chk"  # a checkpoint of a query with another sink
    (spark_chk / "offsets").mkdir(parents=True)
    (spark_chk / "metadata").write_text('{"id":"5f1c3b1e-0000-4000-8000-000000000000"}')
    for to, message in [
        (running / "inner", "is inside an export folder"),
        (running / "a" / "b", "is inside an export folder"),
        (other_table / "x", "is inside a Delta table"),
        (Path(other_sink.chk) / "exports" / "x", "is inside a query's checkpoint"),
        (spark_chk / "x", "is inside a query's checkpoint"),
    ]:
        with pytest.raises(ConfigError, match=message):
            snapshots.export(sink.chk, "n", str(to))
        with pytest.raises(ConfigError, match=message):
            snapshots.request_export(sink.chk, "n", str(to))
        assert not to.exists()
    assert snapshots.list_snapshots(sink.chk) == []


def test_delete_through_a_symlink_removes_the_copy(sink, tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    os.symlink(real, link)
    snapshots.export(sink.chk, "via-link", str(link / "e"))
    assert (real / "e" / "data").is_dir()
    snapshots.delete(sink.chk, "via-link")
    assert not (real / "e").exists() and snapshots.list_snapshots(sink.chk) == []


def test_a_failed_cleanup_removes_only_what_the_export_wrote(sink, tmp_path):
    from pyspark_txn.operations.snapshots.location import _remove_export
    from pyspark_txn.storage import fs as _fs

    root = tmp_path / "e"
    snapshots.export(sink.chk, "e", str(root))
    (root / "notes.txt").write_text("not the export's")
    fs, path = _fs.filesystem(str(root))
    _remove_export(fs, path, str(root))
    assert sorted(os.listdir(root)) == ["notes.txt"]


def test_delete_refuses_a_folder_holding_another_snapshot(sink, tmp_path):
    from pyspark_txn.state import allocate, fold_sink
    from pyspark_txn.state.core import register_named

    outer = tmp_path / "outer"
    named = snapshots.export(sink.chk, "outer", str(outer))
    # an entry inside it, as versions without the nesting check could register
    store = sink.handle().record_store()
    event, _ = store.update(sink.sink_id, fold_sink, allocate)
    inner = replace(named, name="inner", snapshot_id=event.snapshot_id, location=f"{outer}/in")
    store.update(sink.sink_id, fold_sink, lambda s: register_named(s, inner))
    with pytest.raises(ConfigError, match="holds the location of snapshot 'inner'"):
        snapshots.delete(sink.chk, "outer")
    assert snapshots.verify(sink.chk, "outer").ok  # nothing was deleted
    assert {n.name for n in snapshots.list_snapshots(sink.chk)} == {"outer", "inner"}
    snapshots.delete(sink.chk, "inner")  # the inner one can go first
    snapshots.delete(sink.chk, "outer")  # then the outer one
    assert snapshots.list_snapshots(sink.chk) == [] and not outer.exists()


# --- stop_and_export checks first --------------------------------------------------------


class StoppableQuery:
    """Only what stop_and_export calls on a StreamingQuery: it must not be stopped."""

    def __init__(self):
        self.stopped = False

    def stop(self):
        self.stopped = True


def test_stop_and_export_checks_everything_before_stopping(sink, tmp_path):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "f").write_text("x")
    snapshots.export(sink.chk, "taken", str(tmp_path / "taken"))
    query = StoppableQuery()
    for name, to, message in [
        ("t", busy, "is not empty"),
        ("t", tmp_path / "taken" / "in", "is inside the location of snapshot 'taken'"),
        ("taken", tmp_path / "new", "already has a snapshot named 'taken'"),
        ("bad name", tmp_path / "new", "snapshot name"),
    ]:
        with pytest.raises(ConfigError, match=message):
            snapshots.stop_and_export(query, name, str(to), checkpoint=sink.chk, state="skip")
        assert not query.stopped
    named = snapshots.stop_and_export(
        query, "t", str(tmp_path / "t"), checkpoint=sink.chk, state="skip"
    )
    assert query.stopped and named.details["terminal"] and snapshots.verify(sink.chk, "t").ok


# --- verify reads the manifest ------------------------------------------------------------


def test_verify_compares_every_manifest_row_with_the_registry(sink, tmp_path):
    from deltalake import write_deltalake

    to = tmp_path / "m"
    snapshots.export(sink.chk, "m", str(to))
    manifest = DeltaTable(str(to / "manifest")).to_pyarrow_table()
    rows = manifest.to_pylist()
    rows[0].update(rows=41, source_offset='{"index": 99}', batch_id=7)
    import pyarrow as pa

    write_deltalake(
        str(to / "manifest"), pa.Table.from_pylist(rows, manifest.schema), mode="overwrite"
    )
    check = snapshots.verify(sink.chk, "m")
    assert not check.ok
    for key in ("rows is 41", "batch_id is 7", "source_offset is"):
        assert any(key in p for p in check.problems), check.problems
    assert len(check.problems) == 3


# --- requested exports are visible, checked and cancellable --------------------------------


def test_a_pending_request_is_visible_checked_and_cancellable(sink, tmp_path, capsys):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "f").write_text("x")
    with pytest.raises(ConfigError, match="is not empty"):
        snapshots.request_export(sink.chk, "r", str(busy))
    snapshots.request_export(sink.chk, "r", str(tmp_path / "r"))
    with pytest.raises(ConfigError, match="location requested for export 'r'"):
        snapshots.request_export(sink.chk, "r2", str(tmp_path / "r" / "in"))
    code, out, _ = run_cli(capsys, "snapshots", "list", sink.chk)
    assert code == 0 and "r\trequested" in out
    code, out, _ = run_cli(capsys, "snapshots", "list", sink.chk, "--json")
    assert [(d["name"], d["state"]) for d in json.loads(out)] == [("r", "requested")]
    code, out, _ = run_cli(capsys, "snapshots", "show", sink.chk, "r")
    assert code == 0 and "requested (not exported yet)" in out and "snapshots cancel" in out
    code, out, _ = run_cli(capsys, "status", sink.chk, "--json")
    assert [r["name"] for r in json.loads(out)["export_requests"]] == ["r"]
    code, out, _ = run_cli(capsys, "status", sink.chk)
    assert "export 'r' requested for the next commit" in out
    code, _, err = run_cli(capsys, "snapshots", "delete", sink.chk, "r", "--yes")
    assert code == 2 and "requested for the next commit" in err and "cancel" in err
    with pytest.raises(TxnError, match="still requested; cancel it"):
        snapshots.wait_for_export(sink.chk, "r", timeout=0.1, poll_s=0.05)
    code, out, _ = run_cli(capsys, "snapshots", "cancel", sink.chk, "r", "--json")
    assert code == 0 and json.loads(out)["cancelled"]["name"] == "r"
    with pytest.raises(TxnError, match="requested export 'r' was cancelled"):
        snapshots.wait_for_export(sink.chk, "r", timeout=1)
    sink.batch(4, list(range(40, 50)))  # the next commit exports nothing
    assert snapshots.list_snapshots(sink.chk) == [] and not (tmp_path / "r").exists()
    with pytest.raises(ConfigError, match="no export 'r' requested"):
        snapshots.cancel_request(sink.chk, "r")
    snapshots.request_export(sink.chk, "r", str(tmp_path / "r"))  # the name is free again
    sink.batch(5, [50])
    assert snapshots.wait_for_export(sink.chk, "r", timeout=5).batch_id == 5
    code, _, err = run_cli(capsys, "snapshots", "cancel", sink.chk, "r")
    assert code == 2 and "already ran" in err


# --- prepare-query refuses what the sink refuses ---------------------------------------------


def test_prepare_query_refuses_a_pair_the_sink_refuses(sink, tmp_path, capsys):
    snapshots.export(sink.chk, "p", str(tmp_path / "p"))
    same = tmp_path / "same"
    for chk, path in [(same, same), (tmp_path / "t" / "chk", tmp_path / "t")]:
        with pytest.raises(ConfigError, match="the txn-delta sink refuses this pair"):
            snapshots.prepare_query(sink.chk, "p", str(chk), str(path))
        assert not os.path.exists(path) and not os.path.exists(chk)
    code, out, _ = run_cli(
        capsys,
        "snapshots",
        "prepare-query",
        sink.chk,
        "p",
        "--checkpoint",
        same,
        "--path",
        same,
        "--json",
    )
    assert code == 2 and "refuses this pair" in json.loads(out)["error"]
    # the same folder through a symlink, and a symlink to nothing
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "alias")
    with pytest.raises(ConfigError, match="the txn-delta sink refuses this pair"):
        snapshots.prepare_query(sink.chk, "p", str(tmp_path / "real"), str(tmp_path / "alias"))
    os.symlink(tmp_path / "nothing", tmp_path / "dangling")
    with pytest.raises(ConfigError, match="is a symbolic link to .* which does not exist"):
        snapshots.prepare_query(sink.chk, "p", str(tmp_path / "c2"), str(tmp_path / "dangling"))
    assert os.listdir(tmp_path / "real") == []


# --- the CLI: --json everywhere, cheap checks before Spark, unreadable exports --------------


def test_cli_json_for_delete_and_usage_errors(sink, tmp_path, capsys):
    snapshots.export(sink.chk, "j", str(tmp_path / "j"))
    code, out, _ = run_cli(capsys, "snapshots", "delete", sink.chk, "j", "--yes", "--json")
    assert code == 0 and json.loads(out)["deleted"]["name"] == "j"
    assert not (tmp_path / "j").exists()
    for argv in [
        ("snapshots", "export", sink.chk, "x", "--json"),  # --to missing
        ("snapshots", "list", sink.chk, "--json", "--bogus"),
        ("snapshots", "verify", "--json"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            run_cli(capsys, *argv)
        out, _ = capsys.readouterr()
        assert exit_.value.code == 2 and json.loads(out)["type"] == "UsageError", out
    for command in (
        "export",
        "prepare-query",
        "offsets",
        "list",
        "show",
        "verify",
        "delete",
        "cancel",
    ):
        with pytest.raises(SystemExit):
            run_cli(capsys, "snapshots", command, "--help")
        assert "--json" in capsys.readouterr().out, command


def test_cli_export_checks_cheap_errors_before_starting_spark(sink, tmp_path, capsys, monkeypatch):
    import pyspark_txn.session

    state_dir = tmp_path / "chk-a" / "state" / "0" / "0"  # a stateful query: would need Spark
    state_dir.mkdir(parents=True)
    (state_dir / "1.delta").write_bytes(b"x")

    def no_spark(*a, **k):
        raise AssertionError("a local Spark session was started")

    monkeypatch.setattr(pyspark_txn.session, "local_session", no_spark)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "f").write_text("x")
    for name, to, message in [
        ("ok", busy, "is not empty"),
        ("bad name", tmp_path / "n", "snapshot name"),
        ("ok", f"{sink.target}/in", "inside the sink's target"),
    ]:
        code, _, err = run_cli(capsys, "snapshots", "export", sink.chk, name, "--to", to)
        assert code == 2 and message in err, err


def test_verify_of_an_unreadable_export_says_so(sink, tmp_path, capsys):
    import shutil

    to = tmp_path / "u"
    snapshots.export(sink.chk, "u", str(to))
    shutil.rmtree(to / "data" / "_delta_log")
    code, out, _ = run_cli(capsys, "snapshots", "verify", sink.chk, "u")
    assert code == 1 and "u: unreadable export at" in out and "None" not in out
    code, out, _ = run_cli(capsys, "snapshots", "verify", sink.chk, "u", "--json")
    doc = json.loads(out)
    assert code == 1 and doc["readable"] is False and doc["rows"] == "unreadable"


def test_kill_9_before_registration_leaves_committed_tables_that_are_no_snapshot(sink, tmp_path):
    to = tmp_path / "k"
    script = textwrap.dedent(
        f"""
        import os, signal
        from pyspark_txn import snapshots
        from pyspark_txn.operations.snapshots import exports
        def dying_register(*a, **k):
            os.kill(os.getpid(), signal.SIGKILL)
        exports.register_named = dying_register
        snapshots.export({sink.chk!r}, "k", {str(to)!r})
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    # what docs/snapshots.md says: committed tables stay, unregistered, with the marker
    assert DeltaTable.is_deltatable(str(to / "data")) and DeltaTable.is_deltatable(
        str(to / "manifest")
    )
    marker = json.loads((to / snapshots.EXPORT_MARKER).read_text())
    assert marker["name"] == "k" and marker["owner"]["pid"] != os.getpid()
    assert snapshots.list_snapshots(sink.chk) == []
    with pytest.raises(ConfigError, match="no snapshot named 'k'"):
        snapshots.verify(sink.chk, "k")
    snapshots.export(sink.chk, "k2", str(to))  # its writer is dead: removed, exported anew
    assert snapshots.verify(sink.chk, "k2").ok and ids_of(str(to / "data")) == list(range(40))
    # the dead export's id is withdrawn with its copy: status shows no open export
    state = sink.handle().load()
    assert marker["snapshot_id"] in state.abandoned
    assert admin.sink_status(sink.handle()).open_exports == ()


def test_a_deleted_snapshots_id_is_not_shown_as_an_open_export(sink, tmp_path, capsys):
    """Trial 25: after `snapshots delete` (or `backups delete`), `status` listed the
    deleted snapshot's id as allocated by an export that has not registered yet."""
    named = snapshots.export(sink.chk, "gone", str(tmp_path / "gone"))
    snapshots.delete(sink.chk, "gone")
    assert admin.sink_status(sink.handle()).open_exports == ()
    code, out, _ = run_cli(capsys, "status", sink.chk)
    assert code == 0 and "allocated by an export" not in out, out
    # the id stays used: the next export gets a higher one, and the fold stays valid
    again = snapshots.export(sink.chk, "again", str(tmp_path / "again"))
    assert again.snapshot_id > named.snapshot_id
    sink.batch(4, [99])
    assert admin.sink_status(sink.handle()).open_exports == ()


class _LostRegistrationReply(FaultyLog):
    """The real record table; the export's registration lands, then its reply is lost
    (``fault``) and the next ``unreadable`` reads fail. ``lands=False``: every try fails
    before it lands."""

    def __init__(self, inner, fault: BaseException, unreadable: int, lands: bool = True):
        super().__init__(inner)
        self.fault, self.unreadable, self.lands = fault, unreadable, lands

    def append(self, event):
        if event.kind is not EventKind.NAMED or self.fault is None:
            return self.inner.append(event)
        fault = self.fault
        if self.lands:
            self.fault = None
            self.inner.append(event)
            self.read_failures = self.unreadable
        raise fault


def _lose_registration_reply(monkeypatch, fault, unreadable, lands=True):
    from pyspark_txn.state import RecordStore

    made = admin.SinkHandle.record_store
    wrapped = {}

    def record_store(self):
        inner = made(self).log
        log = wrapped.setdefault(id(self), _LostRegistrationReply(inner, fault, unreadable, lands))
        log.inner = inner
        return RecordStore(log, backoff_s=0.01)

    monkeypatch.setattr(admin.SinkHandle, "record_store", record_store)


@pytest.mark.parametrize("unreadable", [1, 5])
def test_a_registration_whose_reply_is_lost_keeps_the_registered_snapshot(
    sink, tmp_path, monkeypatch, unreadable
):
    """The entry landed, the reply did not (then 1 or 5 reads fail, the store gives up
    at 5): the export re-reads the registry and returns the entry, its copy intact."""
    to = tmp_path / "lost"
    _lose_registration_reply(monkeypatch, TimeoutError("reply lost (injected)"), unreadable)
    named = snapshots.export(sink.chk, "lost", str(to))
    monkeypatch.undo()
    assert named.name == "lost" and named.details["rows"] == 40
    assert [n.name for n in snapshots.list_snapshots(sink.chk)] == ["lost"]
    assert snapshots.verify(sink.chk, "lost").ok and ids_of(f"{to}/data") == list(range(40))


def test_a_registration_of_unknown_outcome_keeps_the_copy_while_the_registry_is_unreadable(
    sink, tmp_path, monkeypatch
):
    to = tmp_path / "unknown"
    _lose_registration_reply(monkeypatch, TimeoutError("reply lost (injected)"), 100)
    with pytest.raises(IndeterminateCommitError, match="export 'unknown' .* The copy is kept"):
        snapshots.export(sink.chk, "unknown", str(to))
    monkeypatch.undo()
    assert [n.name for n in snapshots.list_snapshots(sink.chk)] == ["unknown"]
    assert snapshots.verify(sink.chk, "unknown").ok


def test_ctrl_c_as_the_registration_lands_keeps_the_copy(sink, tmp_path, monkeypatch):
    to = tmp_path / "ctrlc"
    _lose_registration_reply(monkeypatch, KeyboardInterrupt(), 0)
    with pytest.raises(KeyboardInterrupt):
        snapshots.export(sink.chk, "ctrlc", str(to))
    monkeypatch.undo()
    assert [n.name for n in snapshots.list_snapshots(sink.chk)] == ["ctrlc"]
    assert snapshots.verify(sink.chk, "ctrlc").ok and ids_of(f"{to}/data") == list(range(40))


def test_a_registration_that_never_landed_removes_the_copy_with_the_exports_own_error(
    sink, tmp_path, monkeypatch
):
    to = tmp_path / "never"
    _lose_registration_reply(monkeypatch, TimeoutError("no reply (injected)"), 0, lands=False)
    with pytest.raises(TxnError) as failed:
        snapshots.export(sink.chk, "never", str(to))
    monkeypatch.undo()
    message = str(failed.value)
    assert "export 'never'" in message and "nothing was registered" in message, message
    assert "phase 2" not in message and "batch" not in message, message
    assert snapshots.list_snapshots(sink.chk) == [] and not to.exists()


def test_a_failed_export_removes_its_own_partial_copy(sink, tmp_path, monkeypatch):
    to = tmp_path / "f"
    copy, n = copying._copy, [0]

    def failing_copy(*a):
        n[0] += 1
        if n[0] == 3:
            raise OSError("disk full (injected)")
        return copy(*a)

    monkeypatch.setattr(copying, "_copy", failing_copy)
    with pytest.raises(OSError, match="disk full"):
        snapshots.export(sink.chk, "f", str(to))
    assert not to.exists() and snapshots.list_snapshots(sink.chk) == []
    monkeypatch.setattr(copying, "_copy", copy)
    assert snapshots.export(sink.chk, "f", str(to)).details["rows"] == 40
    assert snapshots.verify(sink.chk, "f").ok


def test_exports_are_no_open_attempts_and_a_failed_export_withdraws_its_id(
    sink, tmp_path, capsys, monkeypatch
):
    """Trial 23 bugs A' and D: a registered export's id is not an unfinished batch; an
    export running is shown as an export; one that fails (any error) withdraws its id,
    and the command says so in one line, exit 2, JSON under --json."""
    from deltalake.exceptions import DeltaError

    to, go = tmp_path / "running", tmp_path / "go"
    running = _paused_export(sink.chk, "running", to, go)  # copied, about to register
    try:
        code, out, _ = run_cli(capsys, "status", sink.chk, "--json")
        doc = json.loads(out)
        assert code == 0 and doc["open_attempts"] == [] and len(doc["open_exports"]) == 1
        code, out, _ = run_cli(capsys, "status", sink.chk)
        assert out.startswith(f"sink {sink.sink_id}: healthy, with an export running or left")
        assert "allocated by an export that has not registered yet" in out
        assert "unfinished: snapshot" not in out and "a batch of" not in out, out
        go.touch()
        out, err = running.communicate(timeout=120)
    finally:
        running.kill()
    assert running.returncode == 0, out + err[-2000:]

    def failing_copy(*a):
        raise DeltaError("Kernel error: injected")

    monkeypatch.setattr(copying, "_copy", failing_copy)
    bad = tmp_path / "bad"
    code, out, err = run_cli(capsys, "snapshots", "export", sink.chk, "bad", "--to", bad, "--json")
    assert code == 2 and json.loads(out)["type"] == "TxnError", out
    assert "pyspark-txn: error: export 'bad'" in err and "DeltaError" in err
    assert not bad.exists() and [n.name for n in snapshots.list_snapshots(sink.chk)] == ["running"]
    state = sink.handle().load()
    assert max(state.allocations) in state.abandoned  # the failed export's id, withdrawn
    code, out, _ = run_cli(capsys, "status", sink.chk)
    assert code == 0 and out.splitlines()[0] == f"sink {sink.sink_id}: healthy", out
    assert "abandon" not in out and out.splitlines()[1].startswith("  last batch 3"), out
    doc = json.loads(run_cli(capsys, "status", sink.chk, "--json")[1])
    assert doc["open_attempts"] == [] and doc["open_exports"] == []


def test_export_to_a_localhost_file_uri_writes_the_absolute_path(sink, tmp_path, monkeypatch):
    """Trial 23 bug B: file://localhost/abs was written to ./localhost/abs."""
    monkeypatch.chdir(tmp_path)
    to = tmp_path / "lh"
    named = snapshots.export(sink.chk, "lh", f"file://localhost{to}")
    assert named.location == str(to) and ids_of(f"{to}/data") == list(range(40))
    assert not (tmp_path / "localhost").exists()
    with pytest.raises(ConfigError, match="--to='file://otherhost/x': a file:// URI of host"):
        snapshots.export(sink.chk, "oh", "file://otherhost/x")
    for to in (f"file://{tmp_path}/p%20q", f"file:///{tmp_path}/p%20q"):
        with pytest.raises(ConfigError, match="'%' cannot be used in a location"):
            snapshots.export(sink.chk, "pct", to)
    assert [n.name for n in snapshots.list_snapshots(sink.chk)] == ["lh"]
    assert not (tmp_path / "p%20q").exists() and not (tmp_path / "p q").exists()
