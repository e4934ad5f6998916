"""Draining a Redis stream into Delta: ``txn-redis`` -> ``txn-delta`` against a hand-written loop.

    .venv/bin/python benchmarks/redis_source.py [--messages 1000000] [--per-batch 100000]

Starts its own ``redis-server`` (Debian's package) on a free loopback port in
a temp dir, produces the messages beforehand, then drains the same stream
twice, each with its own consumer group, in one run:

- ``txn-redis`` -> ``txn-delta`` with ``Trigger.AvailableNow`` (claim log,
  two-phase commit, acks after commit);
- a hand-written redis-py loop: ``XREADGROUP`` a batch, ``write_deltalake`` it
  (the same columns), ``XACK`` it; at-least-once, nothing recorded.

Reports messages/s of each and their ratio, after checking that both tables
hold every message once.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

STREAM = "orders"
SCHEMA = pa.schema(
    [
        pa.field("stream", pa.string()),
        pa.field("id", pa.string()),
        pa.field("fields", pa.map_(pa.string(), pa.string())),
    ]
)


def start_redis(workdir: str) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", workdir,
         "--appendonly", "yes", "--save", ""],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    import redis

    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(200):
        try:
            client.ping()
            return proc, url
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit(f"redis-server did not start on {url}")


def produce(url: str, n: int) -> float:
    import redis

    r = redis.Redis.from_url(url)
    t0 = time.perf_counter()
    for lo in range(0, n, 10_000):
        pipe = r.pipeline(transaction=False)
        for i in range(lo, min(n, lo + 10_000)):
            pipe.xadd(STREAM, {"n": str(i), "user": f"u{i % 97}", "amount": f"{i * 1.5:.2f}"})
        pipe.execute()
    return time.perf_counter() - t0


def hand_written(url: str, target: str, per_batch: int) -> float:
    import redis

    r = redis.Redis.from_url(url)
    r.xgroup_create(STREAM, "loop", id="0")
    t0 = time.perf_counter()
    while True:
        res = r.xreadgroup("loop", "c", {STREAM: ">"}, count=per_batch)
        if not res:
            break
        entries = res[0][1]
        ids = [e[0].decode() for e in entries]
        fields = [[(k.decode(), v.decode()) for k, v in e[1].items()] for e in entries]
        table = pa.Table.from_arrays(
            [pa.array([STREAM] * len(ids)), pa.array(ids), pa.array(fields, SCHEMA[2].type)],
            schema=SCHEMA,
        )
        write_deltalake(target, table, mode="append")
        r.xack(STREAM, "loop", *ids)
    return time.perf_counter() - t0


def txn_redis(spark, url: str, base: str, per_batch: int) -> float:
    t0 = time.perf_counter()
    q = (
        spark.readStream.format("txn-redis")
        .option("url", url)
        .option("stream", STREAM)
        .option("group", "txn")
        .option("startId", "0")
        .option("checkpointLocation", f"{base}/chk")
        .option("maxMessagesPerBatch", per_batch)
        .load()
        .writeStream.format("txn-delta")
        .option("path", f"{base}/target")
        .option("checkpointLocation", f"{base}/chk")
        .trigger(availableNow=True)
        .start()
    )
    q.awaitTermination()
    return time.perf_counter() - t0


def check(target: str, n: int) -> None:
    ids = DeltaTable(target).to_pyarrow_table(columns=["id"]).column("id")
    if len(ids) != n or len(set(ids.to_pylist())) != n:
        raise SystemExit(f"{target}: {len(ids)} rows, expected {n} distinct messages")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=1_000_000)
    p.add_argument("--per-batch", type=int, default=100_000)
    args = p.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    import pyspark_txn

    root = tempfile.mkdtemp(prefix="txn-redis-bench-")
    proc, url = start_redis(root)
    try:
        produced = produce(url, args.messages)
        print(f"produced {args.messages} messages in {produced:.1f} s")
        spark = pyspark_txn.local_session("pyspark-txn-redis-bench")
        # warm-up: Spark's and its Python workers' first start (~7 s) is not measured
        (
            spark.readStream.format("txn-sequence").option("totalRows", 1000).load()
            .writeStream.format("txn-delta").option("path", f"{root}/warm")
            .option("checkpointLocation", f"{root}/warm-chk").trigger(availableNow=True)
            .start().awaitTermination()
        )  # fmt: skip
        t_loop = hand_written(url, f"{root}/loop", args.per_batch)
        check(f"{root}/loop", args.messages)
        t_txn = txn_redis(spark, url, f"{root}/txn", args.per_batch)
        check(f"{root}/txn/target", args.messages)
        n = args.messages
        print(
            f"hand-written XREADGROUP/write_deltalake/XACK: {t_loop:.1f} s, {n / t_loop:,.0f} msgs/s"
        )
        print(
            f"txn-redis -> txn-delta (availableNow):       {t_txn:.1f} s, {n / t_txn:,.0f} msgs/s"
        )
        print(f"ratio txn-redis / hand-written: {t_loop / t_txn:.2f}x")
        spark.stop()
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
