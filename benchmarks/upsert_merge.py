"""Upserts by key (issue 35): txn-delta's MERGE against a hand-written foreachBatch +
delta-rs merge, per batch, into targets of 1M and 10M rows, with and without file
pruning; and (``--memory``) the peak memory of the process that runs phase 2.

    .venv/bin/python benchmarks/upsert_merge.py [--targets 1000000,10000000]
        [--batch 100000] [--batches 4] [--workloads range,scattered] [--file-rows 250000]
        [--sides txn-delta,txn-delta-unpruned,hand-written,hand-written-minmax]
        [--spark-target 10000000 | --no-spark] [--json FILE] [--keep DIR]
    .venv/bin/python benchmarks/upsert_merge.py --memory --targets 10000000
        --batch 100000,1000000 [--workloads range]

The target: ``id`` (the key, sorted), ``seq``, ``amount``, ``name``, ``region``, built
with ``write_deltalake`` in files of ``--file-rows`` rows (as a stream of appends
leaves it). Batch ``b`` holds ``--batch`` distinct keys, each change at ``seq = b + 1``
(newer than the table's), by workload:

- ``range``: 90 % updates of a contiguous window of existing keys, 10 % new keys;
- ``scattered``: ``range`` with 20 of the window's keys swapped for old keys spread over
  the lower half of the table (late corrections): min..max spans the table;
- ``uniform``: keys drawn uniformly from the table (every file touched; no Spark form).

Sides, each on its own copy of the target, in a random order per configuration:

- ``txn-delta``: the sink's protocol driven as Spark drives it, without Spark
  (allocate, stage the batch in 2 tasks, commit: preflight, record, phase 2), options
  ``keys=id, sequenceBy=seq``; where phase 2's time goes is measured around its steps;
- ``txn-delta-unpruned``: the same with the pruning condition off (before
  ``sinks/merge_pruning.py``);
- ``hand-written``: what a foreachBatch does with the batch's rows in memory: open the
  table, ``transaction_version`` check, ``merge("t.id = s.id")`` with
  ``when_matched_update_all("s.seq > t.seq")``, ``when_not_matched_insert_all()`` and
  ``CommitProperties(app_transactions=[Transaction(app_id, batch_id)])``;
- ``hand-written-minmax``: the same with ``streamed_exec=False`` (delta-rs then derives
  ``t.id BETWEEN min AND max`` of the source itself): for reference.

With Spark (default, ``--spark-target`` rows, workload ``range``): ``txn-sequence``
deriving the same key and sequence columns, into ``txn-delta`` with keys and into a
hand-written ``foreachBatch`` (``toArrow()`` then the merge above); per-batch
``triggerExecution`` and ``addBatch`` from the query's progress.

Reported per configuration: median ms per batch (batch 0 left out: first opens and
imports), the ratio hand-written / txn-delta (>= 1.0: txn-delta at least as fast), the
MERGE's files removed/added and rows copied, and txn-delta's phase 2 by step.
``--memory``: each batch's phase 2 runs alone in a fresh process (the batch staged by
this one, as Spark's tasks would), and so does the hand-written merge of the same rows;
each child reports its peak RSS (``VmHWM``) and the RSS it started from.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pickle
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable, write_deltalake
from deltalake.transaction import CommitProperties, Transaction

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pyspark_txn.sinks import delta_merge_target  # noqa: E402
from pyspark_txn.sinks.delta import DeltaSinkOptions  # noqa: E402
from pyspark_txn.sinks.delta_merge_target import DeltaMergeTarget  # noqa: E402
from pyspark_txn.sinks.staging import stage_partition  # noqa: E402

SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64()),
        pa.field("seq", pa.int64()),
        pa.field("amount", pa.int64()),
        pa.field("name", pa.string()),
        pa.field("region", pa.string()),
    ]
)
REGIONS = np.array(["north", "south", "east", "west"])
LATE = 20  # old keys of a ``scattered`` batch
APP_ID = "bench-hand-written"


# --- data ---------------------------------------------------------------------------------


def rows_for(ids: np.ndarray, seq: int) -> pa.Table:
    ids = ids.astype(np.int64)
    return pa.table(
        {
            "id": ids,
            "seq": np.full(len(ids), seq, dtype=np.int64),
            "amount": (ids * 31 + seq) % 100_000,
            "name": pa.array(np.char.add("customer-", (ids % 9973).astype(str))),
            "region": pa.array(REGIONS[ids % 4]),
        },
        schema=SCHEMA,
    )


def build_target(path: str, rows: int, file_rows: int, file_size: int | None = None) -> float:
    """``rows`` rows in files of ``file_rows``; ``file_size``: ``delta.targetFileSize``
    (what delta-rs's MERGE writes its files up to; 100 MiB without it)."""
    t0 = time.perf_counter()
    config = {"delta.targetFileSize": str(file_size)} if file_size else None
    for lo in range(0, rows, file_rows):
        ids = np.arange(lo, min(rows, lo + file_rows), dtype=np.int64)
        write_deltalake(path, rows_for(ids, 0), mode="append", configuration=config)
        config = None
    return time.perf_counter() - t0


def batch_keys(workload: str, b: int, n: int, batch: int) -> np.ndarray:
    """The keys of batch ``b`` (distinct). ``range``/``scattered`` are what
    :func:`spark_key_sql` computes from ``txn-sequence``'s ids."""
    if workload == "uniform":
        return np.random.default_rng(b).choice(n, size=batch, replace=False).astype(np.int64)
    j = np.arange(batch, dtype=np.int64)
    window, fresh = batch - batch // 10, batch // 10
    half = n // 2
    keys = half + (b * window) % max(1, half - window) + j
    keys[window:] = n + batch + b * fresh + (j[window:] - window)  # above every window
    if workload == "scattered":
        step = max(1, half // LATE)
        late = j[window - LATE : window] - (window - LATE)
        keys[window - LATE : window] = late * step + (b * 7919) % step
    assert pc.count_distinct(pa.array(keys)).as_py() == batch, "keys must be distinct"
    return keys


def spark_key_sql(workload: str, n: int, batch: int) -> str:
    """:func:`batch_keys` in Spark SQL over ``txn-sequence``'s ``id`` (b*batch + j)."""
    window, fresh, half = batch - batch // 10, batch // 10, n // 2
    b, j = f"(id div {batch})", f"pmod(id, {batch})"
    step = max(1, half // LATE)
    late = (
        f"WHEN '{workload}' = 'scattered' AND {j} >= {window - LATE} "
        f"THEN ({j} - {window - LATE}) * {step} + pmod({b} * 7919, {step}) "
    )
    return (
        f"CASE WHEN {j} >= {window} THEN {n + batch} + {b} * {fresh} + ({j} - {window}) {late}"
        f"ELSE {half} + pmod({b} * {window}, {max(1, half - window)}) + {j} END"
    )


# --- timing around phase 2's steps ----------------------------------------------------------

STEPS: dict[str, float] = defaultdict(float)
_stack: list[str] = []


def _timed(name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _stack.append(name)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            STEPS["/".join(_stack)] += (time.perf_counter() - t0) * 1000
            _stack.pop()

    return wrapper


def instrument() -> None:
    steps = {
        "preflight": "preflight",
        "commit": "phase 2",
        "_table_for_commit": "open table",
        "_batch_rows": "read staged",
        "_source": "dedupe",
        "_merge": "MERGE",
        "_after_commit": "after commit",
        "discard": "remove spent",
    }
    for method, name in steps.items():
        setattr(DeltaMergeTarget, method, _timed(name, getattr(DeltaMergeTarget, method)))
    global _PRUNING
    _PRUNING = _timed("pruning", _PRUNING)
    delta_merge_target.pruning_predicate = _PRUNING  # type: ignore[attr-defined]


_PRUNING = delta_merge_target.pruning_predicate


def set_pruning(on: bool) -> None:
    if on:
        delta_merge_target.pruning_predicate = _PRUNING  # type: ignore[attr-defined]
    else:
        delta_merge_target.pruning_predicate = lambda *a, **k: None  # type: ignore[attr-defined]


# --- the sides ----------------------------------------------------------------------------


class ProtocolSink:
    """txn-delta with keys, driven as Spark drives it (tests/contract/test_upserts.py)."""

    def __init__(self, table: str, chk: str) -> None:
        opts = DeltaSinkOptions.parse(
            {"path": table, "checkpointLocation": chk, "keys": "id", "sequenceBy": "seq"}
        )
        self.opts = opts.with_checkpoint_sink_id()
        self.opts.record_store().log.create_if_missing()
        self.opts.check_schema(SCHEMA)

    def stage(self, rows: pa.Table, tasks: int = 2) -> tuple[Any, int, str, list[Any]]:
        committer = self.opts.committer()
        sid, token = committer.allocate(self.opts.write_meta())
        handles = []
        per = -(-rows.num_rows // tasks)
        for p in range(tasks):
            part = rows.slice(p * per, per)
            handles += stage_partition(
                part.to_batches(), self.opts.staging(), sid, token, p, SCHEMA
            )
        return committer, sid, token, handles

    def commit(self, committer: Any, batch_id: int, sid: int, token: str, handles: list) -> None:
        committer.commit(
            batch_id,
            sid,
            token,
            handles,
            run_id="bench-run",
            query_id="bench-query",
            target_meta=self.opts.target_meta(SCHEMA, committer.target.base()),
        )


def merge_metrics(path: str, after: int) -> dict[str, Any]:
    """The metrics of the MERGE committed after version ``after`` ({} for none)."""
    for commit in DeltaTable(path).history(4):
        if commit["operation"] == "MERGE" and commit["version"] > after:
            return dict(commit.get("operationMetrics") or {})
    return {}


def table_check(path: str) -> str:
    """Rows and the sum of their sequences: equal on every side when all merged alike."""
    seq = DeltaTable(path).to_pyarrow_dataset().to_table(columns=["seq"]).column("seq")
    return f"{len(seq)}/{pc.sum(seq).as_py()}"


def hand_written(path: str, rows: pa.Table, batch_id: int, minmax: bool = False) -> dict:
    dt = DeltaTable(path)
    if (dt.transaction_version(APP_ID) or -1) >= batch_id:
        return {}
    return (
        dt.merge(
            rows,
            "t.id = s.id",
            source_alias="s",
            target_alias="t",
            streamed_exec=not minmax,
            commit_properties=CommitProperties(
                app_transactions=[Transaction(app_id=APP_ID, version=batch_id)]
            ),
        )
        .when_matched_update_all(predicate="s.seq > t.seq")
        .when_not_matched_insert_all()
        .execute()
    )


def run_side(side: str, base: str, work: str, batches: list[pa.Table]) -> list[dict]:
    path = f"{work}/{side}"
    shutil.copytree(base, path)
    out = []
    sink = ProtocolSink(path, f"{work}/{side}-chk") if side.startswith("txn-delta") else None
    set_pruning(side != "txn-delta-unpruned")
    for b, rows in enumerate(batches):
        STEPS.clear()
        before = DeltaTable(path).version()
        t0 = time.perf_counter()
        if sink is not None:
            t_stage = time.perf_counter()
            committer, sid, token, handles = sink.stage(rows)
            STEPS["allocate+stage"] = (time.perf_counter() - t_stage) * 1000
            t_commit = time.perf_counter()
            sink.commit(committer, b, sid, token, handles)
            STEPS["commit (driver)"] = (time.perf_counter() - t_commit) * 1000
            metrics = merge_metrics(path, before)
        else:
            metrics = hand_written(path, rows, b, minmax=side == "hand-written-minmax")
        ms = (time.perf_counter() - t0) * 1000
        out.append({"batch": b, "ms": ms, "steps": dict(STEPS), "merge": metrics})
    set_pruning(True)
    out.append({"rows_after": table_check(path)})
    return out


# --- Spark ---------------------------------------------------------------------------------


def spark_sides(target: str, work: str, n: int, batch: int, batches: int, workload: str) -> dict:
    import pyspark_txn

    spark = pyspark_txn.local_session("bench-upsert-merge")
    results: dict[str, Any] = {}
    order = ["txn-delta", "foreachBatch"]
    random.shuffle(order)
    for side in order:
        path = f"{work}/spark-{side}"
        shutil.copytree(target, path)
        df = (
            spark.readStream.format("txn-sequence")
            .option("rowsPerBatch", batch)
            .option("totalRows", batch * batches)
            .option("numPartitions", 2)
            .load()
            .selectExpr(f"{spark_key_sql(workload, n, batch)} AS k", f"id div {batch} + 1 AS seq")
            .selectExpr(
                "k AS id",
                "seq",
                "pmod(k * 31 + seq, 100000) AS amount",
                "concat('customer-', cast(pmod(k, 9973) AS string)) AS name",
                "elt(cast(pmod(k, 4) AS int) + 1, 'north', 'south', 'east', 'west') AS region",
            )
        )
        w = df.writeStream.option("checkpointLocation", f"{work}/spark-{side}-chk").trigger(
            availableNow=True
        )
        if side == "txn-delta":
            w = w.format("txn-delta").option("path", path).option("keys", "id")
            w = w.option("sequenceBy", "seq")
        else:

            def each(frame: Any, batch_id: int, path: str = path) -> None:
                hand_written(path, frame.toArrow(), batch_id)

            w = w.foreachBatch(each)
        t0 = time.perf_counter()
        q = w.start()
        q.awaitTermination()
        wall = time.perf_counter() - t0
        progress = [p for p in q.recentProgress if p["numInputRows"]]
        results[side] = {
            "wall_s": wall,
            "trigger_ms": [p["durationMs"]["triggerExecution"] for p in progress],
            "add_batch_ms": [p["durationMs"].get("addBatch") for p in progress],
            "rows_after": table_check(path),
        }
    spark.stop()
    return results


# --- peak memory of phase 2 --------------------------------------------------------------------


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) // 1024
    return -1


def child(job_file: str) -> None:
    """Run one phase 2 (or one hand-written merge) alone; print its memory as JSON."""
    with open(job_file, "rb") as f:
        job = pickle.load(f)
    start = _vm("VmRSS")
    t0 = time.perf_counter()
    if job["side"] == "txn-delta":
        sink = ProtocolSink(job["path"], job["chk"])
        committer = sink.opts.committer()
        start = _vm("VmRSS")
        t0 = time.perf_counter()
        sink.commit(committer, job["batch_id"], job["sid"], job["token"], job["handles"])
    else:
        import pyarrow.parquet as pq

        rows = pq.read_table(job["rows"])  # what foreachBatch's toArrow() holds
        start = _vm("VmRSS")
        t0 = time.perf_counter()
        hand_written(job["path"], rows, job["batch_id"])
    print(
        json.dumps(
            {
                "s": time.perf_counter() - t0,
                "start_mb": start,
                "peak_mb": _vm("VmHWM"),
                "merge": merge_metrics(job["path"], job["version"]),
            }
        )
    )


def target_dir(work: str, n: int, args: argparse.Namespace) -> str:
    size = f"-fs{args.target_file_size}" if args.target_file_size else ""
    return f"{work}/target-{n}-{args.file_rows}{size}"


def memory(args: argparse.Namespace, work: str) -> None:
    print(
        f"{'target':>11} {'batch':>9} {'workload':>9} {'side':>12} {'s':>7} "
        f"{'start MiB':>9} {'peak MiB':>9} {'files -/+':>9} {'copied':>9}"
    )
    for n in args.targets:
        base = target_dir(work, n, args)
        if not os.path.exists(base):
            build_target(base, n, args.file_rows, args.target_file_size)
        for batch in args.batch:
            for workload in args.workloads:
                rows = rows_for(batch_keys(workload, 0, n, batch), 1)
                for side in ("txn-delta", "hand-written"):
                    path = f"{work}/mem-{side}"
                    shutil.rmtree(path, ignore_errors=True)
                    shutil.rmtree(f"{path}-chk", ignore_errors=True)
                    shutil.copytree(base, path)
                    job: dict[str, Any] = {
                        "side": side,
                        "path": path,
                        "chk": f"{path}-chk",
                        "batch_id": 0,
                        "version": DeltaTable(path).version(),
                    }
                    if side == "txn-delta":
                        sink = ProtocolSink(path, f"{path}-chk")
                        _, sid, token, handles = sink.stage(rows)
                        job.update(sid=sid, token=token, handles=handles)
                    else:
                        import pyarrow.parquet as pq

                        job["rows"] = f"{work}/mem-rows.parquet"
                        pq.write_table(rows, job["rows"])
                    with open(f"{work}/job.pickle", "wb") as f:
                        pickle.dump(job, f)
                    proc = subprocess.run(
                        [sys.executable, __file__, "--child", f"{work}/job.pickle"],
                        capture_output=True,
                        text=True,
                    )
                    if proc.returncode != 0:
                        print(
                            f"{n:>11} {batch:>9} {workload:>9} {side:>12} FAILED "
                            f"rc={proc.returncode}: {proc.stderr.strip()[-300:]}"
                        )
                        continue
                    r = json.loads(proc.stdout.strip().splitlines()[-1])
                    m = r["merge"]
                    files = (
                        f"{m.get('num_target_files_removed', '?')}/"
                        f"{m.get('num_target_files_added', '?')}"
                    )
                    print(
                        f"{n:>11} {batch:>9} {workload:>9} {side:>12} {r['s']:>7.2f} "
                        f"{r['start_mb']:>9} {r['peak_mb']:>9} {files:>9} "
                        f"{m.get('num_target_rows_copied', '?'):>9}",
                        flush=True,
                    )


# --- report --------------------------------------------------------------------------------


def median_ms(runs: list[dict], key: str = "ms") -> float:
    vals = [r[key] for r in runs if "batch" in r and r["batch"] > 0]
    return statistics.median(vals) if vals else float("nan")


def step_medians(runs: list[dict]) -> dict[str, float]:
    names = sorted({k for r in runs if r.get("batch", 0) > 0 for k in r["steps"]})
    return {
        n: statistics.median(r["steps"].get(n, 0.0) for r in runs if r.get("batch", 0) > 0)
        for n in names
    }


def report(n: int, workload: str, results: dict[str, list[dict]]) -> None:
    print(f"\n== target {n:,} rows, workload {workload} ==")
    print(
        f"{'side':>20} {'median ms':>9} {'per batch ms':>30} {'files -/+':>9} "
        f"{'copied':>9} {'scan ms':>8} {'rows after':>11}"
    )
    for side, runs in results.items():
        per = " ".join(f"{r['ms']:.0f}" for r in runs if "batch" in r)
        last = [r for r in runs if "batch" in r][-1]["merge"]
        files = (
            f"{last.get('num_target_files_removed', '-')}/{last.get('num_target_files_added', '-')}"
        )
        print(
            f"{side:>20} {median_ms(runs):>9.0f} {per:>30} {files:>9} "
            f"{last.get('num_target_rows_copied', '-'):>9} {last.get('scan_time_ms', '-'):>8} "
            f"{runs[-1]['rows_after']:>11}"
        )
    if "txn-delta" in results and "hand-written" in results:
        ratio = median_ms(results["hand-written"]) / median_ms(results["txn-delta"])
        print(f"hand-written / txn-delta: {ratio:.2f}x (>= 1.0: txn-delta as fast or faster)")
    for side in ("txn-delta", "txn-delta-unpruned"):
        if side in results:
            print(f"  {side}, median ms per step: {steps_line(results[side])}")


def steps_line(runs: list[dict]) -> str:
    """Where a txn-delta batch goes: phase 1 (allocate, stage), the driver's commit
    (preflight, decide and record, phase 2), phase 2 by step, the MERGE by delta-rs's
    own metrics (scan, rewrite; the rest of execution: joining, planning)."""
    steps = step_medians(runs)
    merges = [r["merge"] for r in runs if r.get("batch", 0) > 0]

    def med(key: str) -> float:
        return statistics.median(m.get(key, 0) for m in merges) if merges else 0.0

    commit = steps.get("commit (driver)", 0.0)
    phase2 = steps.get("phase 2", 0.0)
    preflight = steps.get("preflight", 0.0)
    merge = steps.get("phase 2/MERGE", 0.0)
    return (
        f"allocate+stage {steps.get('allocate+stage', 0):.0f} | commit {commit:.0f} = "
        f"preflight {preflight:.0f} + decide/record {commit - preflight - phase2:.0f} + "
        f"phase 2 {phase2:.0f} | phase 2: open table {steps.get('phase 2/open table', 0):.0f}, "
        f"read staged {steps.get('phase 2/read staged', 0):.0f}, "
        f"dedupe {steps.get('phase 2/dedupe', 0):.0f}, MERGE {merge:.0f} "
        f"(pruning condition {steps.get('phase 2/MERGE/pruning', 0):.0f}; delta-rs execution "
        f"{med('execution_time_ms'):.0f}: scan {med('scan_time_ms'):.0f}, rewrite "
        f"{med('rewrite_time_ms'):.0f}), after commit {steps.get('phase 2/after commit', 0):.0f},"
        f" remove spent {steps.get('remove spent', 0) + steps.get('phase 2/remove spent', 0):.0f}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    names = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--targets", type=ints, default=[1_000_000, 10_000_000])
    p.add_argument("--batch", type=ints, default=[100_000])
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--file-rows", type=int, default=250_000)
    p.add_argument("--target-file-size", type=int, help="delta.targetFileSize of the target, bytes")
    p.add_argument("--workloads", type=names, default=["range", "scattered"])
    p.add_argument(
        "--sides",
        type=names,
        default=["txn-delta", "txn-delta-unpruned", "hand-written", "hand-written-minmax"],
    )
    p.add_argument("--spark-target", type=int, default=10_000_000)
    p.add_argument("--spark-batches", type=int, default=4)
    p.add_argument("--no-spark", action="store_true")
    p.add_argument("--memory", action="store_true")
    p.add_argument("--json")
    p.add_argument("--keep", help="work folder to keep (targets are reused from it)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child)
        return
    work = args.keep or tempfile.mkdtemp(prefix="txn-upsert-")
    os.makedirs(work, exist_ok=True)
    print(f"work folder {work}; load average {os.getloadavg()}", flush=True)
    try:
        if args.memory:
            memory(args, work)
            return
        instrument()
        everything: dict[str, Any] = {}
        for n in args.targets:
            base = target_dir(work, n, args)
            if not os.path.exists(base):
                print(
                    f"building {n:,} rows: {build_target(base, n, args.file_rows, args.target_file_size):.1f} s"
                )
            for batch in args.batch:
                for workload in args.workloads:
                    batches = [
                        rows_for(batch_keys(workload, b, n, batch), b + 1)
                        for b in range(args.batches)
                    ]
                    sides = list(args.sides)
                    random.shuffle(sides)
                    results = {}
                    for side in sides:
                        shutil.rmtree(f"{work}/{side}", ignore_errors=True)
                        shutil.rmtree(f"{work}/{side}-chk", ignore_errors=True)
                        results[side] = run_side(side, base, work, batches)
                        shutil.rmtree(f"{work}/{side}", ignore_errors=True)
                        shutil.rmtree(f"{work}/{side}-chk", ignore_errors=True)
                    counts = {s: r[-1]["rows_after"] for s, r in results.items()}
                    assert len(set(counts.values())) == 1, f"sides disagree: {counts}"
                    report(n, workload, {s: results[s] for s in args.sides})
                    everything[f"{n}/{batch}/{workload}"] = results
        if not args.no_spark:
            n, batch = args.spark_target, args.batch[0]
            base = target_dir(work, n, args)
            if not os.path.exists(base):
                print(
                    f"building {n:,} rows: {build_target(base, n, args.file_rows, args.target_file_size):.1f} s"
                )
            spark = spark_sides(base, work, n, batch, args.spark_batches, "range")
            print(f"\n== Spark: target {n:,} rows, {args.spark_batches} batches of {batch:,} ==")
            for side, r in spark.items():
                tr = r["trigger_ms"][1:] or r["trigger_ms"]
                ab = [x for x in r["add_batch_ms"][1:] if x is not None] or [0]
                print(
                    f"{side:>13} triggerExecution {statistics.median(tr):>7.0f} ms "
                    f"(all: {r['trigger_ms']}), addBatch {statistics.median(ab):>7.0f} ms, "
                    f"wall {r['wall_s']:.1f} s, rows/sum(seq) after {r['rows_after']}"
                )
            if len(spark) == 2:
                a = statistics.median(spark["foreachBatch"]["trigger_ms"][1:])
                b = statistics.median(spark["txn-delta"]["trigger_ms"][1:])
                print(f"foreachBatch / txn-delta (triggerExecution): {a / b:.2f}x")
            everything["spark"] = spark
        if args.json:
            with open(args.json, "w") as f:
                json.dump(everything, f, indent=1, default=str)
        print(f"\nload average at the end {os.getloadavg()}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
