"""Draining a Redis stream into Delta: ``txn-redis`` -> ``txn-delta`` against a hand-written loop.

    .venv/bin/python benchmarks/redis_source.py [--messages 1000000] [--per-batch 100000]
        [--profile DIR [--cprofile]] [--no-loop]

Starts its own ``redis-server`` (Debian's package) on a free loopback port in
a temp dir, produces the messages beforehand, then drains the same stream
twice, each with its own consumer group, in one run:

- ``txn-redis`` -> ``txn-delta`` with ``Trigger.AvailableNow`` (claim log,
  two-phase commit, acks after commit);
- a hand-written redis-py loop: ``XREADGROUP`` a batch, ``write_deltalake`` it
  (the same columns), ``XACK`` it; at-least-once, nothing recorded.

Reports messages/s of each and their ratio, after checking that both tables
hold every message once, and Spark's median ``durationMs`` per batch. With
``--profile DIR`` the driver and Spark's Python workers also time each step of
``txn-redis`` -> ``txn-delta`` (``benchmarks/redis_profile``: claim, planning,
read tasks, the JVM hop, write tasks, commits) and print the breakdown of one
batch; ``--cprofile`` adds a cProfile file per read and write task in DIR.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
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


def txn_redis(spark, url: str, base: str, per_batch: int) -> tuple[float, dict[str, float]]:
    """Seconds to drain, and the median ms per batch of each step Spark reports."""
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
    took = time.perf_counter() - t0
    steps: dict[str, list[int]] = {}
    for p in q.recentProgress:
        if p["numInputRows"]:
            for k, v in p["durationMs"].items():
                steps.setdefault(k, []).append(v)
    return took, {k: statistics.median(v) for k, v in steps.items()}


def cpu_by_process(redis_pid: int) -> dict[str, float]:
    """CPU seconds so far of this process's tree (Spark's JVM, its Python workers, each
    with its reaped children) and of redis-server, keyed by kind; psutil if installed."""
    try:
        import psutil
    except ImportError:
        return {}
    out: dict[str, float] = {}
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True), psutil.Process(redis_pid)]:
        try:
            t = proc.cpu_times()
            name = proc.name()
        except psutil.Error:
            continue
        if proc.pid == me.pid:
            kind = "benchmark driver (Python)"
        elif proc.pid == redis_pid:
            kind = "redis-server"
        elif "java" in name:
            kind = "Spark JVM"
        else:
            kind = "Python workers"
        used = t.user + t.system + t.children_user + t.children_system
        out[kind] = out.get(kind, 0.0) + used
    return out


def breakdown(folder: str) -> None:
    """Per batch (cut at each ``partitions`` call), the steps' summed wall and CPU ms."""
    import json

    lines = []
    for name in os.listdir(folder):
        if name.startswith("steps-"):
            with open(os.path.join(folder, name)) as f:
                lines.extend(json.loads(x) for x in f)
    lines.sort(key=lambda x: x["t0"])
    cuts = [x["t0"] for x in lines if x["step"] == "driver.partitions"]
    batches: list[list[dict]] = [[] for _ in cuts]
    for x in lines:
        # a batch: from the claim before its partitions() to the next claim
        k = sum(1 for c in cuts if c <= x["t0"]) - 1
        if x["step"] == "driver.latestOffset" or x["step"].startswith("driver.latest."):
            k += 1  # the claim of the batch planned next
        if 0 <= k < len(batches):
            batches[k].append(x)
    full = [b for b in batches if sum(x.get("rows", 0) for x in b if x["step"] == "task.read")]
    if not full:
        return
    one = full[len(full) // 2]
    print(f"one batch ({len(full)} with rows; #{len(full) // 2}), summed over its calls:")
    first, last = min(x["t0"] for x in one), max(x["t1"] for x in one)
    print(f"  span {1000 * (last - first):,.0f} ms")
    steps: dict[str, list[dict]] = {}
    for x in one:
        steps.setdefault(x["step"], []).append(x)
    for step, xs in sorted(steps.items(), key=lambda kv: min(x["t0"] for x in kv[1])):
        extra = ""
        for key in ("produce", "consumer", "waiting"):
            if key in xs[0]:
                extra += f", {key} {1000 * sum(x[key] for x in xs):,.0f}"
        rows = sum(x.get("rows", 0) for x in xs)
        print(
            f"  {step:22s} calls {len(xs):3d}  wall {1000 * sum(x['wall'] for x in xs):8,.0f} ms"
            f"  cpu {1000 * sum(x['cpu'] for x in xs):8,.0f} ms"
            f"  first start +{1000 * (min(x['t0'] for x in xs) - first):6,.0f}"
            f"  last end +{1000 * (max(x['t1'] for x in xs) - first):6,.0f}"
            + (f"  rows {rows:,}" if rows else "")
            + extra
        )


def floor_source():
    """A Python streaming source of the same rows as the stream (``stream, id, fields``),
    ``per-batch`` rows a batch in two read tasks, with no broker behind it: what Spark's
    Python data source path costs by itself (the floor under ``txn-redis``)."""
    from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

    from pyspark_txn.sources._common import SupportsTriggerAvailableNow

    class Range(InputPartition):
        def __init__(self, lo: int, hi: int) -> None:
            self.lo, self.hi = lo, hi

    class Reader(DataSourceStreamReader, SupportsTriggerAvailableNow):
        """Batches of ``perBatch`` rows (availableNow: one batch each, as txn-redis's)."""

        def __init__(self, options) -> None:
            self.total = int(options["total"])
            self.per_batch = int(options["perBatch"])
            self._last = 0

        def initialOffset(self):
            return {"n": 0}

        def prepareForTriggerAvailableNow(self) -> None:
            pass

        def getDefaultReadLimit(self):
            from pyspark_txn.sources._common import HAS_ADMISSION_CONTROL, ReadMaxRows

            return ReadMaxRows(self.per_batch) if HAS_ADMISSION_CONTROL else None

        def latestOffset(self, start=None, limit=None):
            n = self._last if start is None else start["n"]  # (no start: PySpark < 4.2)
            self._last = min(self.total, n + self.per_batch)
            return {"n": self._last}

        def partitions(self, start, end):
            lo, hi = start["n"], end["n"]
            mid = (lo + hi) // 2
            return [Range(lo, mid), Range(mid, hi)]

        def read(self, partition):
            """10,000-row Arrow batches built with Arrow kernels (little Python per row)."""
            import numpy as np
            import pyarrow.compute as pc

            names = pa.array(["n", "user", "amount"])
            for lo in range(partition.lo, partition.hi, 10_000):
                i = np.arange(lo, min(partition.hi, lo + 10_000))
                n = len(i)
                num = pc.cast(pa.array(i), pa.string())
                ids = pc.binary_join_element_wise(
                    pc.cast(pa.array(i + 1_700_000_000_000), pa.string()), "0", "-"
                )
                user = pc.binary_join_element_wise("u", pc.cast(pa.array(i % 97), pa.string()), "")
                amount = pc.cast(pa.array(i * 1.5), pa.string())
                r = np.arange(n)
                values = pa.concat_arrays([num, user, amount]).take(
                    np.stack([r, n + r, 2 * n + r], axis=1).ravel()
                )
                yield pa.RecordBatch.from_arrays(
                    [
                        pa.array([STREAM] * n, pa.string()),
                        ids,
                        pa.MapArray.from_arrays(
                            pa.array(np.arange(0, 3 * n + 1, 3), pa.int32()),
                            names.take(np.tile([0, 1, 2], n)),
                            values,
                        ),
                    ],
                    schema=SCHEMA,
                )

        def commit(self, end) -> None:
            pass

    class Floor(DataSource):
        @classmethod
        def name(cls) -> str:
            return "redis-bench-floor"

        def schema(self) -> str:
            return "stream string, id string, fields map<string,string>"

        def streamReader(self, schema):
            return Reader(self.options)

    return Floor


def floor(spark, n: int, per_batch: int, base: str, sink: str) -> tuple[float, dict[str, float]]:
    """Seconds for ``n`` rows from :func:`floor_source` into ``sink`` (txn-delta or noop)."""
    t0 = time.perf_counter()
    w = (
        spark.readStream.format("redis-bench-floor")
        .option("total", n)
        .option("perBatch", per_batch)
        .load()
        .writeStream.format(sink)
        .option("checkpointLocation", f"{base}/chk-{sink}")
        .trigger(availableNow=True)
    )
    if sink == "txn-delta":
        w = w.option("path", f"{base}/target")
    q = w.start()
    q.awaitTermination()
    took = time.perf_counter() - t0
    steps: dict[str, list[int]] = {}
    rows = 0
    for p in q.recentProgress:
        if p["numInputRows"]:
            rows += p["numInputRows"]
            for k, v in p["durationMs"].items():
                steps.setdefault(k, []).append(v)
    if rows != n:
        raise SystemExit(f"floor -> {sink}: {rows} rows, expected {n}")
    return took, {k: statistics.median(v) for k, v in steps.items()}


def check(target: str, n: int) -> None:
    ids = DeltaTable(target).to_pyarrow_table(columns=["id"]).column("id")
    if len(ids) != n or len(set(ids.to_pylist())) != n:
        raise SystemExit(f"{target}: {len(ids)} rows, expected {n} distinct messages")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=1_000_000)
    p.add_argument("--per-batch", type=int, default=100_000)
    p.add_argument("--profile", metavar="DIR", help="time each step (benchmarks/redis_profile)")
    p.add_argument("--cprofile", action="store_true", help="with --profile: cProfile each task")
    p.add_argument("--no-loop", action="store_true", help="skip the hand-written loop")
    p.add_argument(
        "--floor",
        action="store_true",
        help="also run the same rows from a brokerless Python source into txn-delta and noop",
    )
    args = p.parse_args()
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        hooks = os.path.join(os.path.dirname(os.path.abspath(__file__)), "redis_profile")
        os.environ["TXN_REDIS_BENCH_PROFILE"] = os.path.abspath(args.profile)
        if args.cprofile:
            os.environ["TXN_REDIS_BENCH_CPROFILE"] = "1"
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [hooks, *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        sys.path.insert(0, hooks)
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
        n = args.messages
        t_loop = None
        if not args.no_loop:
            t_loop = hand_written(url, f"{root}/loop", args.per_batch)
            check(f"{root}/loop", args.messages)
        if args.profile:
            import redis_profile_hooks

            redis_profile_hooks.install()
            for name in os.listdir(args.profile):  # the warm-up's
                os.remove(os.path.join(args.profile, name))
        cpu0 = cpu_by_process(proc.pid)
        t_txn, steps = txn_redis(spark, url, f"{root}/txn", args.per_batch)
        cpu1 = cpu_by_process(proc.pid)
        check(f"{root}/txn/target", args.messages)
        if t_loop is not None:
            print(
                f"hand-written XREADGROUP/write_deltalake/XACK: {t_loop:.1f} s, "
                f"{n / t_loop:,.0f} msgs/s"
            )
        print(
            f"txn-redis -> txn-delta (availableNow):       {t_txn:.1f} s, {n / t_txn:,.0f} msgs/s"
        )
        if t_loop is not None:
            print(f"ratio txn-redis / hand-written: {t_loop / t_txn:.2f}x")
        print(
            "txn-redis -> txn-delta, Spark's median ms per batch: "
            + ", ".join(f"{k} {v:.0f}" for k, v in sorted(steps.items()))
        )
        if cpu1:
            print(
                "txn-redis -> txn-delta, CPU seconds: "
                + ", ".join(f"{k} {v - cpu0.get(k, 0.0):.1f}" for k, v in sorted(cpu1.items()))
                + f" (wall {t_txn:.1f} s, {os.cpu_count()} cores)"
            )
        if args.profile:
            breakdown(args.profile)
        if args.floor:
            spark.dataSource.register(floor_source())
            for sink in ("noop", "txn-delta"):
                took, fsteps = floor(spark, n, args.per_batch, f"{root}/floor", sink)
                print(
                    f"floor: brokerless Python source -> {sink}: {took:.1f} s, "
                    f"{n / took:,.0f} rows/s"
                    + (f", {t_loop / took:.2f}x the hand-written loop" if t_loop else "")
                    + "; median ms per batch: "
                    + ", ".join(f"{k} {v:.0f}" for k, v in sorted(fsteps.items()))
                )
        spark.stop()
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
