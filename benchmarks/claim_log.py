"""Start cost of an acknowledging source's claim log against its history (issue 23, 6).

A start folds the claim log (``RecordStore.load_offsets``) in a fresh process; this
measures that fold's wall time and the process's RSS growth, for a claim log of
``--ids`` message ids in claims of ``--batch`` ids, each acknowledged:

- ``--history``: the log as a version without summaries leaves it (every claim and
  ack event; written in bulk, as compaction leaves it). Run it with that version on
  PYTHONPATH for the "before" figure; with this one it is an upgraded log's first start.
- ``--run`` (default): the log the real ``ClaimCoordinator`` writes over that history
  (one claim and one ack per batch, summaries as it goes), from a broker that hands
  out Redis-shaped ids in order (no server: the broker is not what is measured).
- ``--upgrade``: ``--history``, then a start of this version's coordinator that serves
  ``--more`` batches (it summarizes the old history on its way), measured again.

    python benchmarks/claim_log.py --ids 1000000 --batch 1000
    PYTHONPATH=<old checkout> python benchmarks/claim_log.py --history --ids 1000000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SOURCE = "redis:g:s"

_MEASURE = """
import json, os, sys, time
import deltalake, pandas, pyarrow  # before the baseline: every start pays them anyway
from pyspark_txn.state import DeltaEventLog, RecordStore

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

before = rss()
t = time.perf_counter()
state = RecordStore(DeltaEventLog(sys.argv[1])).load_offsets(sys.argv[2])
took = time.perf_counter() - t
print(json.dumps({
    "fold_s": round(took, 3),
    "rss_mib": round((rss() - before) / 2**20, 1),
    "last_claim": state.last_offset,
    "ids_held": sum(len(ids) for ids in state.claims.values()),
}))
"""


def measure(uri: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, uri, SOURCE],
        capture_output=True,
        text=True,
        check=True,
        env=os.environ,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_history(uri: str, ids: int, batch: int) -> None:
    """Every claim and ack event of ``ids`` ids, as one bulk commit."""
    from deltalake import write_deltalake
    from deltalake.transaction import CommitProperties, Transaction

    from pyspark_txn.state import DeltaEventLog, Event, EventKind
    from pyspark_txn.state.events import events_to_arrow

    DeltaEventLog(uri).create_if_missing()
    events, seq, n = [], 0, 0
    for offset in range((ids + batch - 1) // batch):
        claimed = [f"s/{i + 1}-0" for i in range(n, min(n + batch, ids))]
        n += len(claimed)
        events.append(
            Event(SOURCE, seq, EventKind.CLAIM, payload={"offset": offset, "ids": claimed})
        )
        events.append(Event(SOURCE, seq + 1, EventKind.ACKED, payload={"through": offset}))
        seq += 2
    write_deltalake(
        uri,
        events_to_arrow(events),
        mode="append",
        commit_properties=CommitProperties(
            app_transactions=[Transaction(app_id=SOURCE, version=seq - 1)]
        ),
    )


def run_coordinator(uri: str, ids: int, batch: int, first: int = 0, start: int = -1) -> float:
    from pyspark_txn.sources import redis_broker as redis
    from pyspark_txn.sources.acknowledging import NO_CLAIM, Broker, ClaimCoordinator
    from pyspark_txn.state import DeltaEventLog, RecordStore

    class InOrder(Broker):
        def __init__(self) -> None:
            self.n = first

        def claim(self, max_messages, block_ms):
            got = [f"s/{i + 1}-0" for i in range(self.n, min(self.n + max_messages, ids))]
            self.n += len(got)
            return got

        def fetch(self, ids, arrow_schema):
            raise NotImplementedError

        def ack(self, ids):
            pass

        def high_water(self, ids, marks):
            return redis.high_water(ids, marks)

        def covered(self, marks, message_id):
            return redis.covered(marks, message_id)

    log = DeltaEventLog(uri)
    log.create_if_missing()
    c = ClaimCoordinator(RecordStore(log), SOURCE, InOrder(), uri)
    t = time.perf_counter()
    end = start if start >= 0 else NO_CLAIM
    while True:
        nxt = c.latest(end, batch)
        if nxt == end:
            break
        end = nxt
    c.commit(end)
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ids", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=1000)
    p.add_argument("--history", action="store_true", help="bulk-write an unsummarized log")
    p.add_argument("--upgrade", action="store_true", help="--history, then a start of this one")
    p.add_argument("--more", type=int, default=3, help="--upgrade: batches the start serves")
    p.add_argument("--dir", help="where the claim log goes (default: a temp dir)")
    args = p.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="claim-log-bench-")
    mode = "upgrade" if args.upgrade else "history" if args.history else "run"
    uri = os.path.join(root, f"claims-{args.ids}-{mode}")
    t = time.perf_counter()
    first_start = None
    if args.history or args.upgrade:
        write_history(uri, args.ids, args.batch)
        wrote = time.perf_counter() - t
    else:
        wrote = run_coordinator(uri, args.ids, args.batch)
    if args.upgrade:
        first_start = measure(uri)
        last = (args.ids + args.batch - 1) // args.batch - 1
        total = args.ids + args.more * args.batch
        first_start["start_s"] = round(run_coordinator(uri, total, args.batch, args.ids, last), 1)
    files = sum(len(f) for _, _, f in os.walk(uri))
    size = sum(os.path.getsize(os.path.join(d, x)) for d, _, f in os.walk(uri) for x in f)
    result = {
        "mode": "upgrade" if args.upgrade else "history" if args.history else "run",
        **({"first_start": first_start} if first_start else {}),
        "ids": args.ids,
        "batch": args.batch,
        "write_s": round(wrote, 1),
        "table_files": files,
        "table_mib": round(size / 2**20, 1),
        **measure(uri),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
