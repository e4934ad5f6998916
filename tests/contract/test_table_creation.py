"""Two sinks whose first batches create the same new Delta table at once (issue 23, 4).

Creating a table is a race one writer wins: the winner's commit is version 0, the
loser reloads and appends to it. Real delta-rs tables in temp dirs, the real
protocol driven without Spark (tests/contract/test_admin.SinkDriver), and two
processes released together for the real race.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow as pa
from deltalake import DeltaTable
from test_admin import SCHEMA, SinkDriver

from pyspark_txn import admin
from pyspark_txn.sinks.delta_target import schema_to_b64
from pyspark_txn.sinks.staging import stage_partition


def _log_actions(table: str) -> list[dict]:
    log = Path(table, "_delta_log")
    return [
        json.loads(line)
        for f in sorted(log.glob("*.json"))
        for line in f.read_text().splitlines()
        if line.strip()
    ]


def _parquet_files(table: str) -> set[str]:
    return {
        os.path.relpath(os.path.join(d, f), table)
        for d, _, files in os.walk(table)
        if "_delta_log" not in d
        for f in files
        if f.endswith(".parquet")
    }


def _check_one_table_holding_both(table: str, *drivers: SinkDriver, rows: int) -> None:
    actions = _log_actions(table)
    assert sum("metaData" in a for a in actions) == 1, "the table was created twice"
    dt = DeltaTable(table)
    ids = dt.to_pyarrow_table().column("id").to_pylist()
    assert len(ids) == len(set(ids)) == rows
    for d in drivers:
        assert dt.transaction_version(d.sink_id) == 0
        assert admin.stuck_snapshots(admin.open_sink(d.chk)) == []  # nothing to settle
    # no leftovers: every parquet file in the folder is in the table
    assert {os.path.relpath(u, table) for u in dt.file_uris()} == _parquet_files(table)


def test_a_sink_that_staged_beside_another_new_sink_may_still_create_the_table(tmp_path):
    """Two first batches staged side by side into a path with no table yet: the staged
    files of the other sink are not "files we do not know", and the sink whose view of
    the path predates the other's creation joins the table instead of creating it again."""
    table = str(tmp_path / "shared")
    a = SinkDriver(tmp_path, "a", path=table)
    b = SinkDriver(tmp_path, "b", path=table)
    b_attempt = _stage(b, range(100, 110))
    a.batch(0, list(range(10)))  # a commits first and creates the table
    # b's writer checks the path while only a's staged files were there (now committed)
    b.opts.target().check_stream_schema(SCHEMA, False)
    # b's phase 2 read "no table" before a created it: it loses the creation race
    target = b.opts.target()
    assert target._write_commit(None, 0, *b_attempt) is not None
    _check_one_table_holding_both(table, a, rows=20)
    assert b.opts.target().committed_batch(b.sink_id) == 0


def test_staged_files_of_another_new_sink_are_not_foreign(tmp_path):
    table = str(tmp_path / "shared")
    a = SinkDriver(tmp_path, "a", path=table)
    b = SinkDriver(tmp_path, "b", path=table)
    _stage(a, range(10))
    b.opts.target().check_stream_schema(SCHEMA, False)  # was: "exists and is not a Delta table"


def _stage(driver: SinkDriver, ids):
    committer = driver.committer()
    snapshot_id, token = committer.allocate()
    ids = list(ids)
    rows = pa.record_batch(
        [pa.array(ids, pa.int64()), pa.array([f"v{i}" for i in ids])], schema=SCHEMA
    )
    handles = stage_partition([rows], driver.opts.staging(), snapshot_id, token, 0, SCHEMA)
    driver.staged = (snapshot_id, token)
    meta = {"uri": driver.opts.path, "arrow_schema": schema_to_b64(SCHEMA), "merge_schema": False}
    return handles, meta, {"query_id": "q", "snapshot_id": snapshot_id, "record_id": "r"}


_RACER = textwrap.dedent(
    """
    import sys, time
    sys.path[:0] = [{tests!r}, {contract!r}]
    from pathlib import Path
    from test_admin import SinkDriver
    tmp, name, table, go = Path(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
    d = SinkDriver(tmp, name, path=table)
    offset = 0 if name == "a" else 1000
    from test_table_creation import _stage
    handles, meta, _ = _stage(d, range(offset, offset + 50))
    committer = d.committer()
    meta.update(committer.target.base())  # base_version None: no table yet
    from pyspark_txn.sinks.delta_target import DeltaTarget
    write = DeltaTarget._write_commit
    def at_once(self, dt, *a):  # both saw no table; both write their commit now
        while time.time() < go:
            pass
        return write(self, dt, *a)
    DeltaTarget._write_commit = at_once
    committer.commit(0, *d.staged, handles, run_id="run-" + name, query_id="query-" + name,
                     target_meta=meta)
    print("DONE", d.sink_id, flush=True)
    """
)


def test_two_processes_committing_first_batches_at_once_create_one_table(tmp_path):
    """The real race, several times: two processes stage their first batch, then commit
    it at the same instant into a path that holds no table yet."""
    here = Path(__file__).parent
    script = _RACER.format(tests=str(here.parent), contract=str(here))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parents[1]), str(here.parent)])}
    for round_ in range(4):
        tmp = tmp_path / f"r{round_}"
        tmp.mkdir()
        table = str(tmp / "shared")
        go = time.time() + 6.0  # both processes are up, staged and recorded by then
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", script, str(tmp), name, table, str(go)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for name in ("a", "b")
        ]
        outs = [p.communicate(timeout=300) for p in procs]
        for p, (out, err) in zip(procs, outs, strict=True):
            assert p.returncode == 0 and "DONE" in out, err[-3000:]
        a = SinkDriver(tmp, "a", path=table)
        b = SinkDriver(tmp, "b", path=table)
        _check_one_table_holding_both(table, a, b, rows=100)


def test_record_tables_created_at_once_are_created_once(tmp_path):
    """Two sinks sharing one record table (option recordTable) start together: two
    threads released by a barrier create it at the same instant, several times."""
    import threading

    from pyspark_txn.state import DeltaEventLog

    for round_ in range(20):
        uri = str(tmp_path / f"records-{round_}")
        barrier, errors = threading.Barrier(2), []

        def create(uri=uri, barrier=barrier, errors=errors):
            barrier.wait()
            try:
                DeltaEventLog(uri).create_if_missing()
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=create) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert sum("metaData" in a for a in _log_actions(uri)) == 1, f"round {round_}"
