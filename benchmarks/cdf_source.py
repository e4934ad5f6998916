"""Reading a Delta table's change data feed: the ``txn-delta`` source with
``readChangeFeed=true`` against delta-rs's ``load_cdf`` in a hand loop.

    .venv/bin/python benchmarks/cdf_source.py [--rows 2000000] [--appends 20]
        [--changes 12] [--rounds 3] [--spark] [--keep DIR]

Writes one table with ``delta.enableChangeDataFeed=true`` (``--appends`` appends of
``--rows``/``--appends`` rows each, then ``--changes`` versions that MERGE, UPDATE and
DELETE a few percent of the rows, so the feed mixes inserts derived from add actions
and ``_change_data`` files), then reads its whole feed from version 0, in one run,
each round in a random order:

- ``source``: ``DeltaStreamReader`` driven as Spark drives it, without Spark
  (initialOffset, latestOffset, partitions, read; default maxFilesPerBatch);
- ``load_cdf``: a hand loop over the same versions, one ``load_cdf(v, v)`` per
  version on one ``DeltaTable``, each result taken into pyarrow;
- ``load_cdf-all``: one ``load_cdf(0, last)`` (a reference, not a streaming reader);
- with ``--spark``: the same source in a Spark query into ``noop`` (``availableNow``).

Both sides' rows are counted and checked equal. Reports M rows/s (median over rounds)
and the paired ratios source / load_cdf.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pyspark_txn.sources.delta import DeltaSourceOptions, DeltaStreamReader  # noqa: E402


def batch(lo: int, n: int, seed: int = 0) -> pa.Table:
    import numpy as np

    ids = np.arange(lo, lo + n, dtype=np.int64)
    return pa.table(
        {
            "id": ids,
            "amount": (ids * 2654435761 + seed) % 100_000,
            "name": pa.array([f"customer-{i % 9973}" for i in range(lo, lo + n)]),
            "region": pa.array(
                ["north", "south", "east", "west"][i % 4] for i in range(lo, lo + n)
            ),
        }
    )


def build(path: str, rows: int, appends: int, changes: int) -> int:
    per = rows // appends
    t0 = time.perf_counter()
    for k in range(appends):
        write_deltalake(
            path,
            batch(k * per, per),
            mode="append",
            configuration={"delta.enableChangeDataFeed": "true"} if k == 0 else None,
        )
    total = per * appends
    rng = random.Random(7)
    for k in range(changes):
        kind = k % 3
        if kind == 0:  # MERGE: update 2 % of the rows, insert some new ones
            lo = rng.randrange(0, total - total // 50)
            src = batch(lo, total // 50, seed=k + 1)
            (
                DeltaTable(path)
                .merge(src, "t.id = s.id", source_alias="s", target_alias="t")
                .when_matched_update_all()
                .when_not_matched_insert_all()
                .execute()
            )
        elif kind == 1:
            lo = rng.randrange(0, total)
            DeltaTable(path).update(
                updates={"amount": "amount + 1"},
                predicate=f"id >= {lo} AND id < {lo + total // 100}",
            )
        else:
            lo = rng.randrange(0, total)
            DeltaTable(path).delete(f"id >= {lo} AND id < {lo + total // 100}")
    print(
        f"table: {DeltaTable(path).version() + 1} versions, built in {time.perf_counter() - t0:.1f} s"
    )
    return DeltaTable(path).version()


def run_source(path: str) -> int:
    opts = DeltaSourceOptions.parse(
        {"path": path, "readChangeFeed": "true", "startingVersion": "0"}
    )
    r = DeltaStreamReader(opts, opts.spark_schema_ddl())
    rows, start = 0, r.initialOffset()
    while (end := r.latestOffset(start, None)) != start:
        for part in r.partitions(start, end):
            for b in r.read(part):
                rows += b.num_rows
        r.commit(end)
        start = end
    return rows


def run_load_cdf_loop(path: str, last: int) -> int:
    dt = DeltaTable(path)
    rows = 0
    for v in range(last + 1):
        rows += pa.table(dt.load_cdf(starting_version=v, ending_version=v).read_all()).num_rows
    return rows


def run_load_cdf_all(path: str, last: int) -> int:
    data = DeltaTable(path).load_cdf(starting_version=0, ending_version=last).read_all()
    return pa.table(data).num_rows


def run_spark(spark, path: str) -> int:
    import pyspark_txn

    chk = tempfile.mkdtemp(prefix="cdf-bench-chk-")
    try:
        query = pyspark_txn.process_available(
            spark.readStream.format("txn-delta")
            .option("path", path)
            .option("readChangeFeed", "true")
            .option("startingVersion", 0)
            .load()
            .writeStream.format("noop")
            .option("checkpointLocation", chk)
        )
        progress = query.recentProgress if query is not None else []
        return sum(p["numInputRows"] for p in progress)
    finally:
        shutil.rmtree(chk, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--appends", type=int, default=20)
    ap.add_argument("--changes", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--spark", action="store_true", help="also read it in a Spark query")
    ap.add_argument("--keep", help="build the table in DIR (reused if it is there)")
    args = ap.parse_args()

    base = args.keep or tempfile.mkdtemp(prefix="cdf-bench-")
    path = os.path.join(base, "table")
    if os.path.isdir(os.path.join(path, "_delta_log")):
        last = DeltaTable(path).version()
    else:
        last = build(path, args.rows, args.appends, args.changes)
    spark = None
    if args.spark:
        import pyspark_txn

        spark = pyspark_txn.local_session("cdf-bench")
    runs = {
        "source": lambda: run_source(path),
        "load_cdf": lambda: run_load_cdf_loop(path, last),
        "load_cdf-all": lambda: run_load_cdf_all(path, last),
    }
    if spark is not None:
        runs["spark"] = lambda: run_spark(spark, path)
    times: dict[str, list[float]] = {k: [] for k in runs}
    counts: dict[str, int] = {}
    for rnd in range(args.rounds):
        order = list(runs)
        random.shuffle(order)
        for name in order:
            t0 = time.perf_counter()
            n = runs[name]()
            times[name].append(time.perf_counter() - t0)
            counts.setdefault(name, n)
            if n != counts["source" if "source" in counts else name]:
                print(f"  !! {name} read {n} rows, source {counts.get('source')}")
        print(f"round {rnd + 1}: " + ", ".join(f"{k} {times[k][-1]:.2f} s" for k in order))
    rows = counts["load_cdf"]
    assert counts["source"] == rows, counts
    print(f"\nrows in the feed: {rows:,} over {last + 1} versions")
    for name, ts in times.items():
        print(
            f"  {name:13s} {rows / statistics.median(ts) / 1e6:6.2f} M rows/s (median {statistics.median(ts):.2f} s)"
        )
    for other in ("load_cdf", "load_cdf-all"):
        paired = statistics.median(
            b / a for a, b in zip(times["source"], times[other], strict=True)
        )
        print(f"  source / {other}: {paired:.2f}x (paired median; >1 is faster)")
    if spark is not None:
        paired = statistics.median(
            b / a for a, b in zip(times["spark"], times["load_cdf"], strict=True)
        )
        print(f"  spark / load_cdf: {paired:.2f}x")
        spark.stop()
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
