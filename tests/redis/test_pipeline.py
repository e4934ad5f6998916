"""``txn-redis`` -> ``txn-delta`` with real Spark, a real redis-server and real Delta tables.

Every check compares the target, read back with ``deltalake``, against what
was XADDed: each (stream, id) exactly once with its payload; the group's
pending list and the claim log show every claim acknowledged.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from deltalake import DeltaTable
from pipeline_checks import PipelineRunner, await_end

from pyspark_txn.state import DeltaEventLog, RecordStore

pytestmark = pytest.mark.spark

GROUP = "g"


class RedisPipeline:
    def __init__(self, spark, url: str, base: Path, streams=("orders",), **source_options):
        self.spark = spark
        self.url = url
        self.target = str(base / "target")
        self.checkpoint = str(base / "chk")
        self.streams = streams
        self.source_options = {
            "url": url,
            "stream": ",".join(streams),
            "group": GROUP,
            "startId": "0",
            "checkpointLocation": self.checkpoint,
            "maxMessagesPerBatch": "7",
            **source_options,
        }

    def source(self, **overrides):
        reader = self.spark.readStream.format("txn-redis")
        for k, v in {**self.source_options, **overrides}.items():
            reader = reader.option(k, v)
        return reader.load()

    def run(
        self, *, faults: str | None = None, sink: dict | None = None, **overrides
    ) -> Exception | None:
        """One availableNow run to the end; the query's failure instead of raising it.
        ``faults`` and ``sink`` are the sink's options, ``overrides`` the source's."""
        w = (
            self.source(**overrides)
            .writeStream.format("txn-delta")
            .option("path", self.target)
            .option("checkpointLocation", self.checkpoint)
        )
        for k, v in {**(sink or {}), **({"faultInjection": faults} if faults else {})}.items():
            w = w.option(k, v)
        q = w.trigger(availableNow=True).start()
        try:
            await_end(q, 180)  # a hang fails the test (pytest's Failed is no Exception)
        except Exception as e:
            return e
        return None

    def rows(self) -> list[dict]:
        return DeltaTable(self.target).to_pyarrow_table().to_pylist()

    def sink_checks(self) -> PipelineRunner:
        """The txn-delta sink's checks (same target and checkpoint layout)."""
        runner = PipelineRunner(None, Path(self.target).parent)
        assert runner.target == self.target and runner.checkpoint == self.checkpoint
        return runner

    def claim_state(self):
        store = RecordStore(DeltaEventLog(os.path.join(self.checkpoint, "pyspark_txn", "claims")))
        return store.load_offsets(f"redis:{GROUP}:{','.join(sorted(self.streams))}")


def produce(r, stream: str, n: int, start: int = 0) -> dict[tuple[str, str], dict]:
    sent = {}
    for i in range(start, start + n):
        fields = {"n": str(i), "doc": json.dumps({"user": f"u{i % 3}", "amount": i * 1.5})}
        sent[(stream, r.xadd(stream, fields).decode())] = fields
    return sent


def rows_once(p: RedisPipeline, sent: dict) -> dict[tuple[str, str], dict]:
    """The target's rows by (stream, id), after checking each sent message is there once
    and the Delta sink's own checks: no orphan or staged file left, the record table
    consistent with the table."""
    assert_sink_consistent(p)
    rows = p.rows()
    keys = [(row["stream"], row["id"]) for row in rows]
    assert len(keys) == len(set(keys)), "a message is in the target twice"
    assert set(keys) == set(sent), (
        f"missing {sorted(set(sent) - set(keys))[:5]}, extra {sorted(set(keys) - set(sent))[:5]}"
    )
    return dict(zip(keys, rows, strict=True))


def assert_exactly_once(p: RedisPipeline, sent: dict) -> None:
    for key, row in rows_once(p, sent).items():
        assert dict(row["fields"]) == sent[key]


def assert_sink_consistent(p: RedisPipeline) -> None:
    sink = p.sink_checks()
    sink.assert_no_orphans()
    sink.assert_records_consistent()


def assert_all_acked(p: RedisPipeline, r) -> None:
    for s in p.streams:
        assert r.xpending(s, GROUP)["pending"] == 0, f"pending entries left in {s}"
    state = p.claim_state()
    assert state.last_offset >= 0 and state.acked_through == state.last_offset
    claimed = [m for ids in state.claims.values() for m in ids]
    assert len(claimed) == len(set(claimed))


def test_every_message_exactly_once_over_several_batches(spark, redis_server, redis_db, tmp_path):
    p = RedisPipeline(spark, redis_server.url, tmp_path, streams=("orders", "refunds"))
    sent = produce(redis_db, "orders", 14) | produce(redis_db, "refunds", 6)
    assert p.run() is None
    assert_exactly_once(p, sent)
    assert p.claim_state().last_offset >= 2  # 20 messages, at most 7 per batch
    sent |= produce(redis_db, "orders", 9, start=14)
    assert p.run() is None  # a restart: acks anything left, then the new messages
    assert_exactly_once(p, sent)
    assert_all_acked(p, redis_db)
    (group,) = redis_db.xinfo_groups("orders")
    assert group["consumers"] == 1


