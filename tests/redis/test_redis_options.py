"""``txn-redis`` options: parsed once, every mistake named before Redis is touched."""

from __future__ import annotations

import pickle

import pytest

from pyspark_txn.errors import ConfigError
from pyspark_txn.sources.redis import RedisSourceOptions

BASE = {"url": "redis://127.0.0.1:6379/0", "stream": "orders", "group": "g", "claimLog": "/tmp/c"}


def parse(**changes):
    opts = {**BASE, **changes}
    return RedisSourceOptions.parse({k: v for k, v in opts.items() if v is not None})


def test_defaults():
    o = parse()
    assert o.streams == ("orders",)
    assert (o.start_id, o.max_messages_per_batch, o.block_ms, o.claim_idle_ms) == (
        "$",
        1000,
        0,
        None,
    )
    assert o.payload_format == "raw"
    assert o.ddl == "stream string, id string, fields map<string,string>"
    assert o.claim_log.uri == "/tmp/c" and o.claim_log.source_id == "redis:g:orders"
    assert o.consumer.startswith("txn-") and o.consumer == parse().consumer  # stable


def test_option_names_are_case_insensitive_and_streams_split():
    o = RedisSourceOptions.parse(
        {**BASE, "STREAM": " a, b ,c", "MaxMessagesPerBatch": "7", "blockms": "50"}
        | {"stream": " a, b ,c"}
    )
    assert o.streams == ("a", "b", "c")
    assert (o.max_messages_per_batch, o.block_ms) == (7, 50)


def test_the_claim_log_defaults_to_the_checkpoint():
    o = parse(claimLog=None, checkpointLocation="/data/chk/")
    assert o.claim_log.uri == "/data/chk/pyspark_txn/claims"
    assert o.consumer != parse().consumer  # derived from where the claims live


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"bogus": "1"},
            r"unknown option 'bogus'; allowed \(case-insensitive\): .*maxMessagesPerBatch",
        ),
        ({"url": None}, "option url is required"),
        ({"url": "http://x"}, "expected a redis://, rediss:// or unix:// URL"),
        ({"stream": " "}, "option stream is required"),
        ({"stream": "a,,b"}, "distinct, non-empty"),
        ({"stream": "a,a"}, "distinct, non-empty"),
        ({"group": None}, "option group .* is required"),
        ({"startId": "latest"}, r"startId='latest': expected \$ .*, 0 .* or an entry id"),
        ({"maxMessagesPerBatch": "0"}, r"maxMessagesPerBatch='0': expected an integer from 1"),
        ({"maxMessagesPerBatch": "99999999999999999999"}, "to 2147483647"),
        ({"url": "redis://h:abc/0"}, "Port could not be cast to integer"),
        ({"url": "redis://h:1/0?socket_timeout=abc"}, "Invalid value for 'socket_timeout'"),
        ({"url": "redis://h:1/abc"}, "the path must be a database number such as /0"),
        ({"maxMessagesPerBatch": "many"}, "maxMessagesPerBatch='many'"),
        ({"blockMs": "-1"}, r"blockMs='-1': expected an integer from 0"),
        ({"claimIdleMs": "1.5"}, "claimIdleMs='1.5'"),
        (
            {"payloadFormat": "avro"},
            r"payloadFormat='avro': expected one of raw, binary, json \(default raw\)",
        ),
        ({"payloadFormat": "json"}, "payloadFormat=json needs option schema"),
        ({"schema": "a int"}, "option schema is only for payloadFormat=json"),
        (
            {"payloadFormat": "binary", "schema": "a int"},
            "only for payloadFormat=json; binary rows are stream, id, fields map<string,binary>",
        ),
        (
            {"badMessages": "skip"},
            r"option badMessages='skip': expected one of fail, column \(default fail\)",
        ),
        ({"badMessageColumn": "bad"}, "option badMessageColumn is only for badMessages=column"),
        ({"badMessages": "column", "badMessageColumn": " "}, "badMessageColumn must not be empty"),
        (
            {"badMessages": "column", "badMessageColumn": "ID"},
            r"badMessageColumn='ID': the rows already have a column of that name "
            r"\(stream, id, fields\)",
        ),
        (
            {
                "badMessages": "column",
                "payloadFormat": "json",
                "schema": "user string, `_bad_message` int",
            },
            "badMessageColumn='_bad_message': the rows already have .* user, _bad_message",
        ),
        ({"mode": "PERMISSIVE"}, r"unknown option 'mode' \(did you mean badMessages \(fail"),
        (
            {"columnNameOfCorruptRecord": "_corrupt_record"},
            r"'columnnameofcorruptrecord' \(did you mean badMessageColumn, with badMessages=column",
        ),
        ({"jsonField": "doc"}, "jsonField is only for payloadFormat=json"),
        ({"claimLog": None}, "option claimLog .* or checkpointLocation .* is required"),
        ({"claimLogStorageOptions": "{"}, "claimLogStorageOptions is not valid JSON"),
        ({"sslCaCerts": "/ca.pem"}, "needs a rediss:// url"),
        (
            {"url": "rediss://h:1", "sslCertReqs": "maybe"},
            "sslCertReqs='maybe': expected required, optional or none",
        ),
        ({"consumer": " "}, "option consumer must not be empty"),
    ],
)
def test_bad_options_name_the_option_and_what_is_allowed(changes, message):
    with pytest.raises(ConfigError, match=message):
        parse(**changes)


