"""``txn-redis`` -> ``txn-delta`` with messages the source cannot read among good ones.

With ``badMessages=column`` every message arrives exactly once, a fault and a
restart in between included: good ones as rows, bad ones as rows whose payload
is null and whose error column says why and holds their fields byte for byte;
the group's pending list ends empty and every claim acknowledged. Without it a
bad message stops the query, every replay again, until the option is set.
"""

from __future__ import annotations

import json
import random

import pytest
from test_bad_messages import BAD_JSON, JSON_SCHEMA
from test_pipeline import RedisPipeline, assert_all_acked, produce, rows_once

pytestmark = pytest.mark.spark

# txn-delta cannot write a null struct whose fields are NOT NULL (the parquet writer
# refuses the nulls under it), bad messages or not: no nested NOT NULL here.
SCHEMA = JSON_SCHEMA.replace("x: int NOT NULL", "x: int")
BAD = [(entry, error) for entry, error in BAD_JSON if error and not error.startswith("s.x")]


def produce_mixed(r, stream: str, start: int = 0) -> tuple[dict, dict]:
    """Two good messages (fields n and doc, as ``produce``), then a bad one, and again:
    (good: key -> fields, bad: key -> (fields, how its error starts))."""
    good: dict = {}
    bad: dict = {}
    for i, (entry, error) in enumerate(BAD):
        good |= produce(r, stream, 2, start=start + 2 * i)
        bad[(stream, r.xadd(stream, entry).decode())] = (entry, error)
    return good, bad


def assert_rows(p: RedisPipeline, good: dict, bad: dict, column: str = "_bad_message") -> None:
    rows = rows_once(p, good | bad)
    for key, fields in good.items():
        doc = json.loads(fields["doc"])
        row = rows[key]
        assert (row["user"], row["amount"], row[column]) == (doc["user"], doc["amount"], None)
    for key, (entry, error) in bad.items():
        row = rows[key]
        assert all(row[c] is None for c in ("user", "amount", "n", "d", "s")), row
        assert row[column]["error"].startswith(error), (row[column]["error"], error)
        assert dict(row[column]["fields"]) == {k.encode(): v for k, v in entry.items()}


@pytest.mark.parametrize("rule", ["after_claim:raise@batch=2", "after_record:raise@batch=2"])
def test_bad_messages_arrive_once_as_rows_across_a_fault(
    spark, redis_server, redis_db, tmp_path, rule
):
    p = RedisPipeline(
        spark,
        redis_server.url,
        tmp_path,
        streams=("orders", "refunds"),
        payloadFormat="json",
        jsonField="doc",
        schema=SCHEMA,
        badMessages="column",
    )
    good, bad = produce_mixed(redis_db, "orders")
    more_good, more_bad = produce_mixed(redis_db, "refunds")
    good, bad = good | more_good, bad | more_bad
    failure = p.run(faults=rule, faultInjection=rule)  # the sink's and the source's
    point = rule.partition(":")[0]
    assert failure is not None and f"injected fault at {point}" in str(failure), failure
    more_good, more_bad = produce_mixed(redis_db, "orders", start=100)
    good, bad = good | more_good, bad | more_bad
    assert p.run() is None
    assert_rows(p, good, bad)
    assert_all_acked(p, redis_db)
    nullable = {f.name: f.nullable for f in p.source().schema.fields}
    assert nullable["user"], "NOT NULL in schema, nullable in the rows: bad rows hold null"


def test_a_bad_message_stops_the_query_until_bad_messages_become_rows(
    spark, redis_server, redis_db, tmp_path
):
    p = RedisPipeline(spark, redis_server.url, tmp_path)  # raw: fields map<string,string>
    good = produce(redis_db, "orders", 10)
    entry = {"k": b"\xff not text", "n": b"10"}
    key = ("orders", redis_db.xadd("orders", entry).decode())
    good |= produce(redis_db, "orders", 5, start=11)
    for _ in range(2):  # batch 0 is written, batch 1 fails, and fails again when replayed
        failure = p.run()
        assert failure is not None
        assert f"message orders/{key[1]}: field 'k' is not UTF-8 text" in str(failure), failure
        assert "set option badMessages=column" in str(failure)
        assert len(p.rows()) == 7
    assert redis_db.xpending("orders", "g")["pending"] == 7  # batch 1, acked by nobody
    # the way out: the same checkpoint, bad messages as rows (a new column for the table)
    assert p.run(badMessages="column", sink={"mergeSchema": "true"}) is None
    rows = rows_once(p, good | {key: entry})
    for k, fields in good.items():
        assert (dict(rows[k]["fields"]), rows[k]["_bad_message"]) == (fields, None)
    assert rows[key]["fields"] is None
    assert rows[key]["_bad_message"] == {
        "error": "field 'k' is not UTF-8 text ('utf-8' codec can't decode byte 0xff in "
        "position 0: invalid start byte)",
        "fields": [(b"k", b"\xff not text"), (b"n", b"10")],
    }
    assert_all_acked(p, redis_db)


def test_binary_payloads_round_trip_byte_for_byte(spark, redis_server, redis_db, tmp_path):
    rng = random.Random(7)
    p = RedisPipeline(spark, redis_server.url, tmp_path, payloadFormat="binary")
    sent = {}
    for i, size in enumerate([0, 1, 2, 17, 255, 4096, 70_000] * 3):
        fields = {"v": rng.randbytes(size), "n": str(i).encode()}
        sent[("orders", redis_db.xadd("orders", fields).decode())] = fields
    assert p.run() is None
    for key, row in rows_once(p, sent).items():
        assert dict(row["fields"]) == sent[key]
    assert_all_acked(p, redis_db)