def test_a_replayed_batch_reads_the_same_messages(spark, redis_server, redis_db, tmp_path):
    p = RedisPipeline(spark, redis_server.url, tmp_path)
    sent = produce(redis_db, "orders", 20)
    assert p.run() is None
    commits = sorted(
        int(f) for f in os.listdir(os.path.join(p.checkpoint, "commits")) if f.isdigit()
    )
    last = commits[-1]
    claims_before = dict(p.claim_state().claims)
    for name in (str(last), f".{last}.crc"):  # Spark forgets it finished the last batch
        os.remove(os.path.join(p.checkpoint, "commits", name))
    sent |= produce(redis_db, "orders", 5, start=20)
    assert p.run() is None
    assert_exactly_once(p, sent)
    after = p.claim_state()
    assert {k: after.claims[k] for k in claims_before} == claims_before  # nothing re-claimed
    assert_all_acked(p, redis_db)


def test_redelivered_messages_never_appear_twice(spark, redis_server, redis_db, tmp_path):
    p = RedisPipeline(spark, redis_server.url, tmp_path, claimIdleMs="0")
    sent = produce(redis_db, "orders", 21)
    # batch 1 is claimed, then fails before the sink's record: its claim stays unacked
    assert p.run(faults="before_record:raise@batch=1") is not None
    state = p.claim_state()
    in_flight = [m for off, ids in state.claims.items() if off > state.acked_through for m in ids]
    assert in_flight and redis_db.xpending("orders", GROUP)["pending"] >= len(in_flight)
    # another consumer takes them over (XAUTOCLAIM) and hands one back to ours (XCLAIM) ...
    moved = redis_db.xautoclaim("orders", GROUP, "intruder", 0, "0-0", count=100)[1]
    assert len(moved) >= len(in_flight)
    ours = next(
        c["name"] for c in redis_db.xinfo_consumers("orders", GROUP) if c["name"] != b"intruder"
    )
    redis_db.xclaim("orders", GROUP, ours, 0, [moved[0][0]])
    # ... and the group's position is reset: every entry is delivered again
    redis_db.xgroup_setid("orders", GROUP, "0")
    sent |= produce(redis_db, "orders", 4, start=21)
    assert p.run() is None  # replays batch 1, then drops every redelivery
    assert_exactly_once(p, sent)
    assert_all_acked(p, redis_db)  # the intruder's pending entries included


def test_bad_options_fail_before_anything_is_claimed(spark, redis_server, redis_db, tmp_path):
    from py4j.protocol import Py4JJavaError
    from pyspark.errors import PySparkException

    produce(redis_db, "orders", 3)
    p = RedisPipeline(spark, redis_server.url, tmp_path)
    for bad in (
        {"maxMessagesPerBatch": "zero"},
        {"payloadFormat": "json"},
        {"payloadFormat": "xml"},
        {"consumerName": "x"},
    ):
        with pytest.raises((PySparkException, Py4JJavaError, ValueError)) as e:
            p.run(**bad)
        (name,) = bad
        assert name in str(e.value) or name.lower() in str(e.value), str(e.value)[:2000]
    assert redis_db.xinfo_groups("orders") == []  # no group, no consumer, nothing pending
    assert not os.path.exists(os.path.join(p.checkpoint, "pyspark_txn", "claims"))


def test_an_unreachable_broker_fails_the_query_naming_the_url(spark, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"redis://127.0.0.1:{port}/0"
    p = RedisPipeline(spark, url, tmp_path, socketTimeoutMs="1000")
    failure = p.run()
    assert failure is not None
    assert f"cannot reach Redis at {url}" in str(failure)


def test_json_payloads_become_typed_columns(spark, redis_server, redis_db, tmp_path):
    p = RedisPipeline(
        spark,
        redis_server.url,
        tmp_path,
        payloadFormat="json",
        jsonField="doc",
        schema="user string, amount double",
    )
    sent = produce(redis_db, "orders", 10)
    assert p.run() is None
    rows = sorted(p.rows(), key=lambda row: int(sent[(row["stream"], row["id"])]["n"]))
    assert [(row["user"], row["amount"]) for row in rows] == [
        (f"u{i % 3}", i * 1.5) for i in range(10)
    ]
    assert list(rows[0]) == ["stream", "id", "user", "amount"]


def test_two_readers_with_one_group_name_on_other_streams_keep_apart(
    spark, redis_server, redis_db, tmp_path
):
    """A Redis group belongs to its stream: readers of one query named alike on other
    streams have claim logs of their own (they once served each other's claims)."""
    a = RedisPipeline(spark, redis_server.url, tmp_path, streams=("left",))
    b = RedisPipeline(spark, redis_server.url, tmp_path, streams=("right",))
    sent = produce(redis_db, "left", 15) | produce(redis_db, "right", 10)
    q = (
        a.source()
        .unionByName(b.source())
        .writeStream.format("txn-delta")
        .option("path", a.target)
        .option("checkpointLocation", a.checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    await_end(q, 180)
    assert_exactly_once(a, sent)
    assert_all_acked(a, redis_db)
    assert_all_acked(b, redis_db)
