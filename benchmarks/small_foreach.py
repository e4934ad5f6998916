"""Tiny batches through ``foreachBatch`` (issue 36 goal 2): the fast path's small-batch
route against the hand-written loop, in one run.

    .venv/bin/python benchmarks/small_foreach.py [--rounds 4] [--batches 60] [--rows 10]
        [--sinks noop,foreachBatch,fast,fast-spark] [--steps] [--seed 1] [--json FILE]

One SparkSession (local[2]), Spark's ``rate-micro-batch`` source (``--rows`` rows a
batch, 2 partitions, the default trigger: as fast as possible), these sinks
(small_batches.py's):

  noop          Spark's noop sink: the baseline (source, planning, Spark's logs)
  foreachBatch  the hand-written loop: DeltaTable(path) every batch, skip a batch id the
                table's app transaction holds, toArrow(), write_deltalake with
                CommitProperties(app_transactions=[Transaction(app_id, batch_id)])
  fast          pyspark_txn.delta_batch_writer: these batches take its small-batch route
  fast-spark    the same with smallBatchRows=0: Spark's writer for every batch (the fast
                path before the small-batch route)
  fast-light    ``fast`` with mode=light (not in the default set)
  fast-before   with ``--before DIR``: ``fast`` of an older copy of the package,
                importable from DIR as ``pyspark_txn_before`` (``git archive`` of the
                commit, its ``pyspark_txn/`` renamed), for before/after in one run

Each sink keeps one table and checkpoint for the whole run. The run is ``--rounds``
rounds; in each round every sink's query is (re)started on its checkpoint and runs
``--batches`` more batches, the sinks in a random order per round (``--seed``), so
that the machine's load drifts over all of them alike. A query's first batch (its
start) is left out. Per round and sink: the median ``triggerExecution`` and
``addBatch`` (ms), the ms added over noop's median of the same round, and the ratio
of added ms, ours / hand-written (the goal: <= 1.0); then the medians over the
rounds. The load average is taken at the start and end of every query. ``--steps``
times the driver's steps of each batch (small_batches.time_steps). Compare sinks
only within one run: the machine is noisy.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import small_batches as sb  # noqa: E402

log = logging.getLogger("small_foreach")

SINKS = ["noop", "foreachBatch", "fast", "fast-spark"]
KNOWN = [*SINKS, "fast-light", "fast-before"]


def run_round(spark, collector, sink: str, work: str, args, until: int) -> dict[str, Any]:
    """(Re)start ``sink``'s query on its checkpoint; stop it once batches up to
    ``until`` - 1 have reported. The batches this run reported, by id."""
    qargs = argparse.Namespace(rows=args.rows, partitions=2, steps=args.steps)
    sb._RUNNING[0] = sink
    load = os.getloadavg()[0]
    q = sb.start_query(spark, sink, work, qargs, args.rounds * args.batches)
    qid, run = str(q.id), str(q.runId)
    started = time.monotonic()
    try:
        while True:
            with collector.cond:
                collector.cond.wait(timeout=1.0)
                done = collector.done(qid, until)
            if done >= until:
                break
            if not q.isActive:
                exc = q.exception()
                raise sb.SinkFailed(str(exc) if exc is not None else "query stopped")
            if time.monotonic() - started > args.stall_s:
                raise sb.SinkFailed(f"{sink}: not done in {args.stall_s} s ({done}/{until})")
    finally:
        if q.isActive:
            q.stop()
        q.awaitTermination(60)
    with collector.cond:
        mine = {b: row for b, row in collector.runs.get(run, {}).items()}
    return {"batches": mine, "loadavg": [load, os.getloadavg()[0]]}


def make_collector(spark):
    """small_batches' listener, also keeping each run's batches apart (by run id)."""
    collector = sb.make_listener(spark)
    collector.runs = {}
    inner = collector.onQueryProgress

    def on_progress(event) -> None:
        inner(event)
        p = event.progress
        d = p.durationMs or {}
        with collector.cond:
            collector.runs.setdefault(str(p.runId), {})[int(p.batchId)] = (
                int(d.get("triggerExecution", -1)),
                int(d.get("addBatch", -1)),
            )

    collector.onQueryProgress = on_progress
    return collector


def figures(rounds: list[dict[str, dict]]) -> list[dict[str, dict]]:
    """Per round and sink: medians (the run's first batch left out), added over noop,
    and the ratio of added ms to the hand-written loop's."""
    out = []
    for r in rounds:
        fig: dict[str, dict] = {}
        for sink, res in r.items():
            ids = sorted(res["batches"])[1:]  # the first batch of a run is its start
            trig = [res["batches"][b][0] for b in ids]
            addb = [res["batches"][b][1] for b in ids]
            fig[sink] = {
                "batches": len(ids),
                "trigger_ms": statistics.median(trig) if trig else float("nan"),
                "add_batch_ms": statistics.median(addb) if addb else float("nan"),
                "trigger_p90_ms": sb.percentile(trig, 90),
                "loadavg": res["loadavg"],
            }
        base = fig.get("noop")
        for f in fig.values():
            if base is not None:
                f["added_ms"] = f["trigger_ms"] - base["trigger_ms"]
                f["added_add_batch_ms"] = f["add_batch_ms"] - base["add_batch_ms"]
        ref = fig.get("foreachBatch")
        for f in fig.values():
            if ref is not None and base is not None:
                for key in ("added_ms", "added_add_batch_ms"):
                    f[f"ratio_{key}"] = f[key] / ref[key] if ref[key] > 0 else float("nan")
        out.append(fig)
    return out


def report(figs: list[dict[str, dict]], args, versions: dict[str, str]) -> str:
    lines = [
        f"small foreachBatch: {args.rounds} rounds x {args.batches} batches x {args.rows} rows, "
        "rate-micro-batch 2 partitions, local[2]; ms per batch, medians (each run's first "
        "batch left out)",
        "versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
        "",
        f"{'round':<6}{'sink':<14}{'trigger':>8}{'p90':>7}{'addBatch':>9}{'+noop':>7}"
        f"{'+noop(aB)':>10}{'/fB':>7}{'/fB(aB)':>8}{'load':>12}",
    ]
    for i, fig in enumerate(figs):
        for sink, f in fig.items():
            load = f"{f['loadavg'][0]:.1f}-{f['loadavg'][1]:.1f}"
            lines.append(
                f"{i:<6}{sink:<14}{f['trigger_ms']:>8.0f}{f['trigger_p90_ms']:>7.0f}"
                f"{f['add_batch_ms']:>9.0f}{f.get('added_ms', float('nan')):>+7.0f}"
                f"{f.get('added_add_batch_ms', float('nan')):>+10.0f}"
                f"{f.get('ratio_added_ms', float('nan')):>7.2f}"
                f"{f.get('ratio_added_add_batch_ms', float('nan')):>8.2f}{load:>12}"
            )
    lines += ["", "medians over the rounds:"]
    for sink in figs[0] if figs else []:

        def over(key: str, sink: str = sink) -> float:
            vals = [f[sink][key] for f in figs if key in f.get(sink, {})]
            return statistics.median(vals) if vals else float("nan")

        lines.append(
            f"  {sink:<14} trigger {over('trigger_ms'):.0f}, addBatch {over('add_batch_ms'):.0f}, "
            f"added over noop {over('added_ms'):+.0f} (addBatch {over('added_add_batch_ms'):+.0f}),"
            f" ours / hand-written {over('ratio_added_ms'):.2f} "
            f"(addBatch {over('ratio_added_add_batch_ms'):.2f})"
        )
    for sink, steps in sb.STEPS.items():
        lines += ["", f"steps of {sink} in the driver (calls per batch, median ms per call):"]
        n = max(1, sum(f[sink]["batches"] + 1 for f in figs if sink in f))
        for label, ms in steps.items():
            lines.append(f"  {label:<50}{len(ms) / n:>6.2f}{statistics.median(ms):>8.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--batches", type=int, default=60, help="batches per sink and round")
    p.add_argument("--rows", type=int, default=10, help="rows per batch")
    p.add_argument("--sinks", default=",".join(SINKS))
    p.add_argument("--seed", type=int, default=1, help="of the sinks' order in each round")
    p.add_argument("--warmup", type=int, default=30, help="noop batches first, not reported")
    p.add_argument("--steps", action="store_true", help="time the driver's steps")
    p.add_argument("--stall-s", type=float, default=900.0)
    p.add_argument("--json")
    p.add_argument("--before", help="folder holding pyspark_txn_before (sink fast-before)")
    args = p.parse_args(argv)
    sinks = [s.strip() for s in args.sinks.split(",") if s.strip()]
    if args.before:
        sys.path.insert(0, os.path.abspath(args.before))
        if "fast-before" not in sinks:
            sinks.append("fast-before")
    unknown = [s for s in sinks if s not in KNOWN]
    if unknown or args.rounds < 1 or args.batches < 3:
        p.error(f"unknown sinks {unknown}; known: {KNOWN}" if unknown else "too few batches")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)
    logging.getLogger("pyspark_txn").setLevel(logging.WARNING)  # a line per batch otherwise
    import pyspark_txn

    spark = pyspark_txn.local_session(
        "bench-small-foreach", **{"spark.ui.showConsoleProgress": "false"}
    )
    collector = make_collector(spark)
    if args.steps:
        sb.time_steps()
    versions = sb.versions()
    root = tempfile.mkdtemp(prefix="txn-small-foreach-")
    rng = random.Random(args.seed)
    rounds: list[dict[str, dict]] = []
    try:
        if args.warmup >= 2:
            sb._RUNNING[0] = "warmup"
            run_round(
                spark,
                collector,
                "noop",
                f"{root}/warmup",
                argparse.Namespace(**{**vars(args), "rounds": 1, "batches": args.warmup}),
                args.warmup,
            )
        for r in range(args.rounds):
            order = sinks[:]
            rng.shuffle(order)
            log.info("round %d: %s", r, ", ".join(order))
            this: dict[str, dict] = {}
            for sink in order:
                this[sink] = run_round(
                    spark, collector, sink, f"{root}/{sink}", args, (r + 1) * args.batches
                )
            rounds.append({s: this[s] for s in sinks})
        checks = {
            s: sb.check_rows(f"{root}/{s}/table", args.rounds * args.batches * args.rows)
            for s in sinks
            if s != "noop"
        }
    finally:
        spark.streams.removeListener(collector)
        spark.stop()
        shutil.rmtree(root, ignore_errors=True)
    figs = figures(rounds)
    text = report(figs, args, versions)
    text += "\n\nrows: " + ", ".join(
        f"{s} {c['rows']}/{c['expected']} {'ok' if c['ok'] else 'FAILED'}"
        for s, c in checks.items()
    )
    print(text, flush=True)
    out = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions,
        "args": vars(args),
        "rounds": figs,
        "rows_check": checks,
        "steps_ms": sb.STEPS,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    res = main()
    sys.exit(0 if all(c["ok"] for c in res["rows_check"].values()) else 1)
