"""Latency of the record-write path: safe appends to a Delta record table on local disk.

    .venv/bin/python benchmarks/record_write.py [--writes 400]

Each write is what the sink does per protocol step: fold the sink's events,
run the transition, append the event safely (conditional Delta commit with an
app transaction). Reports the median and p90 per safe write, and the median of
the first and last 50 writes to show that compaction keeps it flat.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from pyspark_txn.state import (
    DeltaEventLog,
    RecordStore,
    SnapshotKind,
    SnapshotRecord,
    TxnHandle,
    allocate,
    fold_sink,
    mark_committed,
    record_snapshot,
    take_over,
)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--writes", type=int, default=400)
    args = p.parse_args()
    path = tempfile.mkdtemp(prefix="txn-records-") + "/records"
    log = DeltaEventLog(path)
    log.create_if_missing()
    store = RecordStore(log)
    store.update("sink", fold_sink, lambda s: take_over(s, "bench", None, "q"))
    timings: list[float] = []
    batch = 0

    def timed(transition) -> None:
        t0 = time.perf_counter()
        store.update("sink", fold_sink, transition)
        timings.append((time.perf_counter() - t0) * 1000)

    while len(timings) < args.writes:
        timed(allocate)
        txns = tuple(TxnHandle(p, f"f{batch}-{p}", 1000, 10_000, "crc32:0") for p in range(2))
        timed(
            lambda s, b=batch, t=txns: record_snapshot(
                s,
                SnapshotRecord("sink", s.ongoing_snapshot_id, b, 1, SnapshotKind.AUTOMATIC, t),
            )
        )
        timed(lambda s: mark_committed(s, s.snapshot_id, None))
        batch += 1
    q = statistics.quantiles(timings, n=10)
    print(f"{len(timings)} safe record writes ({batch} batches) on local disk")
    print(f"median {statistics.median(timings):.1f} ms, p90 {q[-1]:.1f} ms")
    print(
        f"first 50 median {statistics.median(timings[:50]):.1f} ms, "
        f"last 50 median {statistics.median(timings[-50:]):.1f} ms"
    )


if __name__ == "__main__":
    main()
