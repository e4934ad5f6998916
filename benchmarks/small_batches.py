"""Per-batch cost of long runs of tiny micro-batches (issue 10), as ratios in one run.

    .venv/bin/python benchmarks/small_batches.py [--batches 10000] [--block 1000]
        [--sinks noop,txn-delta,txn-delta-light,foreachBatch] [--json FILE] [--keep]

One SparkSession (local[2]) runs the sinks one after another, each on a fresh
temp dir and checkpoint, all fed by Spark's ``rate-micro-batch`` source with
``rowsPerBatch=10`` (``--rows``) and the default trigger (as fast as possible):

  noop             Spark's noop sink: the baseline (source, planning, commit log)
  txn-delta        this package's two-phase transactional Delta sink
  txn-delta-light  the same with option mode=light (skipped if the sink refuses it)
  count-only       a Python Arrow stream writer that only counts rows: the floor of
                   any sink on Spark's Python data source path (tasks hand rows to a
                   Python worker, the commit runs in another)
  foreachBatch     the hand-written alternative: toArrow() and delta-rs
                   write_deltalake, skipping batch ids already committed (app txn)
  fast             pyspark_txn.delta_batch_writer in foreachBatch: tiny batches take its
                   small-batch route (collected with toArrow, staged from the driver)
  fast-spark       the same with smallBatchRows=0: Spark's parquet writer stages every
                   batch (the fast path before the small-batch route, issue 36 goal 2)
  fast-light       ``fast`` with mode=light

Only ``value < batches * rows`` passes a filter, so a batch that starts after
the last measured one (the query is stopped from the listener's thread of
events, a little late) writes nothing: the target then holds exactly
``batches * rows`` rows, values 0.. with no duplicates, which is checked at the
end of each run.

Per-batch timings come from a StreamingQueryListener (``triggerExecution`` and
``addBatch`` of each progress event). Per block of ``--block`` batches: median
and p99 of triggerExecution, the median added over noop's same block, the ratio
to foreachBatch's same block; after each block, the record table's files and
bytes (and ``_delta_log`` files) of the txn-delta variants, the target table's
``_delta_log`` files, and RSS of the driver JVM, this Python process and the
Python workers (summed RSS: forked workers share pages, so the sum overstates).
Batch 0 (query start) is left out of the block figures and reported apart.
``--steps`` times the steps of the fast sinks' callback and of the hand-written one
in the driver (wrapping their functions; calls per batch and median ms per call).
The machine is noisy: compare sinks only within one run. Progress goes to the
log (stderr), the report to stdout, every figure to ``--json``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
# Python workers unpickle the count-only sink by module name: let them import it
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_HERE, os.environ.get("PYTHONPATH")]))
from sink_throughput import CountOnlySink, time_calls  # noqa: E402

log = logging.getLogger("small_batches")

ALL_SINKS = [
    "noop",
    "count-only",
    "txn-delta",
    "txn-delta-light",
    "foreachBatch",
    "fast",
    "fast-spark",
    "fast-light",
]
DELTA_SINKS = {"txn-delta", "txn-delta-light", "foreachBatch", "fast", "fast-spark", "fast-light"}
#: Sinks that keep a record table in the checkpoint (its files are reported per block).
RECORD_SINKS = {"txn-delta", "fast", "fast-spark"}
FAST_SINKS = {"fast": {}, "fast-spark": {"smallBatchRows": 0}, "fast-light": {"mode": "light"}}
APP_ID = "small-batches-bench"

#: --steps: sink -> step -> ms of each call (the driver's side of a batch).
STEPS: dict[str, dict[str, list[float]]] = {}
_RUNNING = [""]  # the sink being measured


# -- measurements from /proc ------------------------------------------------------


def _status_kb(pid: int | str, key: str = "VmRSS") -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _ppid(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            # comm may hold spaces and parentheses: the fields after the last ')'
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def python_workers(jvm_pid: int | None) -> list[int]:
    """Pids of the PySpark worker processes: pyspark.daemon and its forked workers,
    pyspark.worker and the other pyspark.* runners (planner, streaming sink/source
    runners), found by their command line and, when known, below the driver JVM."""
    parent: dict[int, int | None] = {}
    cmd: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            parent[int(entry)] = _ppid(entry)
            cmd[int(entry)] = _cmdline(entry)

    def below_jvm(pid: int) -> bool:
        seen = 0
        p: int | None = pid
        while p and seen < 64:
            p = parent.get(p)
            if p == jvm_pid:
                return True
            seen += 1
        return False

    me = os.getpid()
    return [
        pid
        for pid, c in cmd.items()
        if pid != me
        and ("pyspark.daemon" in c or "pyspark.worker" in c or "-m pyspark." in c)
        and (jvm_pid is None or below_jvm(pid))
    ]


def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def memory_mb(jvm_pid: int | None) -> dict[str, float]:
    workers = python_workers(jvm_pid)
    return {
        "rss_jvm_mb": round(_status_kb(jvm_pid) / 1024, 1) if jvm_pid else float("nan"),
        "rss_python_mb": round(_status_kb("self") / 1024, 1),
        "rss_workers_mb": round(sum(_status_kb(p) for p in workers) / 1024, 1),
        # proportional set size: shared pages split between the forked workers
        "pss_workers_mb": round(sum(_pss_kb(p) for p in workers) / 1024, 1),
        "workers": len(workers),
    }


def folder_stats(path: str) -> dict[str, int]:
    files = size = log_files = 0
    for root, _, names in os.walk(path):
        for n in names:
            try:
                size += os.path.getsize(os.path.join(root, n))
            except FileNotFoundError:  # removed while we walked
                continue
            files += 1
            log_files += os.path.basename(root) == "_delta_log"
    return {"files": files, "bytes": size, "log_files": log_files}


def delta_log_files(table: str) -> int:
    try:
        return len(os.listdir(os.path.join(table, "_delta_log")))
    except FileNotFoundError:
        return 0


# -- statistics ---------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        return float("nan")
    s = sorted(values)
    return float(s[max(0, math.ceil(q / 100 * len(s)) - 1)])


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


# -- the listener ---------------------------------------------------------------------


def make_listener(spark):
    from pyspark.sql.streaming import StreamingQueryListener

    class ProgressCollector(StreamingQueryListener):
        """Per query id: batchId -> (triggerExecution ms, addBatch ms, input rows,
        every durationMs phase)."""

        def __init__(self) -> None:
            self.cond = threading.Condition()
            self.batches: dict[str, dict[int, tuple]] = {}

        def onQueryStarted(self, event) -> None:
            pass

        def onQueryIdle(self, event) -> None:
            pass

        def onQueryTerminated(self, event) -> None:
            with self.cond:
                self.cond.notify_all()

        def onQueryProgress(self, event) -> None:
            p = event.progress
            d = p.durationMs or {}
            row = (
                int(d.get("triggerExecution", -1)),
                int(d.get("addBatch", -1)),
                p.numInputRows,
                {k: int(v) for k, v in d.items()},
            )
            with self.cond:
                self.batches.setdefault(str(p.id), {})[int(p.batchId)] = row
                self.cond.notify_all()

        def done(self, qid: str, below: int) -> int:
            """How many of batches 0..below-1 have reported (call with cond held)."""
            got = self.batches.get(qid, {})
            return sum(1 for b in got if b < below)

    collector = ProgressCollector()
    spark.streams.addListener(collector)
    return collector


# -- sinks ------------------------------------------------------------------------------


def _step(label: str, started: float, ended: float | None = None) -> None:
    ended = time.perf_counter() if ended is None else ended
    _record_step(label, (ended - started) * 1000)


def _record_step(label: str, ms: float) -> None:
    STEPS.setdefault(_RUNNING[0], {}).setdefault(label, []).append(ms)


def foreach_batch_to_delta(path: str, app_id: str = APP_ID, steps: bool = False):
    """The hand-written exactly-once Delta writer: skip a batch id the table already
    holds (its app transaction), else append it with the batch id as app txn. It opens
    the table afresh every batch, as such loops do."""

    def write(df, batch_id: int) -> None:
        from deltalake import DeltaTable, write_deltalake
        from deltalake.exceptions import TableNotFoundError
        from deltalake.transaction import CommitProperties, Transaction

        t0 = time.perf_counter()
        try:
            dt: Any = DeltaTable(path)
        except TableNotFoundError:
            dt = None  # first batch: write_deltalake creates the table
        if dt is not None:
            done = dt.transaction_version(app_id)
            if done is not None and done >= batch_id:
                return
        t1 = time.perf_counter()
        data = df.toArrow() if hasattr(df, "toArrow") else df.toPandas()
        t2 = time.perf_counter()
        write_deltalake(
            dt if dt is not None else path,
            data,
            mode="append",
            commit_properties=CommitProperties(
                app_transactions=[Transaction(app_id=app_id, version=batch_id)]
            ),
        )
        if steps:
            t3 = time.perf_counter()
            _step("callback (all of the below)", t0, t3)
            _step("open table, app txn version", t0, t1)
            _step("toArrow", t1, t2)
            _step("write_deltalake (parquet, commit)", t2, t3)

    return write


def time_steps() -> None:
    """Wrap the fast path's steps (its callback in the driver) with timers."""
    from pyspark_txn.sinks import delta_target, fast, light, staging, twophase
    from pyspark_txn.state import store
    from pyspark_txn.state.backends import delta_log

    def wrap(owner, name: str, label: str) -> None:
        time_calls(owner, name, lambda ms: _record_step(label, ms))

    for owner, name, label in [
        (fast.DeltaBatchWriter, "__call__", "callback (all of the below)"),
        (fast, "_spark_job", "Spark's job description (run, batch)"),
        (fast, "read_query_id", "checkpoint: query id"),
        (fast, "read_batch_offsets", "checkpoint: offsets"),
        (fast, "spark_to_arrow_schema", "schema: Spark -> Arrow"),
        (delta_target.DeltaTarget, "check_stream_schema", "target: schema check"),
        (twophase.TwoPhaseCommitter, "load", "record table: load state"),
        (twophase.TwoPhaseCommitter, "allocate", "allocate"),
        (fast.DeltaBatchWriter, "_is_stateful", "stateful? (once per run)"),
        (fast.DeltaBatchWriter, "_collect_small", "probe: limit + toArrow"),
        (
            fast.DeltaBatchWriter,
            "_mark_attempt",
            "  marker of the attempt (the root's: beside the probe)",
        ),
        (fast, "stage_partition", "stage from the driver (parquet, fsync)"),
        (staging, "write_marker", "  marker (in the staging)"),
        (staging, "fsync_folders", "  fsync of the folders"),
        (fast.DeltaBatchWriter, "_spark_stage", "Spark's write, list, CRC32"),
        (delta_target.DeltaTarget, "base", "target: base version"),
        (twophase.TwoPhaseCommitter, "commit", "commit (all of its steps)"),
        (delta_target.DeltaTarget, "committed_batch", "target: committed batch"),
        (delta_target.DeltaTarget, "verify_staged", "verify staged files"),
        (delta_target.DeltaTarget, "preflight", "preflight"),
        (store.RecordStore, "update", "record table: update (appends or not)"),
        (delta_log.DeltaEventLog, "append", "  record table: an append"),
        (delta_target.DeltaTarget, "commit", "phase 2: Delta commit"),
        (delta_target.DeltaTarget, "discard", "discard (staging listing)"),
        (light.LightCommitter, "commit", "light commit (all of its steps)"),
    ]:
        wrap(owner, name, label)


