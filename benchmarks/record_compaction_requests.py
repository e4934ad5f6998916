"""S3 requests of each step of the record table's upkeep (issue 36 goal 3: where the
~260 requests of a compaction batch go).

    .venv/bin/python benchmarks/record_compaction_requests.py [--events 32]

moto's S3 server on loopback behind ``s3_requests.CountingProxy``. A record table on
``s3://`` gets ``--events`` one-event appends (its compaction period: 32) with its own
upkeep off, then runs the steps ``DeltaEventLog._maintain`` runs at that version, one at
a time, counting the requests of each: ``optimize.compact``, ``create_checkpoint``,
``cleanup_metadata``, ``vacuum``; and last what a process that held the table pays to
read it again from the new checkpoint (each Spark Python worker that uses the table
does). At the end every event must read back, else the run fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import s3_requests  # noqa: E402

from pyspark_txn.state import DeltaEventLog, Event, EventKind  # noqa: E402
from pyspark_txn.state.backends import delta_log  # noqa: E402
from pyspark_txn.storage.delta_tables import forget_table  # noqa: E402


def _event(seq: int) -> Event:
    return Event(stream="bench", seq=seq, kind=EventKind.EPOCH, epoch=seq + 1, query_id="bench")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=32)
    args = ap.parse_args(argv)

    moto, (host, port) = s3_requests.start_moto()
    proxy = s3_requests.CountingProxy((host, port)).start()
    try:
        creds = s3_requests.setup_environment(
            f"http://127.0.0.1:{proxy.port}", tempfile.mkdtemp(prefix="s3compact-")
        )
        s3_requests.create_bucket(host, port)
        uri = f"s3://{s3_requests.BUCKET}/records"
        log = DeltaEventLog(uri, creds, compact_every=0)
        for seq in range(args.events):
            log.append(_event(seq))

        def step(label: str, fn: Callable[[], Any]) -> None:
            before = sum(proxy.snapshot().values())
            t = time.perf_counter()
            fn()
            ms = 1000 * (time.perf_counter() - t)
            n = sum(proxy.snapshot().values()) - before
            print(f"{label:34s} {n:5d} requests {ms:8.1f} ms")

        dt = log._open()
        print(f"record table at version {dt.version()}, {args.events} events")
        step(
            "optimize.compact",
            lambda: dt.optimize.compact(post_commithook_properties=delta_log._NO_HOOKS()),
        )
        step("create_checkpoint", dt.create_checkpoint)
        step("cleanup_metadata", dt.cleanup_metadata)
        step(
            "vacuum",
            lambda: dt.vacuum(retention_hours=0, dry_run=False, enforce_retention_duration=False),
        )
        forget_table(uri, creds)
        events: list[Event] = []
        step("a holder reads it again", lambda: events.extend(log.read("bench")))
        if [e.seq for e in events] != list(range(args.events)):
            print(f"FAILED: read back {[e.seq for e in events]}", file=sys.stderr)
            return 1
        return 0
    finally:
        proxy.stop()
        moto.stop()


if __name__ == "__main__":
    sys.exit(main())
