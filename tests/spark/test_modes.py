"""Light mode and long-run behaviour of the txn-delta sink, end to end with Spark."""

import os

import pytest
from deltalake import DeltaTable
from test_sink import drop_commit_log

from pyspark_txn.errors import ConfigError
from pyspark_txn.sinks.delta import DeltaSinkOptions
from pyspark_txn.sinks.staging import STAGING_ROOT

pytestmark = pytest.mark.spark


def test_light_mode_writes_every_row_once_and_keeps_no_records(pipeline):
    assert pipeline.run(mode="light") is None
    pipeline.assert_exactly_once()
    pipeline.assert_no_orphans()
    assert not os.path.exists(os.path.join(pipeline.checkpoint, "pyspark_txn", "records"))
    dt = DeltaTable(pipeline.target)
    assert dt.version() == 4  # one commit per batch, nothing else
    history = dt.history()
    assert {h.get("pyspark_txn.mode") for h in history} == {"light"}
    # no staging markers are left behind by finished batches
    staged = os.path.join(pipeline.target, STAGING_ROOT)
    assert not os.path.exists(staged) or not any(
        f for _, _, files in os.walk(staged) for f in files
    )


def test_light_mode_replay_is_a_no_op(pipeline):
    assert pipeline.run(mode="light") is None
    version = DeltaTable(pipeline.target).version()
    drop_commit_log(pipeline.checkpoint, 4)  # Spark runs batch 4 again
    assert pipeline.run(mode="light") is None
    assert DeltaTable(pipeline.target).version() == version
    pipeline.assert_exactly_once()
    pipeline.assert_no_orphans()


def test_light_mode_refuses_a_new_checkpoint_writing_as_a_sink_id_the_table_has(pipeline):
    """Light mode has no record table: a new query (a new or reset checkpoint) with the
    sinkId of batches already in the table would drop its own batches up to theirs as
    "already written". The commit of the sink's latest batch names its query: refused."""
    assert pipeline.run(mode="light", sinkId="shared") is None
    version = DeltaTable(pipeline.target).version()
    pipeline.checkpoint = pipeline.checkpoint + "-new"
    failure = pipeline.run(mode="light", sinkId="shared")
    assert failure is not None and "CheckpointMismatchError" in str(failure), str(failure)[:2000]
    assert "its own sinkId" in str(failure)
    assert DeltaTable(pipeline.target).version() == version  # nothing written, nothing dropped


@pytest.mark.parametrize("fault", ["after_phase2:raise@batch=1", "after_commit:raise@batch=2"])
def test_light_mode_failure_after_its_commit_keeps_the_files(pipeline, fault):
    """Spark aborts a batch whose commit landed and then failed: the table holds the
    batch, so its files must stay (rolling them back lost committed rows)."""
    failure = pipeline.run(fault, mode="light")
    assert failure is not None and "injected fault" in str(failure)
    assert pipeline.run(mode="light") is None
    pipeline.assert_exactly_once()
    pipeline.assert_no_orphans()


def test_a_checkpoint_keeps_its_mode(pipeline):
    pipeline.total = 2000
    assert pipeline.run() is None
    pipeline.total = 3000
    error = pipeline.run(mode="light")
    assert error is not None and "a checkpoint keeps its mode" in str(error)

    other = type(pipeline)(pipeline.spark, pipeline.base / "light", total=2000)
    assert other.run(mode="light") is None
    other.total = 3000
    error = other.run()
    assert error is not None and "ran with mode=light" in str(error)
    other.assert_exactly_once(2000)
    # refused before anything was written: light mode goes on where it stopped
    assert not os.path.exists(os.path.join(other.checkpoint, "pyspark_txn", "records"))
    assert other.run(mode="light") is None
    other.assert_exactly_once(3000)

    # a record table outside the checkpoint does not hide the mode
    custom = type(pipeline)(pipeline.spark, pipeline.base / "custom", total=1000)
    assert custom.run(recordTable=str(pipeline.base / "records-elsewhere")) is None
    custom.total = 2000
    error = custom.run(mode="light")
    assert error is not None and "ran with mode=snapshots" in str(error)


def test_mode_options_are_checked_before_anything_runs():
    base = {"path": "/tmp/t", "checkpointLocation": "/tmp/c"}
    with pytest.raises(ConfigError, match="option mode='fast': expected one of snapshots, light"):
        DeltaSinkOptions.parse({**base, "mode": "fast"})
    with pytest.raises(ConfigError, match="option recordTable applies to mode=snapshots only"):
        DeltaSinkOptions.parse({**base, "mode": "light", "recordTable": "/tmp/r"})
    with pytest.raises(ConfigError, match="retainSnapshots='0': expected a positive integer"):
        DeltaSinkOptions.parse({**base, "retainSnapshots": "0"})
    assert DeltaSinkOptions.parse({**base, "mode": "LIGHT"}).light


def test_long_run_keeps_the_record_table_bounded(pipeline):
    """Many small batches with a tiny retention: the history is summarized, older
    events are deleted, and every row is still there once."""
    # a summary every 2 * 2 + 64 events; a batch appends about one (its record: the
    # planner takes its id from a lease, docs/protocol.md "Leases")
    pipeline.total, pipeline.per_batch = 900, 10
    assert pipeline.run(retainSnapshots="2") is None
    pipeline.assert_exactly_once()
    pipeline.assert_no_orphans()
    store = pipeline.record_store()
    events = store.events(pipeline.sink_state().sink_id)
    assert events[0].kind.value == "summary" and events[0].seq > 0
    assert len(events) < 2 * 2 + 64 + 8
    state = pipeline.sink_state()
    # kept: records within 64 ids of the last, and every event since the summary
    assert state.last_record.batch_id == 89 and len(state.records) <= 64 + 2 * 2 + 64 + 2
