"""The CDC chain of issue 35 (bronze -> silver -> gold), its oracle and its checks, for
``tests/e2e/test_cdc_chain.py``; run as a script, a whole driver that runs the three
queries side by side (processing-time triggers) until each has processed everything,
for kill -9.

- **bronze**: change records from ``txn-sequence``: ``key = id % KEYS``, a sequence
  ``seq`` that is a permutation of the ids (later records often carry older sequences),
  ``op`` = ``D`` for every seventh id (7 is prime to ``KEYS``: every key gets deletes and
  updates, and older updates arrive after deletes), ``value = id``; appended by
  ``txn-delta``.
- **silver**: reads bronze (``txn-delta``), upserts by ``key`` with ``sequenceBy=seq``,
  ``deleteWhen=op = 'D'``, ``exceptColumns=op``, ``delta.enableChangeDataFeed=true``.
- **gold**: reads silver's change feed (``readChangeFeed=true``) and keeps a total and a
  row count per ``bucket = key % BUCKETS``, as notebooks/06_cdc_upserts.ipynb does:
  inserts and post-images count +1, deletes and pre-images -1; ``outputMode("update")``
  through ``delta_batch_writer(..., keys="bucket")``.

usage: chain_driver.py BASE TOTAL PER_BATCH
(tables ``BASE/tables/<name>``, checkpoints ``BASE/chk/<name>``; exits 0 once every
query has processed everything)
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from deltalake import DeltaTable

from pyspark_txn import admin
from pyspark_txn.operations.handle import read_started_from
from pyspark_txn.storage.checkpoint import latest_batch, read_batch_offsets

NAMES = ("bronze", "silver", "gold")
KEYS = 40
BUCKETS = 4
SEQ_MOD = 100_003  # prime: (id * 7919) % SEQ_MOD is a permutation of the ids below it
#: processing-time triggers of the chain's queries, milliseconds
TRIGGERS = {"bronze": 300, "silver": 500, "gold": 700}


# --- the change log and its oracle ----------------------------------------------------------


def change(i: int) -> tuple[int, int, str, int]:
    """Change record ``i``: (key, seq, op, value), as :func:`bronze` derives it in Spark."""
    return i % KEYS, (i * 7919) % SEQ_MOD, "D" if i % 7 == 3 else "U", i


def expected_silver(total: int) -> dict[int, tuple[int, int]]:
    """The change log of records ``0 .. total-1`` applied once in sequence order: per key
    the newest change wins, a delete removes the key. ``key -> (seq, value)``."""
    last: dict[int, tuple[int, str, int]] = {}
    for i in range(total):
        key, seq, op, value = change(i)
        if key not in last or seq > last[key][0]:
            last[key] = (seq, op, value)
    return {k: (seq, v) for k, (seq, op, v) in last.items() if op != "D"}


def aggregate(silver: dict[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """Gold as it must be over these silver rows: ``bucket -> (total, rows)``. A bucket
    gold saw whose every key is deleted since holds zeros there, and is absent here:
    compare with :func:`nonzero`."""
    out: dict[int, tuple[int, int]] = {}
    for key, (_, value) in silver.items():
        t, n = out.get(key % BUCKETS, (0, 0))
        out[key % BUCKETS] = (t + value, n + 1)
    return out


def expected_gold(total: int) -> dict[int, tuple[int, int]]:
    """The oracle's aggregate. The chain's sizes keep every bucket alive (asserted), so
    gold must equal it exactly."""
    out = aggregate(expected_silver(total))
    assert sorted(out) == list(range(BUCKETS)), out
    return out


def nonzero(gold: dict[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    return {b: v for b, v in gold.items() if v != (0, 0)}


# --- the queries -------------------------------------------------------------------------


@dataclass(frozen=True)
class Chain:
    """Where the chain's queries write: a table and a checkpoint each."""

    tables: dict[str, str]
    chks: dict[str, str]

    @classmethod
    def under(cls, base: Any) -> Chain:
        return cls({n: f"{base}/tables/{n}" for n in NAMES}, {n: f"{base}/chk/{n}" for n in NAMES})

    @classmethod
    def restored(cls, restored: list) -> Chain:
        """The chain at what ``backups.restore`` returned (its members upstream first)."""
        return cls(
            {n: r.path for n, r in zip(NAMES, restored, strict=True)},
            {n: r.checkpoint for n, r in zip(NAMES, restored, strict=True)},
        )

    def moved(self, name: str, table: str, chk: str) -> Chain:
        """The same chain with query ``name`` writing ``table`` with checkpoint ``chk``."""
        return replace(self, tables={**self.tables, name: table}, chks={**self.chks, name: chk})

    @property
    def checkpoints(self) -> list[str]:
        return [self.chks[n] for n in NAMES]

    @property
    def reads(self) -> dict[str, list[str | None]]:
        """``backups.take``'s ``reads``: silver reads bronze, gold silver's change feed."""
        return {
            self.chks["silver"]: [self.tables["bronze"]],
            self.chks["gold"]: [self.tables["silver"]],
        }


