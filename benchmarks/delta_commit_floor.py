"""What a one-event record append costs through delta-rs, against the floor of a Delta
commit written directly (issue 36: the lever left for goals 1-3).

    .venv/bin/python benchmarks/delta_commit_floor.py [--appends 300]

Two Delta tables of the record table's shape on local disk, one event (one row) per
commit, each with the app transaction ``txn(stream, seq)``, as the record table is
written:

  delta-rs   ``write_deltalake`` on a cached ``DeltaTable`` (what
             ``DeltaEventLog.append`` does, without its checks and upkeep)
  direct     the row's parquet by pyarrow (fsynced), then the commit file written
             next to a temporary one and linked into place, so that it appears whole
             or not at all and a second writer of the same version fails (as
             delta-rs's local store does); the log folder fsynced

and, for a reader in another process that holds the delta-rs table open, what
catching up on each new commit costs: ``update_incremental`` against reading the one
new commit file. The delta-rs table is checkpointed every ``--checkpoint-every``
versions (the record table's compaction period) and both of its objects are then
opened afresh, as ``DeltaEventLog`` does; hooks are off as there.

Not product code: ``direct`` handles one writer on local disk, and nothing of
checkpoints, protocol features or object stores. It measures what the per-event cost
would be if the record table's appends and catch-up were ours rather than delta-rs's.
At the end delta-rs reads the ``direct`` table back: every row and the stream's
transaction version must be there, else the run fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid

import pyarrow as pa
import pyarrow.parquet as pq

from pyspark_txn.storage.fs import fsync_dir


def _event(seq: int) -> pa.Table:
    return pa.table({"stream": ["sink"], "seq": [seq], "payload": ["x" * 400]})


def direct_append(root: str, version: int, seq: int) -> None:
    """Commit ``version`` (one add, one txn) by put-if-absent; FileExistsError if taken."""
    name = f"part-{uuid.uuid4()}.parquet"
    path = os.path.join(root, name)
    with open(path, "wb") as f:
        pq.write_table(_event(seq), f)
        f.flush()
        os.fsync(f.fileno())
    now = int(time.time() * 1000)
    actions = [
        {"commitInfo": {"timestamp": now, "operation": "WRITE"}},
        {"txn": {"appId": "sink", "version": seq, "lastUpdated": now}},
        {
            "add": {
                "path": name,
                "partitionValues": {},
                "size": os.stat(path).st_size,
                "modificationTime": now,
                "dataChange": True,
            }
        },
    ]
    log_dir = os.path.join(root, "_delta_log")
    tmp = os.path.join(log_dir, f".tmp-{uuid.uuid4()}")
    with open(tmp, "w") as f:
        f.write("".join(json.dumps(a) + "\n" for a in actions))
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, os.path.join(log_dir, f"{version:020d}.json"))
    finally:
        os.unlink(tmp)
    fsync_dir(log_dir)


def main(argv: list[str] | None = None) -> dict[str, float]:
    from deltalake import DeltaTable, write_deltalake
    from deltalake.transaction import CommitProperties, PostCommitHookProperties, Transaction

    p = argparse.ArgumentParser()
    p.add_argument("--appends", type=int, default=300)
    p.add_argument("--checkpoint-every", type=int, default=32)
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="txn-commit-floor-")
    via_rs, direct = os.path.join(work, "delta-rs"), os.path.join(work, "direct")
    for path in (via_rs, direct):
        write_deltalake(
            path,
            _event(0),
            commit_properties=CommitProperties(app_transactions=[Transaction("sink", 0)]),
        )
    writer, reader = DeltaTable(via_rs), DeltaTable(via_rs)
    no_hooks = PostCommitHookProperties(create_checkpoint=False, cleanup_expired_logs=False)
    ms: dict[str, list[float]] = {"delta-rs": [], "direct": [], "catch-up": [], "read-new": []}
    for seq in range(1, args.appends + 1):
        started = time.perf_counter()
        write_deltalake(
            writer,
            _event(seq),
            mode="append",
            commit_properties=CommitProperties(app_transactions=[Transaction("sink", seq)]),
            post_commithook_properties=no_hooks,
        )
        ms["delta-rs"].append(time.perf_counter() - started)
        started = time.perf_counter()
        direct_append(direct, seq, seq)
        ms["direct"].append(time.perf_counter() - started)
        started = time.perf_counter()
        reader.update_incremental()
        ms["catch-up"].append(time.perf_counter() - started)
        started = time.perf_counter()
        with open(os.path.join(via_rs, "_delta_log", f"{seq:020d}.json")) as f:
            [json.loads(line) for line in f]
        ms["read-new"].append(time.perf_counter() - started)
        if seq % args.checkpoint_every == 0:
            writer.create_checkpoint()
            writer, reader = DeltaTable(via_rs), DeltaTable(via_rs)
    check = DeltaTable(direct)
    rows = check.to_pyarrow_table().num_rows
    if rows != args.appends + 1 or check.transaction_version("sink") != args.appends:
        raise SystemExit(f"the direct table reads back wrong: {rows} rows")
    out = {k: statistics.median(v) * 1000 for k, v in ms.items()}
    half = args.appends // 2
    print(f"{args.appends} one-row appends on local disk (median ms; first / second half)")
    for k, v in ms.items():
        print(
            f"  {k:9} {out[k]:6.2f}   {statistics.median(v[:half]) * 1000:6.2f} / "
            f"{statistics.median(v[half:]) * 1000:6.2f}"
        )
    return out


if __name__ == "__main__":
    main()
