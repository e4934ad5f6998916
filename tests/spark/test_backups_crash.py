"""Backups under crashes: a killed query, a killed taker, a killed restore, a VACUUMed part."""

import pytest
from deltalake import DeltaTable
from pipeline_checks import run_to_end
from support import run_cli_process
from test_backups import _link, _rows

from pyspark_txn import backups
from pyspark_txn.errors import ConfigError
from pyspark_txn.operations.backups import FAULT_ENV, BackupError

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def _source(spark, chk, target, total, faults=None):
    reader = spark.readStream.format("txn-sequence")
    for k, v in {"rowsPerBatch": 50, "totalRows": total, "width": 1}.items():
        reader = reader.option(k, v)
    w = reader.load().writeStream.format("txn-delta")
    if faults:
        w = w.option("faultInjection", faults)
    return w.option("checkpointLocation", chk).option("path", target)


def _chain(spark, chks, paths, total, links=True):
    run_to_end(_source(spark, chks[0], paths[0], total))
    if links:
        run_to_end(_link(spark, paths[0], chks[1], paths[1]))
        run_to_end(_link(spark, paths[1], chks[2], paths[2]))


def test_killed_query_killed_taker_killed_restore_and_vacuum(spark, tmp_path, fired_faults):
    ref = [str(tmp_path / f"ref{i}") for i in range(3)]
    _chain(spark, [str(tmp_path / f"refchk{i}") for i in range(3)], ref, 400)
    expected = _rows(ref[2])

    chks = [str(tmp_path / f"chk{i}") for i in range(3)]
    paths = [str(tmp_path / f"t{i}") for i in range(3)]
    _chain(spark, chks, paths, 200)
    to = str(tmp_path / "backups")
    reads = {chks[1]: [paths[0]], chks[2]: [paths[1]]}

    # A dies after recording batch 4, before its phase 2: the backup taken now holds
    # A's last *committed* batch, the one B consumed, never the recorded one
    with pytest.raises(Exception):  # noqa: B017 - the query's failure, whatever Spark wraps it in
        run_to_end(_source(spark, chks[0], paths[0], 300, faults="after_record:exit@batch=4"))
    fired_faults.assert_fired("after_record:exit@batch=4")
    st = backups.take(4, chks, to, reads=reads)
    assert st.state == "completed" and st.members[0].batch_id == 3
    assert st.members[0].target_version == st.members[1].source_offsets[0]["version"] - 1
    assert backups.verify(4, to).ok
    _chain(spark, chks, paths, 300, links=False)  # A ran on; B and C lag behind it
    args = [chks[0], chks[1], chks[2], "--to", to]
    args += ["--reads", f"{chks[1]}={paths[0]}", "--reads", f"{chks[2]}={paths[1]}"]

    # the taker dies after its first part (C's, downstream first)
    code, out, err = run_cli_process(
        "backups", "take", "5", *args, env={FAULT_ENV: "exit_after_part"}
    )
    assert code == 86, (out, err)
    st = backups.status(5, to)
    assert [m.state for m in st.members] == ["doesNotExist", "doesNotExist", "completed"]
    assert st.state == "incomplete"
    # a smaller id is refused; the same id resumes and completes, consistently with C's part
    with pytest.raises(ConfigError, match="highest so far in .* is 5"):
        backups.take(4, chks, to, reads={chks[1]: [paths[0]], chks[2]: [paths[1]]})
    st = backups.take(5, chks, to, reads={chks[1]: [paths[0]], chks[2]: [paths[1]]})
    assert st.state == "completed"
    a_part, b_part, _ = st.members
    # A's part is cut at the older version B consumed, not at A's latest
    assert a_part.target_version == b_part.source_offsets[0]["version"] - 1
    assert a_part.target_version < DeltaTable(paths[0]).version()
    assert backups.verify(5, to).ok
    code, out, _ = run_cli_process("backups", "status", "5", "--to", to, "--json")
    assert code == 0 and '"state": "completed"' in out

    # the restore dies after its first member; run again, it finishes
    into = str(tmp_path / "restored")
    code, out, err = run_cli_process(
        "backups",
        "restore",
        "5",
        "--to",
        to,
        "--into",
        into,
        env={FAULT_ENV: "exit_after_restore_part"},
    )
    assert code == 86, (out, err)
    restored = backups.restore(5, to, into, spark=spark)
    new_chks, new_paths = [r.checkpoint for r in restored], [r.path for r in restored]
    _chain(spark, new_chks, new_paths, 400)
    assert _rows(new_paths[2]) == expected

    # A runs on, its table is compacted and vacuumed: B's version of it is gone
    _chain(spark, chks, paths, 400, links=False)
    dt = DeltaTable(paths[0])
    dt.optimize.compact()
    dt.vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)
    with pytest.raises(BackupError, match="VACUUM"):
        backups.take(None, chks, to, reads={chks[1]: [paths[0]], chks[2]: [paths[1]]})
    st = backups.status(6, to)
    assert st.state == "failed" and st.members[0].state == "failed"
    assert "VACUUM" in (st.members[0].reason or "")
    with pytest.raises(ConfigError, match="highest so far in .* is 6"):
        backups.take(6, chks, to, reads={chks[1]: [paths[0]], chks[2]: [paths[1]]})