def bronze(spark, chain: Chain, total: int, per_batch: int, rows_per_second: int | None = None):
    reader = (
        spark.readStream.format("txn-sequence")
        .option("rowsPerBatch", per_batch)
        .option("totalRows", total)
    )
    if rows_per_second is not None:
        reader = reader.option("rowsPerSecond", rows_per_second)
    changes = reader.load().selectExpr(
        f"id % {KEYS} AS key",
        f"(id * 7919) % {SEQ_MOD} AS seq",
        "CASE WHEN id % 7 = 3 THEN 'D' ELSE 'U' END AS op",
        "id AS value",
    )
    return (
        changes.writeStream.format("txn-delta")
        .option("path", chain.tables["bronze"])
        .option("checkpointLocation", chain.chks["bronze"])
    )


def silver(spark, chain: Chain):
    return (
        spark.readStream.format("txn-delta")
        .option("path", chain.tables["bronze"])
        .load()
        .writeStream.format("txn-delta")
        .option("path", chain.tables["silver"])
        .option("checkpointLocation", chain.chks["silver"])
        .option("keys", "key")
        .option("sequenceBy", "seq")
        .option("deleteWhen", "op = 'D'")
        .option("exceptColumns", "op")
        .option("delta.enableChangeDataFeed", "true")
    )


def gold(spark, chain: Chain):
    from pyspark.sql import functions as F

    import pyspark_txn

    changes = (
        spark.readStream.format("txn-delta")
        .option("path", chain.tables["silver"])
        .option("readChangeFeed", "true")
        .load()
    )
    added = F.col("_change_type").isin("insert", "update_postimage")
    removed = F.col("_change_type").isin("delete", "update_preimage")
    sign = F.when(added, 1).when(removed, -1).otherwise(0)
    totals = changes.groupBy((F.col("key") % BUCKETS).alias("bucket")).agg(
        F.sum(sign * F.col("value")).alias("total"), F.sum(sign).alias("rows")
    )
    return (
        totals.writeStream.outputMode("update")
        .foreachBatch(
            pyspark_txn.delta_batch_writer(
                path=chain.tables["gold"], checkpoint=chain.chks["gold"], keys="bucket"
            )
        )
        .option("checkpointLocation", chain.chks["gold"])
    )


def writer(spark, name: str, chain: Chain, total: int, per_batch: int, **bronze_options: Any):
    """The ``DataStreamWriter`` of query ``name``, without a trigger. Its source table
    must exist: a ``txn-delta`` source reads the schema when the query is built."""
    if name == "bronze":
        return bronze(spark, chain, total, per_batch, **bronze_options)
    return silver(spark, chain) if name == "silver" else gold(spark, chain)


def run_sequentially(spark, chain: Chain, total: int, per_batch: int, names=NAMES) -> None:
    """Each query run to the end of its input, upstream first (``process_available``)."""
    import pyspark_txn

    for name in names:
        pyspark_txn.process_available(writer(spark, name, chain, total, per_batch))


