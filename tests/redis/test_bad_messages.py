"""Messages ``txn-redis`` cannot read, against a real redis-server (no Spark).

With ``badMessages=fail`` (the default) the first one fails the batch, naming it
and the way out; with ``badMessages=column`` each becomes a row of its own: the
payload null, the error column holding why and the entry's fields byte for byte.
Both depend on the entry alone, so a replay reads the same rows.
"""

from __future__ import annotations

import decimal

import pyarrow as pa
import pytest
from test_broker import RAW, opened, options

from pyspark_txn.errors import SourceError

BAD = pa.struct([("error", pa.string()), ("fields", pa.map_(pa.binary(), pa.binary()))])
HEAD = [pa.field("stream", pa.string()), pa.field("id", pa.string())]
BINARY = pa.schema([*HEAD, pa.field("fields", pa.map_(pa.string(), pa.binary()))])
# What Spark reports for schema JSON_SCHEMA with badMessages=column: top-level NOT NULL
# gone (a bad row holds null there), nested NOT NULL kept.
JSON_SCHEMA = (
    "user string NOT NULL, amount double, n int, d decimal(5,2), s struct<x: int NOT NULL>"
)
JSON = pa.schema(
    [
        *HEAD,
        pa.field("user", pa.string()),
        pa.field("amount", pa.float64()),
        pa.field("n", pa.int32()),
        pa.field("d", pa.decimal128(5, 2)),
        pa.field("s", pa.struct([pa.field("x", pa.int32(), nullable=False)])),
    ]
)


def with_bad_column(schema: pa.Schema, name: str = "_bad_message") -> pa.Schema:
    return schema.append(pa.field(name, BAD))


def fetched(broker, ids, schema) -> list[dict]:
    rows = [r for batch in broker.fetch(ids, schema) for r in batch.to_pylist()]
    assert [f"{r['stream']}/{r['id']}" for r in rows] == list(ids)
    return rows


def test_fields_that_are_not_utf8_become_rows(redis_server, redis_db, tmp_path):
    good = redis_db.xadd("s", {"k": "fine", "x": "é"}).decode()
    bad_value = redis_db.xadd("s", {"k": b"\xff\xfe", "x": "1"}).decode()
    bad_name = redis_db.xadd("s", {b"\xc3(": b"v"}).decode()
    b = opened(options(redis_server, tmp_path, badMessages="column"))
    ids = b.claim(10, 0)
    rows = fetched(b, ids, with_bad_column(RAW))
    assert rows[0]["fields"] == [("k", "fine"), ("x", "é")] and rows[0]["_bad_message"] is None
    assert [r["id"] for r in rows] == [good, bad_value, bad_name]
    assert rows[1]["fields"] is None
    assert rows[1]["_bad_message"] == {
        "error": "field 'k' is not UTF-8 text ('utf-8' codec can't decode byte 0xff in "
        "position 0: invalid start byte)",
        "fields": [(b"k", b"\xff\xfe"), (b"x", b"1")],
    }
    assert rows[2]["fields"] is None
    assert rows[2]["_bad_message"]["error"].startswith(
        "a field name is not UTF-8 text: b'\\xc3(' ("
    )
    assert rows[2]["_bad_message"]["fields"] == [(b"\xc3(", b"v")]
    assert fetched(b, ids, with_bad_column(RAW)) == rows  # a replay: the same rows

    # payloadFormat=binary: any value is fine, only a field name must be text
    b = opened(
        options(redis_server, tmp_path, payloadFormat="binary", badMessages="column", group="g2")
    )
    rows = fetched(b, b.claim(10, 0), with_bad_column(BINARY))
    assert [r["fields"] for r in rows[:2]] == [
        [("k", b"fine"), ("x", "é".encode())],
        [("k", b"\xff\xfe"), ("x", b"1")],
    ]
    assert [r["_bad_message"] is None for r in rows] == [True, True, False]
    assert rows[2]["_bad_message"]["fields"] == [(b"\xc3(", b"v")]


def test_binary_values_are_read_byte_for_byte(redis_server, redis_db, tmp_path):
    values = [b"", b"\x00", bytes(range(256)), b"\xff" * 70_000, "é".encode()]
    ids = [f"s/{redis_db.xadd('s', {'v': v, 'n': str(i)}).decode()}" for i, v in enumerate(values)]
    b = opened(options(redis_server, tmp_path, payloadFormat="binary"))
    assert b.claim(10, 0) == ids
    rows = fetched(b, ids, BINARY)
    assert [dict(r["fields"]) for r in rows] == [
        {"v": v, "n": str(i).encode()} for i, v in enumerate(values)
    ]


