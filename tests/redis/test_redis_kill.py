"""``txn-redis`` -> ``txn-delta`` under kill -9 of the whole driver and a broker restart.

Messages are produced between the runs, as a live producer would. Every check
counts every message: once in the target, nothing pending in the group, every
claim acknowledged in the claim log; and the Delta sink's checks (no orphan or
staged file, records consistent with the table).
"""

from __future__ import annotations

import itertools
import os
import random
import sys
import time
from pathlib import Path

import pytest
from e2e.processes import kill_mid_batch, start_group
from test_pipeline import GROUP, RedisPipeline, assert_all_acked, assert_exactly_once, produce

pytestmark = [pytest.mark.spark, pytest.mark.chaos]

DRIVER = str(Path(__file__).parents[1] / "e2e" / "driver.py")
KILL_RUNS = int(os.environ.get("PYSPARK_TXN_KILL_RUNS", "2"))
_LOGS = itertools.count()


def start_driver(base: Path, url: str, per_batch: int):
    log_path = base / f"driver-{next(_LOGS)}.log"
    return start_group(
        [sys.executable, DRIVER, str(base), "0", str(per_batch), "--redis", url], log_path
    )


def test_kill_9_of_the_driver_mid_batch(redis_server, redis_db, tmp_path):
    """Each run commits 1-2 more batches (Spark's commit log), then is killed while a
    batch runs; messages are produced between runs. Every kill must hit a batch."""
    rng = random.Random(int(os.environ.get("PYSPARK_TXN_KILL_SEED", "11")))
    p = RedisPipeline(None, redis_server.url, tmp_path)  # the driver uses the same layout
    sent = produce(redis_db, "orders", 3000)
    hit = []
    for k in range(KILL_RUNS):
        proc = start_driver(tmp_path, redis_server.url, 100)
        hit.append(kill_mid_batch(proc, tmp_path / "chk", rng.randint(1, 2), rng))
        sent |= produce(redis_db, "orders", 300, start=3000 + 300 * k)
    assert None not in hit and hit == sorted(set(hit)), f"batches the kills hit: {hit}"
    final = start_driver(tmp_path, redis_server.url, 100)
    final.wait(timeout=600)
    assert final.returncode == 0, final.log_path.read_text(errors="replace")[-3000:]
    assert_exactly_once(p, sent)  # with the Delta sink's checks
    assert_all_acked(p, redis_db)


def test_a_broker_restart_mid_stream_fails_the_query_and_loses_nothing(
    spark, own_redis_server, tmp_path
):
    """Documented behaviour: a Redis error fails the query (Spark does not retry a
    source); restarted, the query resumes from its checkpoint and claim log."""
    server = own_redis_server["server"]
    p = RedisPipeline(spark, server.url, tmp_path, maxMessagesPerBatch="20")
    r = server.client()
    sent = produce(r, "orders", 400)
    q = (
        p.source()
        .writeStream.format("txn-delta")
        .option("path", p.target)
        .option("checkpointLocation", p.checkpoint)
        .trigger(processingTime="100 milliseconds")
        .start()
    )
    try:
        deadline = time.monotonic() + 120
        while not any(x["numInputRows"] for x in q.recentProgress):
            assert time.monotonic() < deadline and q.isActive, "no batch was committed"
            time.sleep(0.2)
        server.stop()  # SHUTDOWN writes the append-only file: the group and its PEL survive
        with pytest.raises(Exception) as failed:
            q.awaitTermination(120)
        assert "Redis" in str(failed.value), str(failed.value)[:3000]
    finally:
        q.stop()
    server = own_redis_server["server"] = server.restart()
    r = server.client()
    assert r.xinfo_groups("orders")[0]["name"].decode() == GROUP
    sent |= produce(r, "orders", 50, start=400)
    assert p.run() is None
    assert_exactly_once(p, sent)
    assert_all_acked(p, r)
