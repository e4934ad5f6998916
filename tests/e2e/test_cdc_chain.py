"""The CDC chain of issue 35 (tests/e2e/chain_driver.py): bronze (change records,
appended) -> silver (upserts by key, sequenceBy, deleteWhen, change data feed on) ->
gold (silver's change feed aggregated per bucket, update mode through
``delta_batch_writer`` with keys), exactly once:

1. run by a driver process killed with SIGKILL at random moments (a batch of at least one
   query in flight), restarted, and run to the end: silver equals the change log applied
   in sequence order, gold its aggregate, every batch of every query in exactly one
   commit, ``verify`` clean for all three sinks (bounded: 2 kills; ``slow``: 8); a backup
   of it afterwards is an exact cut;
2. consistent backups taken while the chain runs (processing-time triggers), with
   ``reads``: every cut exact, each part exactly what derives from the part upstream,
   ``verify`` OK; then every checkpoint, record table and table deleted and the backups
   restored into new locations and in place, run to the end: equal to the oracle (gold,
   stateful, is restored as a new query that recomputes its state);
3. named snapshots of silver at committed batches (``request_export`` at the next commit,
   ``export`` at a batch) verify, and a query prepared from one runs on to the oracle,
   its change feed read on by a new gold.
"""

from __future__ import annotations

import itertools
import os
import random
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import chain_driver as chains
import pytest
from chain_driver import NAMES, Chain
from deltalake import DeltaTable
from processes import committed_batches, kill_group, open_batch, start_group, wait_until

import pyspark_txn
from pyspark_txn import backups, snapshots
from pyspark_txn.state.records import NamedSnapshot

pytestmark = [pytest.mark.spark]

DRIVER = str(Path(__file__).with_name("chain_driver.py"))
_LOGS = itertools.count()


@pytest.fixture(scope="module")
def spark():
    session = pyspark_txn.local_session("pyspark-txn-e2e-cdc-chain")
    yield session
    session.stop()


# --- 1. kill -9 at random moments ------------------------------------------------------------


def start_driver(base: Path, total: int, per_batch: int):
    log_path = base / f"chain-driver-{next(_LOGS)}.log"
    return start_group([sys.executable, DRIVER, str(base), str(total), str(per_batch)], log_path)


def output(proc) -> str:
    return proc.log_path.read_text(errors="replace")


def finished_batches(chain: Chain) -> int:
    return sum(len(committed_batches(Path(chk))) for chk in chain.checkpoints)


def running(chain: Chain) -> list[str]:
    """The queries with a batch Spark planned and has not finished."""
    return [n for n in NAMES if open_batch(Path(chain.chks[n])) is not None]


def kill_at_a_random_moment(proc, chain: Chain, rng: random.Random) -> list[str]:
    """Once the chain has finished 1-4 more batches (any query), at a random moment
    while a batch of at least one query runs: the driver's group is frozen (SIGSTOP),
    its checkpoints show a planned, unfinished batch, and it is killed (SIGKILL);
    otherwise it is thawed and a later moment tried. Returns the queries it hit."""
    target = finished_batches(chain) + rng.randint(1, 4)
    wait_until(proc, "more finished batches", lambda: finished_batches(chain) >= target)
    while True:
        time.sleep(rng.uniform(0.0, 0.8))
        os.killpg(proc.pid, signal.SIGSTOP)
        hit = running(chain)
        if hit:
            kill_group(proc)
            return hit
        os.killpg(proc.pid, signal.SIGCONT)
        wait_until(proc, "a running batch", lambda: running(chain) or None)


def run_killed(base: Path, kills: int, total: int, seed: int) -> Chain:
    """The chain's driver started ``kills`` times, each killed at a random moment, then
    run to the end; returns the chain."""
    per_batch = 40
    rng = random.Random(seed)
    chain = Chain.under(base)
    hits = []
    for _ in range(kills):
        proc = start_driver(base, total, per_batch)
        try:
            hits.append(kill_at_a_random_moment(proc, chain, rng))
        finally:
            kill_group(proc)  # killed already, or what a failed wait leaves running
        chains.check_consistent(chain)  # nothing twice, even right after a kill
    assert all(hits), hits
    final = start_driver(base, total, per_batch)
    try:
        final.wait(timeout=600)
    finally:
        kill_group(final)  # whatever is left of its group (a hang: the test fails below)
    assert final.returncode == 0, output(final)[-3000:]
    assert chains.finished(chain, total)
    return chain


KILLED_TOTAL = 400
SEED = int(os.environ.get("PYSPARK_TXN_KILL_SEED", "35"))


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> Chain:
    """The notebook's chain (gold with a total and a row count) killed twice."""
    return run_killed(tmp_path_factory.mktemp("killed"), 2, KILLED_TOTAL, SEED)