# (what the producer wrote in field doc, or the whole entry; what the error says)
BAD_JSON = [
    ({"doc": b'{"user": "a", "amount": 1.5, "n": 1, "d": "1.25", "s": {"x": 1}}'}, None),
    ({"doc": b'{"user": "b"}', "other": b"\xff"}, None),  # only jsonField must be text
    ({"doc": b'\xff{"user": "c"}'}, "field 'doc' is not UTF-8 text ('utf-8' codec can't"),
    ({"doc": b'{"user": '}, "field 'doc' is not JSON: Expecting value: line 1 column 10"),
    ({"doc": b"[1, 2]"}, "field 'doc' holds a JSON list, expected an object"),
    ({"doc": b'{"user": "d", "amount": "lots"}'}, 'amount: expected a number, got "lots"'),
    ({"doc": b'{"amount": 2}'}, "user is declared NOT NULL in option schema, but the message"),
    ({"doc": b'{"user": null}'}, "user is declared NOT NULL in option schema"),
    ({"doc": b'{"user": "e", "n": 3000000000}'}, "n: 3000000000 is out of range for int32"),
    ({"doc": b'{"user": "f", "d": 12345.678}'}, "d (decimal128(5, 2)): "),
    ({"doc": b'{"user": "g", "s": {}}'}, "s.x is declared NOT NULL, but has no value"),
    ({"json": b"{}", "n": b"7"}, "no field 'doc' (jsonField) to parse; its fields: ['json', 'n']"),
]


def produce_json(redis_db) -> list[str]:
    return [f"s/{redis_db.xadd('s', entry).decode()}" for entry, _ in BAD_JSON]


def test_json_messages_that_cannot_be_read_become_rows(redis_server, redis_db, tmp_path):
    ids = produce_json(redis_db)
    o = options(
        redis_server,
        tmp_path,
        payloadFormat="json",
        jsonField="doc",
        schema=JSON_SCHEMA,
        badMessages="column",
        badMessageColumn="why",
    )
    assert o.required_columns == ("user",)
    b = opened(o)
    assert b.claim(20, 0) == ids
    schema = with_bad_column(JSON, "why")
    rows = fetched(b, ids, schema)
    assert rows[0] == {
        "stream": "s",
        "id": ids[0][2:],
        "user": "a",
        "amount": 1.5,
        "n": 1,
        "d": decimal.Decimal("1.25"),
        "s": {"x": 1},
        "why": None,
    }
    assert rows[1]["user"] == "b" and rows[1]["why"] is None
    for row, (entry, error) in zip(rows[2:], BAD_JSON[2:], strict=True):
        assert row["why"] is not None, (entry, row)
        assert row["why"]["error"].startswith(error), (row["why"]["error"], error)
        assert dict(row["why"]["fields"]) == {k.encode(): v for k, v in entry.items()}
        assert all(row[c] is None for c in ("user", "amount", "n", "d", "s"))
    assert fetched(b, ids, schema) == rows  # a replay: the same rows, errors included


def test_without_the_option_the_first_bad_message_fails_the_batch(redis_server, redis_db, tmp_path):
    ids = produce_json(redis_db)
    b = opened(
        options(redis_server, tmp_path, payloadFormat="json", jsonField="doc", schema=JSON_SCHEMA)
    )
    strict = pa.schema([f.with_nullable(f.name != "user") for f in JSON])  # as Spark has it
    assert b.claim(20, 0) == ids
    assert len(fetched(b, ids[:2], strict)) == 2
    with pytest.raises(SourceError) as e:
        list(b.fetch(ids, strict))
    assert str(e.value) == (
        f"txn-redis: message {ids[2]}: field 'doc' is not UTF-8 text ('utf-8' codec can't "
        "decode byte 0xff in position 0: invalid start byte) (and 9 more in this read task). Its "
        "claim is durable, so every replay of this batch fails the same way: set option "
        "badMessages=column to read such messages as rows holding the error (docs/redis.md)"
    )
    for i in range(3, len(ids)):  # each one alone names itself
        with pytest.raises(SourceError, match=f"message {ids[i]}: .*badMessages=column"):
            list(b.fetch([ids[0], ids[i]], strict))
