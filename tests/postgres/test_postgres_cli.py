"""``pyspark-txn`` on txn-postgres checkpoints, run as a user runs it (a new process, the
password in libpq's ``PGPASSWORD`` or a file), on checkpoints of real Spark queries
into the throwaway PostgreSQL server."""

import json

import pytest
from support import run_cli_process

pytestmark = pytest.mark.spark


def cli(pipeline, *argv, password=True):
    env = {"PGPASSWORD": pipeline.server.password} if password else {}
    code, out, err = run_cli_process(*argv, env=env, unset=("PGPASSWORD",))
    assert pipeline.server.password not in out + err, "the password must never be printed"
    return code, out, err


def stuck_snapshot(pipeline):
    code, out, _ = cli(pipeline, "stuck", pipeline.checkpoint, "--json")
    assert code == 0
    (entry,) = json.loads(out)["stuck"]
    return entry


def prepared(pipeline):
    return [r[0] for r in pipeline.query("SELECT gid FROM pg_prepared_xacts ORDER BY gid")]


def test_a_batch_stuck_after_its_record_then_rolled_back_outside_the_sink(pipeline):
    """Every command on a checkpoint whose batch 1 is recorded but not committed: it can
    still commit, so abandon refuses; once one of its prepared transactions is rolled
    back behind the sink's back it cannot, abandon rolls back the other, and the
    restarted query replays the batch exactly once."""
    chk = pipeline.checkpoint
    assert pipeline.run("after_record:raise@batch=1") is not None
    gids = prepared(pipeline)
    assert len(gids) == 2

    code, out, _ = cli(pipeline, "status", chk)
    assert code == 1 and "NEEDS ATTENTION" in out
    assert f"target PostgreSQL table {pipeline.table} at " in out
    assert "holds this sink's batches up to 0 (pyspark_txn_batches)" in out
    assert "2 prepared transaction(s) of 1 attempt(s) pending" in out
    assert "batch 1, 1000 rows in 2 prepared transactions" in out
    assert "its prepared transactions: 2 prepared, 0 committed, 0 missing" in out
    code, out, _ = cli(pipeline, "status", chk, "--json")
    doc = json.loads(out)
    assert code == 1 and doc["target_kind"] == "postgres" and doc["target_uri"] is None
    assert (doc["last_batch"], doc["target_batch"], doc["staged_txns"]) == (1, 0, 2)
    (entry,) = doc["stuck"]
    assert entry["txn_states"] == dict.fromkeys(gids, "prepared") and not entry["abandonable"]
    sid = entry["snapshot_id"]

    code, out, _ = cli(pipeline, "stuck", chk)
    assert code == 0 and "not abandonable: all 2 of its prepared transactions are still" in out
    code, _, err = cli(pipeline, "abandon", chk, "--snapshot", sid, "--yes")
    assert code == 2 and "can still commit: restart the query" in err
    assert prepared(pipeline) == gids
    code, out, _ = cli(pipeline, "records", chk)
    assert code == 0 and f"target: PostgreSQL table {pipeline.table} at " in out
    assert "2 prepared transactions, offsets" in out and "files" not in out
    code, out, _ = cli(pipeline, "verify", chk)
    assert code == 0 and "2 live snapshot records, 4 prepared transactions" in out
    assert out.rstrip().endswith("OK")

    with pipeline.server.connect() as conn:
        conn.execute(f"ROLLBACK PREPARED '{gids[0]}'")
    code, out, _ = cli(pipeline, "verify", chk)
    assert code == 1 and f"error: snapshot {sid}: {gids[0]}: neither prepared nor" in out
    code, out, _ = cli(pipeline, "stuck", chk)
    assert "1 prepared, 0 committed, 1 missing" in out
    assert f"pyspark-txn abandon {chk} --snapshot {sid}" in out
    code, out, _ = cli(pipeline, "abandon", chk, "--snapshot", sid, "--yes")
    assert code == 0 and f"snapshot {sid} of sink" in out and "is abandoned" in out
    assert "prepared transactions are rolled back" in out
    pipeline.assert_nothing_prepared()
    code, out, _ = cli(pipeline, "status", chk)
    assert code == 0 and "healthy" in out and "last batch 0 " in out

    assert pipeline.run() is None
    pipeline.assert_exactly_once()
    pipeline.assert_nothing_prepared()
    pipeline.assert_records_consistent()
    code, out, _ = cli(pipeline, "verify", chk)
    assert code == 0 and "5 live snapshot records, 10 prepared transactions" in out
    code, out, _ = cli(pipeline, "status", chk)
    assert code == 0 and "holds this sink's batches up to 4" in out


def test_a_half_committed_batch_cannot_be_abandoned_and_connections_are_explicit(
    pipeline, tmp_path
):
    """Phase 2 of batch 1 stopped between its two COMMIT PREPARED: abandoning would
    replay rows already in the table, so it is refused and the restart finishes it.
    The database comes from the records (no password kept) or --url; the password from
    PGPASSWORD or --password-file; Delta-only commands are refused by name."""
    chk, server = pipeline.checkpoint, pipeline.server
    assert pipeline.run("mid_phase2:raise@batch=1") is not None
    entry = stuck_snapshot(pipeline)
    assert sorted(entry["txn_states"].values()) == ["committed", "prepared"]
    code, _, err = cli(pipeline, "abandon", chk, "--snapshot", entry["snapshot_id"], "--yes")
    assert code == 2 and "phase 2 has begun: 1 of its 2 prepared transactions are committed" in err

    code, out, _ = cli(pipeline, "status", chk, password=False)
    assert code == 1 and "cannot be read: ConfigError" in out and "PGPASSWORD" in out
    pw = tmp_path / "pw"
    pw.write_text(server.password + "\n")
    code, out, _ = cli(pipeline, "stuck", chk, "--password-file", pw, password=False)
    assert code == 0 and "1 prepared, 1 committed, 0 missing" in out
    code, out, _ = cli(pipeline, "status", chk, "--url", server.url, password=False)
    assert code == 1 and "password=***" in out and "1 attempt(s) pending" in out
    elsewhere = server.url_without_password.replace(str(server.port), str(_closed_port()))
    code, _, err = cli(pipeline, "stuck", chk, "--url", elsewhere)
    assert code == 2 and "cannot be reached" in err
    code, _, err = cli(pipeline, "snapshots", "export", chk, "s1", "--to", tmp_path / "s1")
    assert code == 2 and "snapshots export works on txn-delta sinks only" in err

    assert pipeline.run() is None
    pipeline.assert_exactly_once()
    pipeline.assert_nothing_prepared()
    code, out, _ = cli(pipeline, "stuck", chk)
    assert code == 0 and "no stuck snapshots" in out


def _closed_port():
    from pg_server import free_port

    return free_port()