def test_json_schema_columns():
    o = parse(payloadFormat="json", schema="user string, n int", jsonField="doc")
    assert o.ddl == "stream string, id string, user string, n int"
    assert o.json_field == "doc"


def test_bad_messages_as_rows_add_their_column_and_null_out_not_null():
    """badMessages=column: the error column comes last; NOT NULL columns of schema are
    reported nullable (a bad message's row holds null there) and checked per message."""
    bad = "struct<error: string, fields: map<binary,binary>>"
    assert parse().bad_message_column is None  # default: fail
    assert parse(badMessages="FAIL").ddl == parse().ddl
    raw = parse(badMessages="column")
    assert raw.ddl == f"stream string, id string, fields map<string,string>, `_bad_message` {bad}"
    assert raw.required_columns == ()
    binary = parse(payloadFormat="binary", badMessages="column", badMessageColumn="odd`name")
    assert binary.ddl == f"stream string, id string, fields map<string,binary>, `odd``name` {bad}"
    schema = (
        "user string NOT NULL COMMENT 'not null, unless NOT NULL', /* NOT NULL */ "
        "`a, b` decimal(10, 2) not  null, s struct<x: int NOT NULL, y: string>, n int"
    )
    strict = parse(payloadFormat="json", schema=schema)
    assert strict.ddl == f"stream string, id string, {schema}"  # fail: as declared
    assert strict.required_columns == ()
    o = parse(payloadFormat="json", schema=schema, badMessages="column", badMessageColumn="err")
    assert o.ddl == (
        "stream string, id string, user string  COMMENT 'not null, unless NOT NULL', "
        "/* NOT NULL */ `a, b` decimal(10, 2) , s struct<x: int NOT NULL, y: string>, n int, "
        f"`err` {bad}"
    )
    assert o.required_columns == ("user", "a, b")


@pytest.mark.spark
def test_the_reported_schema_is_what_spark_parses(spark):
    """Spark parses the DDL the source reports: NOT NULL gone where a bad row needs null,
    nested NOT NULL kept (the converter checks it), and the reader accepts the result."""
    from pyspark.sql.types import StructType

    o = parse(
        payloadFormat="json",
        schema="user string NOT NULL, s struct<x: int NOT NULL>",
        badMessages="column",
    )
    schema = StructType.fromDDL(o.ddl)
    assert [(f.name, f.nullable) for f in schema.fields] == [
        ("stream", True),
        ("id", True),
        ("user", True),
        ("s", True),
        ("_bad_message", True),
    ]
    assert not schema["s"].dataType["x"].nullable
    o.check_schema(schema)
    parse(payloadFormat="binary", badMessages="column").check_schema(
        StructType.fromDDL(parse(payloadFormat="binary", badMessages="column").ddl)
    )
    strict = StructType.fromDDL(parse(payloadFormat="json", schema="user string NOT NULL").ddl)
    with pytest.raises(ConfigError, match="user stay NOT NULL, which a bad message's row"):
        o.check_schema(StructType.fromDDL(o.ddl.replace("user string", "user string NOT NULL")))
    with pytest.raises(ConfigError, match="must be stream string, id string, user string"):
        o.check_schema(strict)  # the error column is missing


def test_the_password_is_never_shown():
    o = parse(url="redis://u:s3cret@127.0.0.1:1/0", password="other-s3cret")
    assert "s3cret" not in repr(o) and "s3cret" not in o.describe()
    assert pickle.loads(pickle.dumps(o)) == o  # travels to executors as plain config
    for url in (
        "http://u:s3cret@h/0",  # a scheme it refuses
        "u:s3cret@h:1/0",  # no scheme at all
        "redis://:s3cret@h:abc/0",  # a bad port
        "redis://h:abc/0?password=s3cret",  # redis-py's query-string password
    ):
        with pytest.raises(ConfigError) as e:
            parse(url=url)
        assert "s3cret" not in str(e.value), str(e.value)
    for url in ("redis://h:1/0?password=s3cret", "unix:///tmp/r.sock?db=0&password=s3cret"):
        assert "s3cret" not in parse(url=url).describe()


def test_a_schema_that_contradicts_the_options_is_refused():
    from pyspark.sql.types import LongType, MapType, StringType, StructField, StructType

    def schema(*fields):
        return StructType([StructField(n, t) for n, t in fields])

    good = schema(
        ("stream", StringType()),
        ("id", StringType()),
        ("fields", MapType(StringType(), StringType())),
    )
    parse().check_schema(good)
    with pytest.raises(ConfigError, match="must be stream string, id string, fields"):
        parse().check_schema(
            schema(("stream", StringType()), ("id", StringType()), ("x", LongType()))
        )
    json_opts = parse(payloadFormat="json", schema="stream long")
    with pytest.raises(ConfigError, match="don't set .schema()"):
        json_opts.check_schema(
            schema(("stream", StringType()), ("id", StringType()), ("Stream", LongType()))
        )
