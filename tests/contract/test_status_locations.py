"""``pyspark-txn status`` on the locations that are not a running record-table sink
(issue 34 item 12): a ``mode=light`` checkpoint, a checkpoint made by ``snapshots
prepare-query`` or ``backups restore`` before its first start, and a file. Sinks are
driven without Spark (SinkDriver, the light committer); Spark's checkpoint files are
written as Spark writes them. tests/spark/test_status_light.py runs light queries."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid

import pyarrow as pa
import pytest
from deltalake import DeltaTable
from support import run_cli_process
from test_admin import SCHEMA, SinkDriver, run_cli

from pyspark_txn import snapshots
from pyspark_txn.operations import backups
from pyspark_txn.sinks.delta import DeltaSinkOptions
from pyspark_txn.sinks.light import LIGHT_SNAPSHOT_ID
from pyspark_txn.sinks.staging import stage_partition

# --- Spark's checkpoint files, as Spark writes them ------------------------------------


def spark_planned(chk: str, batch: int, *, at_ms: int | None = None) -> None:
    os.makedirs(os.path.join(chk, "offsets"), exist_ok=True)
    stamp = int(time.time() * 1000) if at_ms is None else at_ms
    with open(os.path.join(chk, "offsets", str(batch)), "w") as f:
        f.write(
            "v1\n"
            + json.dumps({"batchWatermarkMs": 0, "batchTimestampMs": stamp, "conf": {}})
            + "\n"
            + json.dumps({"index": (batch + 1) * 10})
        )


def spark_committed(chk: str, batch: int) -> None:
    os.makedirs(os.path.join(chk, "commits"), exist_ok=True)
    with open(os.path.join(chk, "commits", str(batch)), "w") as f:
        f.write('v1\n{"nextBatchWatermarkMs":0}')


class LightDriver:
    """A ``mode=light`` txn-delta sink driven as Spark drives it: Spark plans the batch
    (offset log), the tasks stage, the light committer commits, Spark logs the commit."""

    def __init__(self, tmp_path, name="l", **options):
        self.target = str(tmp_path / f"table-{name}")
        self.chk = str(tmp_path / f"chk-{name}")
        self.opts = DeltaSinkOptions.parse(
            {"path": self.target, "checkpointLocation": self.chk, "mode": "light", **options}
        ).with_checkpoint_sink_id()  # writes <chk>/pyspark_txn/sink.json, as the sink does
        self.query_id = str(uuid.uuid4())
        with open(os.path.join(self.chk, "metadata"), "w") as f:
            f.write(json.dumps({"id": self.query_id}))

    @property
    def sink_id(self) -> str:
        return self.opts.sink_id

    def plan(self, batch: int, **kw) -> None:
        spark_planned(self.chk, batch, **kw)

    def write(self, batch: int, ids: list[int], *, query_id: str | None = None) -> None:
        """Stage and commit ``batch`` into the table (Spark's commit log not written)."""
        token = uuid.uuid4().hex
        rows = pa.record_batch(
            [pa.array(ids, pa.int64()), pa.array([f"v{i}" for i in ids])], schema=SCHEMA
        )
        handles = stage_partition([rows], self.opts.staging(), LIGHT_SNAPSHOT_ID, token, 0, SCHEMA)
        self.opts.light_committer().commit(
            batch,
            token,
            handles,
            query_id=query_id or self.query_id,
            target_meta=self.opts.target_meta(SCHEMA, None),
        )

    def batch(self, batch: int, ids: list[int]) -> None:
        self.plan(batch)
        self.write(batch, ids)
        spark_committed(self.chk, batch)


@pytest.fixture
def light(tmp_path):
    d = LightDriver(tmp_path)
    d.batch(0, list(range(10)))
    d.batch(1, list(range(10, 20)))
    return d


# --- 1. a light sink ---------------------------------------------------------------


def test_a_healthy_light_sink_is_healthy(light, capsys):
    code, out, err = run_cli(capsys, "status", light.chk, "--target", light.target)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == f"sink {light.sink_id} (mode=light): healthy", out
    assert "last batch 1 committed" in out and "s ago" in out
    assert re.search(r"Spark's checkpoint: batch 1 planned \d+ s ago, batch 1 committed", out)
    assert f"target {light.target}: version 1, holds this sink's batches up to 1" in out
    assert "None" not in out

    code, out, _ = run_cli(capsys, "status", light.chk, "--target", light.target, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["healthy"] is True and doc["mode"] == "light"
    assert doc["sink_id"] == light.sink_id and doc["record_table"] is None
    assert doc["last_batch"] == 1 and doc["target_batch"] == 1 and doc["target_version"] == 1
    assert doc["last_query_id"] == light.query_id == doc["query_id"]
    assert doc["spark_planned_batch"] == 1 and doc["spark_committed_batch"] == 1
    assert 0 <= doc["lag_seconds"] < 600 and doc["problems"] == []
    assert doc["target_uri"] == light.target and doc["started_from"] is None


def test_a_light_sink_without_its_table_shows_spark_s_checkpoint(light, capsys):
    """A light checkpoint names its table in sink.json (status needs no --target); one
    written before it did shows what Spark's checkpoint holds, and is healthy (exit 0),
    not an error."""
    code, out, err = run_cli(capsys, "status", light.chk)
    assert code == 0, err
    assert f"target {light.target}: version 1, holds this sink's batches up to 1" in out
    sink_file = os.path.join(light.chk, "pyspark_txn", "sink.json")
    with open(sink_file) as f:
        kept = json.load(f)
    kept.pop("target")
    with open(sink_file, "w") as f:
        json.dump(kept, f)
    code, out, err = run_cli(capsys, "status", light.chk)
    assert code == 0, err
    assert out.splitlines()[0] == f"sink {light.sink_id} (mode=light): healthy", out
    assert "Spark's checkpoint: batch 1 planned" in out and "batch 1 committed" in out
    assert "--target" in out and "None" not in out
    code, out, _ = run_cli(capsys, "status", light.chk, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["healthy"] is True and doc["target"] is None
    assert doc["spark_committed_batch"] == 1 and doc["last_batch"] is None


def test_a_light_batch_in_flight_is_healthy_and_needs_attention_once_stale(light, capsys):
    light.plan(2)  # Spark planned batch 2; its tasks are writing
    code, out, _ = run_cli(capsys, "status", light.chk, "--target", light.target)
    assert code == 0 and "healthy" in out.splitlines()[0]
    assert "batch 2" in out and "in flight" in out
    # planned an hour ago and still not in the table: the query failed or was stopped
    light.plan(2, at_ms=int(time.time() * 1000) - 3_600_000)
    code, out, _ = run_cli(capsys, "status", light.chk, "--target", light.target)
    assert (
        code == 1 and out.splitlines()[0] == f"sink {light.sink_id} (mode=light): NEEDS ATTENTION"
    )
    assert "problem: Spark planned batch 2" in out and "restart the query" in out
    # the same threshold as an option
    light.plan(2)
    code, out, _ = run_cli(
        capsys, "status", light.chk, "--target", light.target, "--stale-after", "0", "--json"
    )
    doc = json.loads(out)
    assert code == 1 and doc["healthy"] is False and "Spark planned batch 2" in doc["problems"][0]
    # without the table Spark's commit log alone tells the same
    code, out, _ = run_cli(capsys, "status", light.chk, "--stale-after", "0")
    assert code == 1 and "problem: Spark planned batch 2" in out
    # the batch lands in the table; Spark's commit log follows: healthy again
    light.write(2, [20, 21])
    code, out, _ = run_cli(
        capsys, "status", light.chk, "--target", light.target, "--stale-after", "0"
    )
    assert code == 0, out
    spark_committed(light.chk, 2)
    code, out, _ = run_cli(
        capsys, "status", light.chk, "--target", light.target, "--stale-after", "0"
    )
    assert code == 0 and re.search(r"batch 2 planned \d+ s ago, batch 2 committed", out)


def test_a_new_light_sink_before_and_in_its_first_batch(tmp_path, capsys):
    fresh = LightDriver(tmp_path, name="f")  # sink.json written, nothing planned yet
    code, out, _ = run_cli(capsys, "status", fresh.chk, "--target", fresh.target)
    assert code == 0 and "Spark's checkpoint: no batch planned yet" in out, out
    assert f"target {fresh.target}: no table" in out
    fresh.plan(0)
    fresh.write(0, [1, 2])  # in the table; Spark's commit log not written yet
    code, out, _ = run_cli(capsys, "status", fresh.chk, "--target", fresh.target)
    assert code == 0, out
    assert "batch 0 is in the table and Spark has not logged its commit yet" in out


def test_a_light_sink_whose_table_is_gone_or_unreadable_needs_attention(light, capsys):
    moved = light.target + "-moved"
    shutil.move(light.target, moved)
    code, out, _ = run_cli(capsys, "status", light.chk, "--target", light.target)
    assert code == 1 and "NEEDS ATTENTION" in out.splitlines()[0]
    assert f"problem: there is no Delta table at {light.target}" in out
    assert "Spark's commit log says batch 1 is done" in out
    # a table that cannot be read: its log is not a log
    shutil.move(moved, light.target)
    with open(os.path.join(light.target, "_delta_log", "00000000000000000002.json"), "w") as f:
        f.write("not json\n")
    code, out, _ = run_cli(capsys, "status", light.chk, "--target", light.target, "--json")
    doc = json.loads(out)
    assert code == 1 and doc["healthy"] is False and doc["target_error"]


def test_a_light_table_written_by_another_query_or_ahead_of_spark_needs_attention(
    light, tmp_path, capsys
):
    # another checkpoint's query writes as this sink id
    light.plan(2)
    light.write(2, [20], query_id="someone-else")
    spark_committed(light.chk, 2)
    code, out, _ = run_cli(capsys, "status", light.chk, "--target", light.target)
    assert code == 1, out
    assert "written by query someone-else" in out and light.query_id in out

    # Spark's checkpoint is older than the table (a reset or restored checkpoint)
    other = LightDriver(tmp_path, name="m")
    other.batch(0, [1])
    other.batch(1, [2])
    other.batch(2, [3])
    for log in ("offsets", "commits"):
        os.remove(os.path.join(other.chk, log, "2"))
    code, out, _ = run_cli(capsys, "status", other.chk, "--target", other.target)
    assert code == 1 and "the table holds batch 2 of this sink" in out, out
    assert "planned only up to batch 1" in out


def test_commands_that_need_records_still_refuse_a_light_sink(light, capsys):
    for argv in (
        ("records", light.chk),
        ("stuck", light.chk),
        ("verify", light.chk),
        ("snapshots", "export", light.chk, "n", "--to", str(light.chk) + "-x"),
    ):
        code, _, err = run_cli(capsys, *argv)
        assert code == 2 and "runs with mode=light" in err, (argv, err)


def test_a_light_sink_s_sink_option_must_be_its_own(light, capsys):
    code, _, err = run_cli(capsys, "status", light.chk, "--sink", "other")
    assert code == 2 and light.sink_id in err and "'other'" in err


# --- 2. a checkpoint made from a snapshot, before its first start ----------------------


@pytest.fixture
def sink(tmp_path):
    s = SinkDriver(tmp_path)
    for b in range(3):
        s.batch(b, list(range(b * 10, b * 10 + 10)), source_offsets=[{"index": b * 10 + 10}])
    return s


def test_a_prepared_checkpoint_before_its_first_start(sink, tmp_path, capsys):
    snapshots.export(sink.chk, "nightly", str(tmp_path / "exports" / "nightly"))
    chk = str(tmp_path / "new-chk")
    snapshots.prepare_query(sink.chk, "nightly", chk, str(tmp_path / "new-table"))
    code, out, err = run_cli(capsys, "status", chk)
    assert code == 0, err
    assert out.splitlines()[0] == (
        f"checkpoint {chk}: started from snapshot 'nightly' of {sink.chk}, not started yet: "
        "next batch 3"
    ), out
    assert "Spark's checkpoint: batch 2 planned, batch 2 committed" in out
    assert "None" not in out and "no record table" not in out
    code, out, _ = run_cli(capsys, "status", chk, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["healthy"] is True and doc["state"] == "not_started"
    assert doc["next_batch"] == 3 and doc["sink_id"] is None
    started = doc["started_from"]
    assert started["name"] == "nightly" and started["from"] == sink.chk
    assert started["batch_id"] == 2 and doc["problems"] == []

    # the commands that read records say the same, not "no record table"
    for argv in (("snapshots", "list", chk), ("records", chk), ("stuck", chk)):
        code, _, err = run_cli(capsys, *argv)
        assert code == 2, argv
        assert f"started from snapshot 'nightly' of {sink.chk}" in err, (argv, err)
        assert "not started yet: next batch 3" in err and "no record table at" not in err


def test_a_restored_checkpoint_names_its_backup(sink, tmp_path, capsys):
    to, into = str(tmp_path / "backups"), str(tmp_path / "restored")
    backups.take(4, [sink.chk], to)
    (restored,) = backups.restore(4, to, into)
    chk = restored.checkpoint
    path = os.path.join(chk, "pyspark_txn", "started_from.json")
    with open(path) as f:
        started = json.load(f)
    # with or without the backup's id in started_from.json (older restores lack it)
    started.pop("backup", None)
    with open(path, "w") as f:
        json.dump(started, f)
    code, out, _ = run_cli(capsys, "status", chk)
    assert code == 0, out
    assert out.splitlines()[0] == (
        f"checkpoint {chk}: started from snapshot {started['name']!r} of {sink.chk}, not "
        "started yet: next batch 3"
    ), out
    with open(path, "w") as f:
        json.dump({**started, "backup": {"backup_id": 4, "to": to}}, f)
    code, out, _ = run_cli(capsys, "status", chk)
    assert code == 0 and out.splitlines()[0] == (
        f"checkpoint {chk}: restored from backup 4 (in {to}), not started yet: next batch 3"
    ), out
    code, out, _ = run_cli(capsys, "status", chk, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["started_from"]["backup"] == {"backup_id": 4, "to": to}
    code, _, err = run_cli(capsys, "snapshots", "list", chk)
    assert code == 2 and "restored from backup 4 (in " in err and "next batch 3" in err


def test_a_prepared_checkpoint_once_started_shows_where_it_came_from(sink, tmp_path, capsys):
    snapshots.export(sink.chk, "nightly", str(tmp_path / "exports" / "nightly"))
    chk, table = str(tmp_path / "chk-new"), str(tmp_path / "table-new")
    snapshots.prepare_query(sink.chk, "nightly", chk, table)
    driver = SinkDriver(tmp_path, name="new")  # the started query: a new sink there
    assert (driver.chk, driver.target) == (chk, table)
    driver.batch(3, [100, 101])
    code, out, _ = run_cli(capsys, "status", chk)
    assert code == 0 and out.splitlines()[0] == f"sink {driver.sink_id}: healthy", out
    assert f"started from snapshot 'nightly' of {sink.chk} at batch 2" in out
    doc = json.loads(run_cli(capsys, "status", chk, "--json")[1])
    assert doc["started_from"]["name"] == "nightly" and doc["mode"] == "snapshots"


def test_a_half_written_prepared_checkpoint_needs_attention(sink, tmp_path, capsys):
    snapshots.export(sink.chk, "nightly", str(tmp_path / "exports" / "nightly"))
    chk = str(tmp_path / "new-chk")
    snapshots.prepare_query(sink.chk, "nightly", chk, str(tmp_path / "new-table"))
    shutil.rmtree(os.path.join(chk, "commits"))  # killed before Spark's commit log
    code, out, _ = run_cli(capsys, "status", chk)
    assert code == 1 and "NEEDS ATTENTION" in out.splitlines()[0], out
    assert "problem: Spark's commit log has no batch 2" in out


# --- 3. a file -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ("status", "{loc}"),
        ("status", "{loc}", "--json"),
        ("records", "{loc}"),
        ("stuck", "{loc}"),
        ("verify", "{loc}"),
        ("abandon", "{loc}", "--snapshot", "1", "--yes"),
        ("snapshots", "list", "{loc}"),
        ("snapshots", "export", "{loc}", "n", "--to", "{tmp}/x"),
        ("backups", "take", "{loc}", "--to", "{tmp}/backups"),
    ],
)
@pytest.mark.parametrize("where", ["cfg.json", "cfg.json/below"])
def test_a_file_is_named_as_a_file(tmp_path, capsys, argv, where):
    cfg = tmp_path / "cfg.json"
    cfg.write_text("{}")
    loc = str(tmp_path / where)
    code, out, err = run_cli(capsys, *(a.format(loc=loc, tmp=tmp_path) for a in argv))
    assert code == 2, (out, err)
    (line,) = err.strip().splitlines()
    assert "is a file, not a checkpoint location or record table" in line, line
    assert str(cfg) in line and "OSError" not in line and "Not a directory" not in line
    if "--json" in argv:
        assert json.loads(out)["type"] == "ConfigError"
    assert not os.path.exists(tmp_path / "backups") and not os.path.exists(tmp_path / "x")


def test_a_missing_folder_still_says_no_record_table(tmp_path, capsys):
    code, _, err = run_cli(capsys, "status", tmp_path / "nowhere")
    assert code == 2 and "no record table at" in err


def test_the_light_driver_writes_stamped_commits(light):
    """The helper's own check: what the light tests read is what the light sink writes."""
    dt = DeltaTable(light.target)
    assert dt.transaction_version(light.sink_id) == 1
    assert {h.get("pyspark_txn.mode") for h in dt.history() if "pyspark_txn.sink_id" in h} == {
        "light"
    }


def test_an_object_store_file_is_named_as_a_file(s3):
    """On a store the check costs a request, so it is made only where no record table
    was found; a missing key still gets the "no record table" line. (In a process of
    its own: delta-rs holds the GIL while it waits for the in-process moto server.)"""
    s3.client.put_object(Bucket="cost", Key="status-file/cfg.json", Body=b"{}")
    options = json.dumps(s3.options)
    for argv in (("status",), ("records",), ("snapshots", "list")):
        code, _, err = run_cli_process(
            *argv, "s3://cost/status-file/cfg.json", "--storage-options", options
        )
        assert code == 2, err
        (line,) = err.strip().splitlines()
        assert "s3://cost/status-file/cfg.json is a file, not a checkpoint location" in line
    code, _, err = run_cli_process(
        "status", "s3://cost/status-file/nothing", "--storage-options", options
    )
    assert code == 2 and "no record table at s3://cost/status-file/nothing" in err