@pytest.mark.chaos
def test_the_chain_killed_at_random_moments_applies_every_change_once(killed):
    chains.check_chain(killed, KILLED_TOTAL)


@pytest.mark.chaos
@pytest.mark.slow
@pytest.mark.timeout(2400)  # nine driver starts
def test_the_chain_killed_many_times_applies_every_change_once(tmp_path):
    chains.check_chain(run_killed(tmp_path, 8, 1500, SEED + 1), 1500)


def test_a_backup_of_the_killed_chain_is_an_exact_cut_and_verifies(killed, tmp_path):
    to = str(tmp_path / "backups")
    st = backups.take(None, killed.checkpoints, to, reads=killed.reads)
    check_cut(st, killed, to)
    # the chain had run to the end: the cut is the end
    assert chains.silver_rows(f"{st.members[1].location}/data") == chains.silver_rows(
        killed.tables["silver"]
    )


# --- 2. and 3.: the chain side by side, backed up and exported while it runs ---------------

HOT_TOTAL, HOT_PER_BATCH, HOT_RATE = 480, 30, 40  # rows, rows a batch, rows a second


@dataclass
class Hot:
    base: Path
    chain: Chain
    to: str  # the backups' location
    taken: list[backups.BackupStatus]  # while the chain ran
    requested: NamedSnapshot  # silver at the batch after the request (request_export)
    exported: NamedSnapshot  # silver at its first batch that wrote rows (export batch=)
    last: dict[str, int]  # each query's last batch at the end


def _batches(chain: Chain, name: str) -> int:
    return len(committed_batches(Path(chain.chks[name])))


@pytest.fixture(scope="module")
def hot(spark, tmp_path_factory) -> Hot:
    """The chain run side by side with processing-time triggers (bronze paced by
    ``rowsPerSecond``) to the end; meanwhile a named snapshot of silver is requested at
    its next commit and two backups are taken."""
    base = tmp_path_factory.mktemp("hot")
    chain = Chain.under(base)
    to = str(base / "backups")
    deadline = time.monotonic() + 600
    queries = chains.start_side_by_side(
        spark, chain, HOT_TOTAL, HOT_PER_BATCH, 600, rows_per_second=HOT_RATE
    )

    def wait_for(check) -> None:
        while not check():
            chains.check_running(queries, deadline)
            time.sleep(0.2)

    def gold_moved_on(batches: int) -> bool:
        gold = Path(chain.tables["gold"], "_delta_log").is_dir()
        return gold and _batches(chain, "gold") >= batches

    try:
        wait_for(lambda: _batches(chain, "silver") >= 1)
        snapshots.request_export(
            chain.chks["silver"], "at-next-commit", str(base / "exports" / "at-next-commit")
        )
        taken = []
        for _ in range(2):  # each once gold finished one more batch (its table exists)
            want = _batches(chain, "gold") + 1
            wait_for(lambda want=want: gold_moved_on(want) or chains.finished(chain, HOT_TOTAL))
            taken.append(backups.take(None, chain.checkpoints, to, reads=chain.reads, spark=spark))
        requested = snapshots.wait_for_export(chain.chks["silver"], "at-next-commit", timeout=300)
        wait_for(lambda: chains.finished(chain, HOT_TOTAL))
    finally:
        for q in queries:
            q.stop()
    records = pyspark_txn.admin.open_sink(chain.chks["silver"]).load().records.values()
    first = min(r.batch_id for r in records if r.rows > 0)
    exported = snapshots.export(
        chain.chks["silver"], "at-batch", str(base / "exports" / "at-batch"), batch=first
    )
    last = {n: _batches(chain, n) - 1 for n in NAMES}
    return Hot(base, chain, to, taken, requested, exported, last)


def test_the_chain_run_side_by_side_equals_the_oracle(hot):
    chains.check_chain(hot.chain, HOT_TOTAL)


def _table_id(table: str) -> str:
    return str(DeltaTable(table).metadata().id)


def check_cut(st: backups.BackupStatus, chain: Chain, to: str) -> None:
    """The backup is completed, its cut exact, each part exactly what derives from the
    part upstream, and it verifies."""
    assert st.state == "completed", st
    b, s, g = st.members
    # the cut: each downstream part consumed exactly its upstream part's version
    for down, up, name, feed in ((s, b, "bronze", False), (g, s, "silver", True)):
        (offset,) = down.source_offsets
        assert offset["version"] == up.target_version + 1, (down, up)
        assert offset["index"] == 0 and not offset["snapshot"], offset
        assert bool(offset.get("changeFeed")) is feed, offset
        assert offset["tableId"] == _table_id(chain.tables[name])
    # what it means: each part holds exactly what derives from the part upstream
    ids = chains.bronze_ids(f"{b.location}/data")
    assert ids == list(range(len(ids))) and ids
    silver = chains.expected_silver(len(ids))
    assert chains.silver_rows(f"{s.location}/data") == silver
    gold = chains.gold_rows(f"{g.location}/data")
    assert chains.nonzero(gold) == chains.nonzero(chains.aggregate(silver))
    check = backups.verify(st.backup_id, to)
    assert check.ok, check.problems