def start_side_by_side(
    spark, chain: Chain, total: int, per_batch: int, timeout_s: float, **bronze_options: Any
) -> list:
    """Start the three queries with processing-time triggers, each once its source table
    exists; returns them, upstream first."""
    queries: list = []
    deadline = time.monotonic() + timeout_s
    try:
        for k, name in enumerate(NAMES):
            if k:  # its source reads the upstream table's schema
                while not Path(chain.tables[NAMES[k - 1]], "_delta_log").is_dir():
                    check_running(queries, deadline)
                    time.sleep(0.2)
            w = writer(spark, name, chain, total, per_batch, **bronze_options)
            w = w.queryName(f"chain-{name}").trigger(
                processingTime=f"{TRIGGERS[name]} milliseconds"
            )
            queries.append(w.start())
    except BaseException:
        for q in queries:
            q.stop()
        raise
    return queries


def check_running(queries: list, deadline: float) -> None:
    for q in queries:
        if not q.isActive:
            raise RuntimeError(f"query {q.name} ended: {q.exception()}")
    if time.monotonic() > deadline:
        raise TimeoutError("the chain did not finish in time")


def run_side_by_side(spark, chain: Chain, total: int, per_batch: int, timeout_s: float) -> None:
    """The three queries side by side until every one has processed everything (or what
    one of them failed with is raised)."""
    deadline = time.monotonic() + timeout_s
    queries = start_side_by_side(spark, chain, total, per_batch, timeout_s)
    try:
        while not finished(chain, total):
            check_running(queries, deadline)
            time.sleep(0.2)
    finally:
        for q in queries:
            q.stop()


# --- where the chain stands ------------------------------------------------------------------


def last_offsets(chk: str) -> list[Any] | None:
    """The source offsets of the last batch Spark finished (commit log), or None."""
    done = latest_batch(chk, "commits")
    return None if done is None else read_batch_offsets(chk, done)


def caught_up(reader_chk: str, table: str) -> bool:
    """The query at ``reader_chk`` has read every version of ``table``: its last finished
    batch ends after the table's latest version, on a version boundary."""
    offsets = last_offsets(reader_chk)
    if not offsets or not isinstance(offsets[0], dict):
        return False
    try:
        version = DeltaTable(table).version()
    except Exception:  # noqa: BLE001 - not created yet
        return False
    o = offsets[0]
    return o.get("version") == version + 1 and o.get("index") == 0 and not o.get("snapshot")


def finished(chain: Chain, total: int) -> bool:
    """Every query has processed everything: bronze all ``total`` change records, silver
    every version of bronze, gold every version of silver."""
    offsets = last_offsets(chain.chks["bronze"])
    if not offsets or offsets[0] != {"index": total}:
        return False
    return caught_up(chain.chks["silver"], chain.tables["bronze"]) and caught_up(
        chain.chks["gold"], chain.tables["silver"]
    )


# --- reading the tables back ---------------------------------------------------------------


def silver_rows(table: str, version: int | None = None) -> dict[int, tuple[int, int]]:
    """``key -> (seq, value)``; a key twice, or the ``op`` column, is an error."""
    dt = DeltaTable(table, version=version)
    rows = dt.to_pyarrow_table().to_pylist()
    got = {r["key"]: (r["seq"], r["value"]) for r in rows}
    assert len(got) == len(rows), f"a key is in {table} twice: {sorted(rows, key=str)[:20]}"
    assert "op" not in dt.schema().to_arrow().names, table  # exceptColumns
    return got


def gold_rows(table: str, version: int | None = None) -> dict[int, tuple[int, int]]:
    """``bucket -> (total, rows)``; a bucket twice is an error."""
    rows = DeltaTable(table, version=version).to_pyarrow_table().to_pylist()
    got = {r["bucket"]: (r["total"], r["rows"]) for r in rows}
    assert len(got) == len(rows), f"a bucket is in {table} twice: {rows}"
    return got


def bronze_ids(table: str, version: int | None = None) -> list[int]:
    """The change records' ids, sorted (each record's ``value`` is its id)."""
    return sorted(DeltaTable(table, version=version).to_pyarrow_table()["value"].to_pylist())