def start_query(spark, sink: str, work: str, args, n_batches: int):
    chk, table = f"{work}/chk", f"{work}/table"
    df = (
        spark.readStream.format("rate-micro-batch")
        .option("rowsPerBatch", args.rows)
        .option("numPartitions", args.partitions)
        .load()
        .where(f"value < {n_batches * args.rows}")
    )
    w = df.writeStream.option("checkpointLocation", chk).queryName(
        f"bench_{sink}".replace("-", "_")
    )
    if sink == "noop":
        return w.format("noop").start()
    if sink == "txn-delta":
        return w.format("txn-delta").start(table)
    if sink == "txn-delta-light":
        return w.format("txn-delta").option("mode", "light").start(table)
    if sink == "foreachBatch":
        return w.foreachBatch(foreach_batch_to_delta(table, steps=args.steps)).start()
    if sink in FAST_SINKS:
        import pyspark_txn

        writer = pyspark_txn.delta_batch_writer(path=table, checkpoint=chk, **FAST_SINKS[sink])
        return w.foreachBatch(writer).start()
    if sink == "fast-before":  # small_foreach.py --before DIR: an older copy, same options
        import pyspark_txn_before  # type: ignore[import-not-found]

        writer = pyspark_txn_before.delta_batch_writer(path=table, checkpoint=chk)
        return w.foreachBatch(writer).start()
    if sink == "count-only":
        return w.format(CountOnlySink.name()).start()
    raise ValueError(f"unknown sink {sink!r}; known: {ALL_SINKS}")