def test_backups_of_the_running_chain_are_exact_cuts_and_verify(hot):
    assert [t.backup_id for t in hot.taken] == [1, 2]
    for st in hot.taken:
        check_cut(st, hot.chain, hot.to)
    first, second = hot.taken
    # taken while the chain ran, the second later than the first
    assert first.members[0].batch_id < hot.last["bronze"], (first, hot.last)
    for a, b in zip(first.members, second.members, strict=True):
        assert a.batch_id <= b.batch_id
    assert second.members[2].batch_id > first.members[2].batch_id


def test_named_snapshots_of_silver_at_committed_batches_verify(hot):
    chain = hot.chain
    assert hot.requested.batch_id < hot.last["silver"]  # requested while it ran
    for entry in (hot.requested, hot.exported):
        check = snapshots.verify(chain.chks["silver"], entry.name)
        assert check.ok, check.problems
        data = chains.silver_rows(f"{entry.location}/data")
        # silver exactly as that batch's commit left it ...
        assert data == chains.silver_rows(chain.tables["silver"], entry.target_version)
        # ... which is the change log up to what the batch had read of bronze
        (offset,) = entry.details["source_offsets"]
        read = chains.bronze_ids(chain.tables["bronze"], offset["version"] - 1)
        assert data == chains.expected_silver(len(read))
    assert hot.exported.batch_id < hot.last["silver"]


def test_a_query_prepared_from_silvers_snapshot_runs_on_to_the_oracle(spark, hot):
    entry = hot.exported
    new = hot.chain.moved(
        "silver", str(hot.base / "prepared" / "silver"), str(hot.base / "prepared" / "chk")
    )
    prepared = snapshots.prepare_query(
        hot.chain.chks["silver"],
        entry.name,
        checkpoint=new.chks["silver"],
        path=new.tables["silver"],
    )
    assert prepared.batch_id == entry.batch_id
    assert chains.silver_rows(new.tables["silver"]) == chains.silver_rows(f"{entry.location}/data")
    # the same query (same source, same options) on the prepared checkpoint and table
    chains.run_sequentially(spark, new, HOT_TOTAL, HOT_PER_BATCH, names=("silver",))
    assert chains.silver_rows(new.tables["silver"]) == chains.expected_silver(HOT_TOTAL)
    chains.check_each_batch_once(new.chks["silver"], new.tables["silver"])
    assert pyspark_txn.admin.verify(pyspark_txn.admin.open_sink(new.chks["silver"])).ok
    # its change feed goes on: a new gold over it reaches the oracle's aggregate
    new = new.moved(
        "gold", str(hot.base / "prepared" / "gold"), str(hot.base / "prepared" / "gchk")
    )
    chains.run_sequentially(spark, new, HOT_TOTAL, HOT_PER_BATCH, names=("gold",))
    assert chains.gold_rows(new.tables["gold"]) == chains.expected_gold(HOT_TOTAL)


# Last in this file: it deletes the hot chain.
def test_the_chain_restored_from_its_backups_alone_converges(spark, hot):
    """Every checkpoint, record table (inside the checkpoints) and table deleted; backup 1
    restored into new locations and backup 2 in place, each run to the end: both equal the
    oracle, the same silver and gold as the uninterrupted run."""
    chain = hot.chain
    for place in (*chain.checkpoints, *chain.tables.values()):
        shutil.rmtree(place)
    assert [b.state for b in backups.list_backups(hot.to)] == ["completed", "completed"]
    for st in hot.taken:
        assert backups.verify(st.backup_id, hot.to).ok
    into = backups.restore(1, hot.to, str(hot.base / "restored"), spark=spark)
    restored = Chain.restored(into)
    assert into[1].reads == {0: restored.tables["bronze"]}
    assert into[2].reads == {0: restored.tables["silver"]}
    # gold (stateful, merged by key) starts anew over its restored table and recomputes
    # its state from restored silver's change feed
    assert [r.fresh for r in into] == [False, False, True]
    chains.run_sequentially(spark, restored, HOT_TOTAL, HOT_PER_BATCH)
    chains.check_chain(restored, HOT_TOTAL)
    in_place = backups.restore(2, hot.to, in_place=True, spark=spark)
    assert [(r.checkpoint, r.path) for r in in_place] == [
        (chain.chks[n], chain.tables[n]) for n in NAMES
    ]
    chains.run_sequentially(spark, chain, HOT_TOTAL, HOT_PER_BATCH)  # the same queries
    chains.check_chain(chain, HOT_TOTAL)
