"""Upserting pipelines and their oracles, for the Spark tests of upserts
(``tests/spark/test_upserts_spark.py``) and, run as a script, a whole driver for kill -9
and ``exit`` tests (``tests/e2e/test_upserts_kill.py``).

The kinds, each from ``txn-sequence`` (row ``id``, ``value``):

- ``cdc``: change records ``k = id % KEYS``, ``seq`` distinct and out of order (the
  changes of a key arrive out of order across batches, several of them in one batch),
  ``op = 'D'`` for every seventh id, ``v``; merged into ``txn-delta`` with ``keys``,
  ``sequenceBy``, ``deleteWhen`` and ``exceptColumns``;
- ``scd2``: the same stream with ``scdType=2``;
- ``complete``: ``groupBy(k)`` count and sum, ``outputMode("complete")`` into ``txn-delta``;
- ``update``: the same aggregation, ``outputMode("update")`` through
  ``pyspark_txn.delta_batch_writer(..., keys="k")`` (Spark refuses update mode for
  Python data source sinks).

usage: upsert_driver.py BASE KIND TOTAL PER_BATCH [--option KEY=VALUE ...]
(target ``BASE/target``, checkpoint ``BASE/chk``; runs to the end of the source)
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from deltalake import DeltaTable

from pyspark_txn import admin
from pyspark_txn.sinks.upsert import END_AT, START_AT

KINDS = ("cdc", "scd2", "complete", "update")
KEYS = 40  # keys of the change stream
GROUPS = 7  # groups of the aggregation
SHIFT = 700  # seq follows id + SHIFT * (0, 1 or 2): an older change arrives up to 1400 ids later
CDC_OPTIONS = {
    "keys": "k",
    "sequenceBy": "seq",
    "deleteWhen": "op = 'D'",
    "exceptColumns": "op",
}


# --- the streams -----------------------------------------------------------------------


def change(i: int) -> tuple[int, int, str, str]:
    """Change record ``i``: (k, seq, op, v), as :func:`cdc_frame` derives it in Spark. The
    sequence is of ``i + r * SHIFT`` (``r = 2i mod 3``), times 3 plus ``r`` (distinct):
    a key's next change is newer or older than the one before it, often in another
    batch."""
    r = 2 * i % 3
    return i % KEYS, 3 * (i + SHIFT * r) + r, "D" if i % 7 == 2 else "U", f"v{i}"


def source(spark, total: int, per_batch: int):
    return (
        spark.readStream.format("txn-sequence")
        .option("rowsPerBatch", per_batch)
        .option("totalRows", total)
        .load()
    )


def cdc_frame(spark, total: int, per_batch: int):
    return source(spark, total, per_batch).selectExpr(
        f"id % {KEYS} AS k",
        f"3 * (id + {SHIFT} * (2 * id % 3)) + 2 * id % 3 AS seq",
        "CASE WHEN id % 7 = 2 THEN 'D' ELSE 'U' END AS op",
        "concat('v', CAST(id AS STRING)) AS v",
    )


def agg_frame(spark, total: int, per_batch: int):
    from pyspark.sql import functions as F

    return (
        source(spark, total, per_batch)
        .selectExpr(f"id % {GROUPS} AS k", "value")
        .groupBy("k")
        .agg(F.count("*").alias("n"), F.sum("value").alias("total"))
    )


def writer(spark, kind: str, target: str, chk: str, total: int, per_batch: int, **options: Any):
    """The ``DataStreamWriter`` of ``kind`` into the table ``target`` with the checkpoint
    ``chk``, without a trigger."""
    import pyspark_txn

    if kind == "update":
        df = agg_frame(spark, total, per_batch)
        sink = pyspark_txn.delta_batch_writer(path=target, checkpoint=chk, keys="k", **options)
        return (
            df.writeStream.outputMode("update").foreachBatch(sink).option("checkpointLocation", chk)
        )
    if kind == "complete":
        w = agg_frame(spark, total, per_batch).writeStream.outputMode("complete")
    else:
        w = cdc_frame(spark, total, per_batch).writeStream
        options = {**CDC_OPTIONS, **({"scdType": "2"} if kind == "scd2" else {}), **options}
    w = w.format("txn-delta").option("path", target).option("checkpointLocation", chk)
    for key, value in options.items():
        w = w.option(key, str(value))
    return w


# --- the oracles -------------------------------------------------------------------------


def changes(total: int) -> list[tuple[int, int, str, str]]:
    return [change(i) for i in range(total)]


def expected_scd1(total: int) -> dict[int, tuple[int, str]]:
    """The change log applied once in sequence order: per key the last change wins, a
    delete removes the key. ``k -> (seq, v)``."""
    last: dict[int, tuple[int, str, str]] = {}
    for k, seq, op, v in changes(total):
        if k not in last or seq > last[k][0]:
            last[k] = (seq, op, v)
    return {k: (seq, v) for k, (seq, op, v) in last.items() if op != "D"}


def expected_scd2(total: int) -> dict[tuple[int, int], tuple[str, int | None]]:
    """Every version: each upsert opens one at its seq, the key's next change (upsert or
    delete, in sequence order) ends it. ``(k, start) -> (v, end)``."""
    by_key: dict[int, list[tuple[int, str, str]]] = {}
    for k, seq, op, v in changes(total):
        by_key.setdefault(k, []).append((seq, op, v))
    out: dict[tuple[int, int], tuple[str, int | None]] = {}
    for k, events in by_key.items():
        events.sort()
        for j, (seq, op, v) in enumerate(events):
            if op != "D":
                out[(k, seq)] = (v, events[j + 1][0] if j + 1 < len(events) else None)
    return out


def expected_agg(rows: int) -> dict[int, tuple[int, int]]:
    """The aggregate over ids ``0 .. rows-1``: ``k -> (n, total)``."""
    from pyspark_txn.sources.sequence import expected_rows

    out: dict[int, tuple[int, int]] = {}
    t = expected_rows(0, rows, 0)
    for i, value in zip(t.column("id").to_pylist(), t.column("value").to_pylist(), strict=True):
        n, s = out.get(i % GROUPS, (0, 0))
        out[i % GROUPS] = (n + 1, s + value)
    return out


def expected(kind: str, total: int) -> dict:
    if kind == "cdc":
        return expected_scd1(total)
    if kind == "scd2":
        return expected_scd2(total)
    return expected_agg(total)


# --- reading the target back -------------------------------------------------------------


def table(kind: str, path: str, version: int | None = None) -> dict:
    """The target (at ``version``) in the oracle's shape; a key twice is an error."""
    rows = DeltaTable(path, version=version).to_pyarrow_table().to_pylist()
    if kind == "cdc":
        got = {r["k"]: (r["seq"], r["v"]) for r in rows}
    elif kind == "scd2":
        got = {(r["k"], r[START_AT]): (r["v"], r[END_AT]) for r in rows}
    else:
        got = {r["k"]: (r["n"], r["total"]) for r in rows}
    assert len(got) == len(rows), f"a key is in the table twice: {sorted(rows, key=str)[:20]}"
    return got