def check_consistent(chain: Chain) -> None:
    """What must hold at every moment, a kill included: bronze holds a prefix of the
    change log, each once; silver and gold hold each key once."""
    tables = chain.tables
    if Path(tables["bronze"], "_delta_log").is_dir():
        ids = bronze_ids(tables["bronze"])
        assert ids == list(range(len(ids))), f"bronze is not a prefix of the log: {ids[:50]}"
    if Path(tables["silver"], "_delta_log").is_dir():
        silver_rows(tables["silver"])
    if Path(tables["gold"], "_delta_log").is_dir():
        gold_rows(tables["gold"])


# --- the checks -------------------------------------------------------------------------------


def batch_commits(table: str) -> dict[int, int]:
    """Table version -> the sink's batch its commit carries (commits of our sinks only)."""
    return {
        h["version"]: h["pyspark_txn.batch_id"]
        for h in DeltaTable(table).history()
        if "pyspark_txn.batch_id" in h
    }


def check_each_batch_once(chk: str, table: str) -> None:
    """Each batch of the query is in exactly one commit of its table: the batches the
    commits carry are each carried once, are batches Spark finished, and are exactly the
    kept records' batches that wrote rows (a batch without rows makes no commit, but for
    the one that creates the table; a merge whose changes were all stale still commits,
    carrying its app transaction)."""
    stamped = batch_commits(table)
    counts = Counter(stamped.values())
    twice = {b: n for b, n in counts.items() if n != 1}
    assert not twice, f"{table}: batches in more than one commit: {twice} ({stamped})"
    done = latest_batch(chk, "commits")
    assert done is not None and set(counts) <= set(range(done + 1)), (table, stamped, done)
    restored = read_started_from(chk)
    if _idle_since_restore(chk):  # its batches are the restored part's, checked above
        assert restored is not None and done == restored["batch_id"], (chk, done, restored)
        return
    records = admin.open_sink(chk).load().records.values()
    assert records, chk
    kept_from = min(r.batch_id for r in records)  # retention may have summarized older ones
    wrote = {r.batch_id for r in records if r.rows > 0}
    if 0 in stamped:  # the first batch creates the table, with rows or without
        wrote.add(stamped[0])
    assert {b for b in counts if b >= kept_from} == wrote, (table, sorted(counts), sorted(wrote))


def _idle_since_restore(chk: str) -> bool:
    """A checkpoint restored from a backup whose query found no batch left to run (the
    backup was taken after it had read everything): its sink has no record table yet,
    which its first commit creates, and so no records to check or verify."""
    records = Path(chk, "pyspark_txn", "records")
    return read_started_from(chk) is not None and not records.exists()


def check_sinks(chain: Chain) -> None:
    """Each query's batches each in one commit; nothing stuck; verify clean."""
    for name in NAMES:
        check_each_batch_once(chain.chks[name], chain.tables[name])
        if _idle_since_restore(chain.chks[name]):
            continue
        handle = admin.open_sink(chain.chks[name])
        assert not admin.stuck_snapshots(handle), name
        report = admin.verify(handle)
        problems = [(s.batch_id, p) for s in report.snapshots for p in s.problems]
        assert report.ok and not problems, (name, problems)


def check_chain(chain: Chain, total: int) -> None:
    """Bronze holds every change record once; silver equals the oracle, gold its
    aggregate; every sink as :func:`check_sinks` says."""
    assert bronze_ids(chain.tables["bronze"]) == list(range(total))
    assert silver_rows(chain.tables["silver"]) == expected_silver(total)
    assert gold_rows(chain.tables["gold"]) == expected_gold(total)
    check_sinks(chain)


# --- the driver --------------------------------------------------------------------------------


def main() -> int:
    import pyspark_txn

    base, total, per_batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    spark = pyspark_txn.local_session("pyspark-txn-e2e-chain")
    run_side_by_side(spark, Chain.under(base), total, per_batch, timeout_s=900)
    return 0


if __name__ == "__main__":
    sys.exit(main())