def check_rows(table: str, expected: int) -> dict[str, Any]:
    """Exactly ``expected`` rows with values 0..expected-1, none twice."""
    import pyarrow.compute as pc
    from deltalake import DeltaTable

    values = DeltaTable(table).to_pyarrow_table(columns=["value"]).column("value")
    rows = len(values)
    distinct = pc.count_distinct(values).as_py() if rows else 0
    lo = pc.min(values).as_py() if rows else None
    hi = pc.max(values).as_py() if rows else None
    ok = rows == expected and distinct == rows and lo == 0 and hi == expected - 1
    return {
        "ok": ok,
        "rows": rows,
        "expected": expected,
        "distinct": distinct,
        "min": lo,
        "max": hi,
    }


class SinkFailed(Exception):
    pass


def run_sink(spark, collector, sink: str, work: str, args, jvm_pid, n_batches: int) -> dict:
    """Run one sink for ``n_batches`` batches; per-block snapshots of files and memory."""
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    chk, table = f"{work}/chk", f"{work}/table"
    records = f"{chk}/pyspark_txn/records"
    nblocks = -(-n_batches // args.block)
    snapshots: list[dict] = []
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    q = start_query(spark, sink, work, args, n_batches)
    qid = str(q.id)
    last_count, last_change = -1, time.monotonic()
    last_check = 0.0
    try:
        while True:
            with collector.cond:
                collector.cond.wait(timeout=1.0)
                count = collector.done(qid, n_batches)
            now = time.monotonic()
            if count < n_batches and now - last_check >= 1.0:  # py4j calls: once a second
                last_check = now
                if not q.isActive:
                    exc = q.exception()
                    raise SinkFailed(str(exc) if exc is not None else "query stopped")
            if count != last_count:
                last_count, last_change = count, now
            elif now - last_change > args.stall_s:
                raise SinkFailed(f"no batch completed in {args.stall_s} s (at {count})")
            # a snapshot for each block completed since the last wake-up
            while len(snapshots) < nblocks and count >= min(
                (len(snapshots) + 1) * args.block, n_batches
            ):
                snap: dict[str, Any] = {
                    "at_batches": count,
                    "t_s": round(time.perf_counter() - t0, 2),
                }
                snap.update(memory_mb(jvm_pid))
                if sink in RECORD_SINKS:
                    rs = folder_stats(records)
                    snap.update(
                        records_files=rs["files"],
                        records_bytes=rs["bytes"],
                        records_log_files=rs["log_files"],
                    )
                if sink in DELTA_SINKS:
                    snap["target_log_files"] = delta_log_files(table)
                snapshots.append(snap)
                log.info(
                    "%s: %d/%d batches, %.0f s, JVM %.0f MB, workers %.0f MB%s",
                    sink,
                    count,
                    n_batches,
                    snap["t_s"],
                    snap["rss_jvm_mb"],
                    snap["rss_workers_mb"],
                    f", records {snap['records_files']} files / {snap['records_bytes'] / 1e6:.2f} MB"
                    if "records_files" in snap
                    else "",
                )
            if count >= n_batches:
                break
    finally:
        if q.isActive:
            q.stop()
        try:
            q.awaitTermination(60)
        except Exception as e:  # a stop that interrupted a batch may surface here
            log.debug("%s: after stop: %s", sink, e)
    wall = time.perf_counter() - t0
    with collector.cond:
        got = dict(collector.batches.get(qid, {}))
    res: dict[str, Any] = {
        "status": "ok",
        "batches": sum(1 for b in got if b < n_batches),
        "extra_batches": sum(1 for b in got if b >= n_batches),
        "wall_s": round(wall, 2),
        "first_batch_ms": got.get(0, (None,))[0],
        "trigger_ms": [got[b][0] for b in sorted(got) if b < n_batches],
        "add_batch_ms": [got[b][1] for b in sorted(got) if b < n_batches],
        "phases_ms": [got[b][3] for b in sorted(got) if b < n_batches],
        "snapshots": snapshots,
        "loadavg": [load_before, os.getloadavg()[0]],  # 1-minute load at start and end
    }
    if sink in DELTA_SINKS:
        res["rows_check"] = check_rows(table, n_batches * args.rows)
        if not res["rows_check"]["ok"]:
            res["status"] = "rows check failed"
        log.info("%s: rows check %s", sink, res["rows_check"])
    return res


# -- report -------------------------------------------------------------------------


def phase_medians(phases: list[dict[str, int]]) -> dict[str, float]:
    """Median of each durationMs phase (latestOffset, queryPlanning, addBatch, ...)."""
    keys = sorted({k for d in phases for k in d})
    return {k: median([d.get(k, 0) for d in phases]) for k in keys}


def block_figures(results: dict[str, dict], args, n_batches: dict[str, int]) -> None:
    """Add ``blocks`` (per-block medians, p99, deltas and snapshots) to each ok sink."""
    for sink, res in results.items():
        if "trigger_ms" not in res:
            continue
        trig, addb = res["trigger_ms"], res["add_batch_ms"]
        blocks = []
        for i in range(-(-n_batches[sink] // args.block)):
            lo, hi = i * args.block, min((i + 1) * args.block, len(trig))
            t = [trig[b] for b in range(max(lo, 1), hi)]  # batch 0 is query start
            a = [addb[b] for b in range(max(lo, 1), hi)]
            blk: dict[str, Any] = {
                "block": i,
                "batches": [lo, hi - 1],
                "median_ms": median(t),
                "p99_ms": percentile(t, 99),
                "mean_ms": round(statistics.fmean(t), 1) if t else float("nan"),
                "median_add_batch_ms": median(a),
                "phases_median_ms": phase_medians(res["phases_ms"][max(lo, 1) : hi]),
            }
            if i < len(res["snapshots"]):
                blk.update(res["snapshots"][i])
            blocks.append(blk)
        res["blocks"] = blocks
    base = results.get("noop", {}).get("blocks")
    ref = results.get("foreachBatch", {}).get("blocks")
    for res in results.values():
        for blk in res.get("blocks", []):
            i = blk["block"]
            if base and i < len(base):
                blk["added_over_noop_ms"] = blk["median_ms"] - base[i]["median_ms"]
            if ref and i < len(ref) and ref[i]["median_ms"]:
                blk["ratio_vs_foreachBatch"] = round(blk["median_ms"] / ref[i]["median_ms"], 3)
            if base and ref and i < len(base) and i < len(ref):
                # the goal's measure (issue 36 goal 2): added ms over noop, ours / theirs
                theirs = ref[i]["median_ms"] - base[i]["median_ms"]
                if theirs > 0:
                    blk["added_ratio_vs_foreachBatch"] = round(
                        (blk["median_ms"] - base[i]["median_ms"]) / theirs, 3
                    )


def _f(x, fmt: str = "{:.0f}") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return fmt.format(x)


def report(results: dict[str, dict], args, results_versions: dict[str, str]) -> str:
    lines = [
        f"small batches: {args.batches} batches x {args.rows} rows, blocks of {args.block}, "
        f"rate-micro-batch numPartitions={args.partitions}; ms per batch (triggerExecution), "
        "batch 0 excluded",
        "versions: " + ", ".join(f"{k} {v}" for k, v in results_versions.items()),
        "",
    ]
    head = (
        f"{'sink':<16}{'block':>6}{'median':>8}{'p99':>7}{'addB':>6}{'+noop':>7}{'/fB':>6}"
        f"{'+/+fB':>7}"
        f"{'recFiles':>9}{'recKB':>8}{'recLog':>7}{'tgtLog':>7}{'JVM MB':>8}{'py MB':>7}"
        f"{'wrk MB':>8}{'wrkPSS':>8}{'wrk':>4}"
    )
    lines.append(head)
    lines.append("-" * len(head))
    for sink, res in results.items():
        if "blocks" not in res:
            lines.append(f"{sink:<16}  {res['status']}: {res.get('error', '')[:150]}")
            continue
        for b in res["blocks"]:
            lines.append(
                f"{sink:<16}{b['block']:>6}{_f(b['median_ms']):>8}{_f(b['p99_ms']):>7}"
                f"{_f(b['median_add_batch_ms']):>6}{_f(b.get('added_over_noop_ms'), '{:+.0f}'):>7}"
                f"{_f(b.get('ratio_vs_foreachBatch'), '{:.2f}'):>6}"
                f"{_f(b.get('added_ratio_vs_foreachBatch'), '{:.2f}'):>7}"
                f"{_f(b.get('records_files')):>9}"
                f"{_f(b['records_bytes'] / 1024 if 'records_bytes' in b else None):>8}"
                f"{_f(b.get('records_log_files')):>7}{_f(b.get('target_log_files')):>7}"
                f"{_f(b.get('rss_jvm_mb')):>8}{_f(b.get('rss_python_mb')):>7}"
                f"{_f(b.get('rss_workers_mb')):>8}{_f(b.get('pss_workers_mb')):>8}"
                f"{_f(b.get('workers')):>4}"
            )
    lines.append("")
    lines.append("where the time goes (median ms per phase of durationMs, batches 1..):")
    for sink, res in results.items():
        if "phases_ms" in res:
            ph = phase_medians(res["phases_ms"][1:])
            order = sorted(ph, key=lambda k: (k != "triggerExecution", -ph[k]))
            lines.append(f"  {sink:<16} " + ", ".join(f"{k} {ph[k]:.0f}" for k in order if ph[k]))
    for sink, steps in STEPS.items():
        n = max(1, results.get(sink, {}).get("batches", 1))
        lines.append("")
        lines.append(f"steps of {sink} in the driver (calls per batch, median ms per call):")
        for label, ms in steps.items():
            lines.append(f"  {label:<50}{len(ms) / n:>6.2f}{median(ms):>8.1f}")
    lines.append("")
    for sink, res in results.items():
        if "trigger_ms" in res:
            rc = res.get("rows_check")
            rows = (
                f"rows {rc['rows']}/{rc['expected']} distinct {rc['distinct']} "
                f"{'ok' if rc['ok'] else 'FAILED'}"
                if rc
                else "rows not checked"
            )
            load = res.get("loadavg")
            if load:
                rows += f"; load average {load[0]:.1f} -> {load[1]:.1f}"
            lines.append(
                f"{sink:<16} {res['status']}: {res['batches']} batches in {res['wall_s']:.0f} s "
                f"({res['batches'] / res['wall_s']:.1f}/s), first batch {_f(res['first_batch_ms'])} "
                f"ms, {res['extra_batches']} empty after the last; {rows}"
            )
    return "\n".join(lines)


def refused_mode(msg: str) -> bool:
    """Whether a failure names the option mode (not the query plan dumped after it)."""
    return re.search(r"\bmode\b", msg.split("=== Streaming Query ===")[0]) is not None


def versions() -> dict[str, str]:
    import deltalake
    import pyarrow
    import pyspark

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:  # the code measured: the sink is under active change
        head = subprocess.run(
            ["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", repo, "status", "--porcelain", "pyspark_txn"],
            capture_output=True,
            text=True,
        ).stdout.split("\n")
        git = head + (
            " + uncommitted " + ", ".join(d[3:] for d in dirty if d) if any(dirty) else ""
        )
    except OSError:
        git = "?"
    return {
        "git": git,
        "python": platform.python_version(),
        "pyspark": pyspark.__version__,
        "deltalake": getattr(deltalake, "__version__", "?"),
        "pyarrow": pyarrow.__version__,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=10_000, help="measured batches per sink")
    p.add_argument("--block", type=int, default=1000, help="batches per block of figures")
    p.add_argument("--sinks", default=",".join(ALL_SINKS), help="comma-separated, in run order")
    p.add_argument(
        "--sink-batches",
        default="",
        help="per-sink override of --batches, e.g. foreachBatch=100 (blocks of --block)",
    )
    p.add_argument("--rows", type=int, default=10, help="rows per batch (rowsPerBatch)")
    p.add_argument("--partitions", type=int, default=2, help="source partitions per batch")
    p.add_argument("--warmup", type=int, default=50, help="noop batches run first, not reported")
    p.add_argument("--stall-s", type=float, default=300.0, help="fail a sink after this long idle")
    p.add_argument("--json", help="write every figure to this file")
    p.add_argument("--keep", action="store_true", help="keep the temp dirs (tables, checkpoints)")
    p.add_argument("--steps", action="store_true", help="time the driver's steps of each batch")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    args.sink_list = [s.strip() for s in args.sinks.split(",") if s.strip()]
    for s in args.sink_list:
        if s not in ALL_SINKS:
            p.error(f"unknown sink {s!r}; known: {', '.join(ALL_SINKS)}")
    if args.batches < 2 or args.block < 1:
        p.error("--batches must be >= 2 and --block >= 1")
    args.per_sink = {}
    for item in filter(None, (x.strip() for x in args.sink_batches.split(","))):
        name, _, n = item.partition("=")
        if name not in ALL_SINKS or not n.isdigit() or int(n) < 2:
            p.error(f"--sink-batches: bad item {item!r}")
        args.per_sink[name] = int(n)
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns the JSON-able results (also written to --json)."""
    args = parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.DEBUG if args.verbose else logging.INFO,
            format="%(asctime)s %(name)s %(levelname)s %(message)s",
            stream=sys.stderr,
        )
    logging.getLogger("py4j").setLevel(logging.WARNING)  # one INFO line per callback
    import pyspark_txn

    spark = pyspark_txn.local_session(
        "bench-small-batches", **{"spark.ui.showConsoleProgress": "false"}
    )
    spark.dataSource.register(CountOnlySink)
    try:
        jvm_pid: int | None = int(spark._jvm.java.lang.ProcessHandle.current().pid())
    except Exception:  # not a classic py4j session
        jvm_pid = None
    collector = make_listener(spark)
    if args.steps:
        time_steps()
    at_start = versions()  # the sink may change under a long run: note the code at both ends
    root = tempfile.mkdtemp(prefix="txn-small-batches-")
    log.info("work dir %s, driver JVM pid %s", root, jvm_pid)
    results: dict[str, dict] = {}
    n_batches = {s: args.per_sink.get(s, args.batches) for s in args.sink_list}
    try:
        if args.warmup >= 2:
            log.info("warm-up: %d noop batches", args.warmup)
            run_sink(spark, collector, "noop", f"{root}/warmup", args, jvm_pid, args.warmup)
        for sink in args.sink_list:
            gc.collect()
            spark._jvm.System.gc()
            time.sleep(1)
            log.info("%s: %d batches of %d rows", sink, n_batches[sink], args.rows)
            _RUNNING[0] = sink
            try:
                results[sink] = run_sink(
                    spark, collector, sink, f"{root}/{sink}", args, jvm_pid, n_batches[sink]
                )
            except SinkFailed as e:
                msg = str(e)
                if sink == "txn-delta-light" and refused_mode(msg):
                    log.warning(
                        "txn-delta-light skipped: the sink refused option mode: %s", msg[:300]
                    )
                    results[sink] = {"status": "skipped", "error": msg}
                else:
                    log.error("%s failed: %s", sink, msg[:2000])
                    results[sink] = {"status": "failed", "error": msg}
            except Exception as e:  # a start() that raised
                msg = f"{type(e).__name__}: {e}"
                if sink == "txn-delta-light" and refused_mode(msg):
                    log.warning("txn-delta-light skipped: %s", msg[:300])
                    results[sink] = {"status": "skipped", "error": msg}
                else:
                    log.error("%s failed: %s", sink, msg[:2000])
                    results[sink] = {"status": "failed", "error": msg}
    finally:
        spark.streams.removeListener(collector)
        spark.stop()
        if args.keep:
            log.info("kept %s", root)
        else:
            shutil.rmtree(root, ignore_errors=True)
    block_figures(results, args, n_batches)
    out = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": at_start,
        "git_at_end": versions()["git"],
        "cpus": os.cpu_count(),
        "args": {k: v for k, v in vars(args).items() if k not in ("sink_list", "per_sink")},
        "sink_batches": n_batches,
        "work_dir": root if args.keep else None,
        "sinks": results,
        "steps_ms": STEPS,
        "loadavg": os.getloadavg(),
    }
    if out["git_at_end"] != at_start["git"]:
        log.warning("the code changed during the run: now %s", out["git_at_end"])
    print(report(results, args, at_start), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        log.info("figures written to %s", args.json)
    return out


if __name__ == "__main__":
    res = main()
    bad = [s for s, r in res["sinks"].items() if r["status"] not in ("ok", "skipped")]
    sys.exit(1 if bad else 0)