# --- the checks ------------------------------------------------------------------------------


class Pipeline:
    """Where a pipeline of ``kind`` writes (``base/target``, ``base/chk``), and the checks
    of what it wrote."""

    def __init__(self, kind: str, base: Any, total: int, per_batch: int) -> None:
        self.kind, self.base, self.total, self.per_batch = kind, str(base), total, per_batch
        self.target, self.checkpoint = f"{base}/target", f"{base}/chk"

    @property
    def batches(self) -> int:
        return -(-self.total // self.per_batch)

    # --- checks -------------------------------------------------------------------------

    def check(self) -> None:
        """The table equals the oracle; every batch is in exactly one commit of the table;
        records, staged files and verify are clean."""
        assert table(self.kind, self.target) == expected(self.kind, self.total)
        stamped = self.batch_commits()
        assert Counter(stamped.values()) == dict.fromkeys(range(self.batches), 1), stamped
        if self.kind == "complete":
            self.check_every_version()
        assert self.staged_files() == []
        handle = admin.open_sink(self.checkpoint)
        assert not admin.stuck_snapshots(handle)
        report = admin.verify(handle)
        problems = [(s.batch_id, p) for s in report.snapshots for p in s.problems]
        if self.kind == "complete":  # each result's files are overwritten by the next
            latest = max(stamped.values())
            problems = [
                (b, p)
                for b, p in problems
                if not (b < latest and (p.severity, p.kind) == ("warning", "not-in-table"))
            ]
        assert report.ok and not problems, problems

    def batch_commits(self) -> dict[int, int]:
        """Table version -> the sink's batch its commit carries (commits of ours only)."""
        return {
            h["version"]: h["pyspark_txn.batch_id"]
            for h in DeltaTable(self.target).history()
            if "pyspark_txn.batch_id" in h
        }

    def check_every_version(self) -> None:
        """Complete mode: every version of the table holds exactly one whole result, the
        one of the batch its commit carries (never empty, partial or doubled)."""
        stamped = self.batch_commits()
        latest = DeltaTable(self.target).version()
        assert sorted(stamped) == list(range(latest + 1)), f"a version of no batch: {stamped}"
        for version, batch in stamped.items():
            rows = min(self.total, (batch + 1) * self.per_batch)
            got = table("complete", self.target, version)
            assert got == expected_agg(rows), (version, batch)

    def staged_files(self) -> list[str]:
        """The sink's own data files (staged by phase 1) that no version of the table
        holds: a merge's inputs are spent once it landed, an overwrite's are the table's."""
        sink_id = admin.open_sink(self.checkpoint).sink_id
        ours = f"part-{sink_id}-"
        added = set()
        for commit in Path(self.target, "_delta_log").glob("*.json"):
            for line in commit.read_text().splitlines():
                action = json.loads(line)
                if "add" in action:
                    added.add(unquote(action["add"]["path"]))
        root = Path(self.target)
        return sorted(
            rel
            for p in root.rglob("*.parquet")
            for rel in [str(p.relative_to(root))]
            if (p.name.startswith(ours) or rel.startswith(ours)) and rel not in added
        )


def main() -> int:
    import pyspark_txn

    base, kind, total, per_batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    options = {}
    for i, arg in enumerate(sys.argv):
        if arg == "--option":
            key, _, value = sys.argv[i + 1].partition("=")
            options[key] = value
    spark = pyspark_txn.local_session("pyspark-txn-e2e-upserts")
    w = writer(spark, kind, f"{base}/target", f"{base}/chk", total, per_batch, **options)
    pyspark_txn.process_available(w)
    return 0


if __name__ == "__main__":
    sys.exit(main())
