"""The Redis calls of ``txn-redis`` against a real redis-server (no Spark)."""

from __future__ import annotations

import datetime as dt

import pyarrow as pa
import pytest

from pyspark_txn.errors import SourceError
from pyspark_txn.sources.acknowledging import ClaimCoordinator, ack_committed
from pyspark_txn.sources.redis import RedisSourceOptions
from pyspark_txn.sources.redis_rows import _converter, _row_converter

RAW = pa.schema(
    [
        pa.field("stream", pa.string()),
        pa.field("id", pa.string()),
        pa.field("fields", pa.map_(pa.string(), pa.string())),
    ]
)


def options(redis_server, tmp_path, **extra):
    opts = {
        "url": redis_server.url,
        "stream": "s",
        "group": "g",
        "startId": "0",
        "claimLog": str(tmp_path / "claims"),
        **extra,
    }
    return RedisSourceOptions.parse(opts)


def opened(o):
    b = o.connect()
    b.open()
    return b


def test_the_group_is_created_from_start_id_with_the_stream(redis_server, redis_db, tmp_path):
    redis_db.xadd("old", {"a": "1"})
    opened(options(redis_server, tmp_path, stream="new,old", startId="$"))
    assert redis_db.exists("new")  # MKSTREAM
    for s in ("new", "old"):
        (group,) = redis_db.xinfo_groups(s)
        assert group["name"] == b"g" and group["pending"] == 0
    b = opened(options(redis_server, tmp_path, stream="new,old", startId="$"))  # exists: fine
    assert b.claim(10, 0) == []  # '$': what was there before the group is not delivered


def test_claims_are_bounded_and_fetch_returns_exactly_the_ids(redis_server, redis_db, tmp_path):
    a = [redis_db.xadd("a", {"k": f"a{i}"}).decode() for i in range(5)]
    b_ = [redis_db.xadd("b", {"k": f"b{i}", "x": "é"}).decode() for i in range(5)]
    b = opened(options(redis_server, tmp_path, stream="a,b"))
    first = b.claim(7, 0)
    assert len(first) == 7
    second = b.claim(7, 0)
    assert sorted(first + second) == sorted([f"a/{i}" for i in a] + [f"b/{i}" for i in b_])
    assert b.claim(7, 0) == []
    assert sorted(b.pending()) == sorted(first + second)
    want = [second[-1], first[0], first[3]]  # any order, the claim's order is kept
    (batch,) = list(b.fetch(want, RAW))
    assert batch.schema == RAW
    rows = batch.to_pylist()
    assert [f"{r['stream']}/{r['id']}" for r in rows] == want
    assert all(dict(r["fields"])["k"].startswith(r["stream"]) for r in rows)
    b.ack(first)
    assert sorted(b.pending()) == sorted(second)


def test_a_claimed_message_deleted_before_its_read_is_an_error(redis_server, redis_db, tmp_path):
    ids = [redis_db.xadd("s", {"k": str(i)}).decode() for i in range(3)]
    b = opened(options(redis_server, tmp_path))
    got = b.claim(3, 0)
    redis_db.xdel("s", ids[1])
    assert b.missing(got) == {f"s/{ids[1]}"}
    with pytest.raises(SourceError, match="no longer exist.*deleted or trimmed"):
        list(b.fetch(got, RAW))


def test_fetch_reads_claims_interleaved_with_other_consumers_entries(
    redis_server, redis_db, tmp_path
):
    """Range reads of a claim that other consumers' entries cut into: every claimed
    entry once, in the claim's order, nothing of the others."""
    for i in range(2500):
        redis_db.xadd("s", {"k": str(i)})
    mine = opened(options(redis_server, tmp_path, consumer="mine"))
    other = opened(options(redis_server, tmp_path, consumer="other"))
    claimed: list[str] = []
    for _ in range(50):  # alternate: 7 entries ours, 43 theirs
        claimed += mine.claim(7, 0)
        other.claim(43, 0)
    rows = [r for batch in mine.fetch(claimed, RAW) for r in batch.to_pylist()]
    assert [f"s/{r['id']}" for r in rows] == claimed
    assert len(claimed) == 350 and len(set(claimed)) == 350
    by_id = {e.decode(): f for e, f in redis_db.xrange("s")}
    assert all(dict(r["fields"]) == {"k": by_id[r["id"]][b"k"].decode()} for r in rows)


def test_a_field_that_is_not_utf8_names_its_message(redis_server, redis_db, tmp_path):
    redis_db.xadd("s", {"k": "fine"})
    bad = redis_db.xadd("s", {"k": b"\xff\xfe"}).decode()
    b = opened(options(redis_server, tmp_path))
    with pytest.raises(
        SourceError,
        match=f"message s/{bad}: field 'k' is not UTF-8 text .*every replay of this batch "
        "fails the same way: set option badMessages=column",
    ):
        list(b.fetch(b.claim(2, 0), RAW))


def test_a_lost_group_is_created_again_after_the_last_claimed_entry(
    redis_server, redis_db, tmp_path
):
    """startId=$ on a group that vanished (XGROUP DESTROY, a server that lost it) would
    skip what arrived meanwhile: with claims in the log it starts after the last one."""
    o = options(redis_server, tmp_path, startId="$")
    b = opened(o)
    for i in range(3):
        redis_db.xadd("s", {"k": str(i)})
    got = b.claim(10, 0)
    assert len(got) == 3
    redis_db.xgroup_destroy("s", "g")
    later = [redis_db.xadd("s", {"k": f"late{i}"}).decode() for i in range(2)]
    again = o.connect()
    again.open(got)
    assert again.claim(10, 0) == [f"s/{e}" for e in later]


def test_available_now_stops_at_what_existed(redis_server, redis_db, tmp_path):
    for i in range(5):
        redis_db.xadd("s", {"k": str(i)})
    b = opened(options(redis_server, tmp_path))
    b.bound_to_now()
    assert len(b.claim(3, 0)) == 3
    redis_db.xadd("s", {"k": "late"})
    redis_db.xadd("s", {"k": "later"})
    assert len(b.claim(3, 0)) == 3  # one late entry may ride along in the last read
    assert b.claim(3, 0) == []  # then the stream counts as drained


def _blocked_clients(r) -> list[dict]:
    """The clients blocked in a command (CLIENT LIST flag ``b``), e.g. XREADGROUP BLOCK."""
    return [c for c in r.client_list() if "b" in c["flags"]]


def test_blocking_claim_waits_for_new_messages(redis_server, redis_db, tmp_path):
    """The claim blocks in Redis (seen in CLIENT LIST) until a message comes, then claims it;
    with nothing coming it returns empty when its block time is over."""
    import threading
    import time

    b = opened(options(redis_server, tmp_path, blockMs="30000"))
    seen_blocked: list[dict] = []
    added: list[str] = []

    def producer():
        deadline = time.monotonic() + 25  # a guard: the claim's own block time is 30 s
        while not seen_blocked and time.monotonic() < deadline:
            seen_blocked.extend(_blocked_clients(redis_db))
            time.sleep(0.02)
        added.append(redis_db.xadd("s", {"k": "late"}).decode())

    thread = threading.Thread(target=producer)
    thread.start()
    got = b.claim(5, 30000)
    thread.join()
    assert seen_blocked and seen_blocked[0]["cmd"] == "xreadgroup", seen_blocked
    assert got == [f"s/{added[0]}"]  # the message that came while the claim was blocked
    assert _blocked_clients(redis_db) == []
    assert b.claim(5, 200) == []  # nothing comes: the block time ends it, empty


def test_idle_messages_of_other_consumers_are_reclaimed(redis_server, redis_db, tmp_path):
    for i in range(4):
        redis_db.xadd("s", {"k": str(i)})
    redis_db.xgroup_create("s", "g", "0")
    redis_db.xreadgroup("g", "dead-consumer", {"s": ">"}, count=4)
    b = opened(options(redis_server, tmp_path, claimIdleMs="0"))
    got = b.reclaim(10)
    assert len(got) == 4
    assert sorted(b.pending()) == sorted(got)


def _coordinator(o, faults=None):
    from pyspark_txn.faults import NO_FAULTS

    store = o.claim_log.store()
    store.log.create_if_missing()
    state = store.load_offsets(o.claim_log.source_id)
    broker = o.connect()
    broker.open(state.ids_between(-1, state.last_offset))
    return ClaimCoordinator(
        store, o.claim_log.source_id, broker, o.claim_log.uri, faults or NO_FAULTS
    )


@pytest.mark.parametrize("how", ["moved", "copied", "consumer option"])
def test_messages_read_before_a_crash_are_claimed_after_the_checkpoint_moves(
    redis_server, redis_db, tmp_path, how
):
    """A crash between XREADGROUP and the claim (before_claim) leaves the messages pending
    under the reader's consumer name; the restarted reader runs under another name (the
    default one hashes the claim log's path) and must still claim every one of them."""
    import shutil

    from pyspark_txn.faults import FaultPlan, FaultRule, InjectedFault

    ids = [redis_db.xadd("s", {"k": str(i)}).decode() for i in range(25)]
    old_chk, new_chk = tmp_path / "chk", tmp_path / "moved-chk"
    old = RedisSourceOptions.parse(
        {"url": redis_server.url, "stream": "s", "group": "g", "startId": "0",
         "checkpointLocation": str(old_chk)}
    )  # fmt: skip
    c = _coordinator(old, FaultPlan((FaultRule("before_claim", "raise", batch=1),)))
    first = c.latest(-1, 5)  # claim 0: five messages
    with pytest.raises(InjectedFault):
        c.latest(first, 10)  # ten more read from Redis, then the driver dies
    c.broker.close()
    new = {"url": redis_server.url, "stream": "s", "group": "g", "startId": "0"}
    if how == "consumer option":
        new |= {"checkpointLocation": str(old_chk), "consumer": "renamed"}
    else:
        copy = shutil.copytree if how == "copied" else shutil.move
        copy(str(old_chk), str(new_chk))
        new["checkpointLocation"] = str(new_chk)
    moved = RedisSourceOptions.parse(new)
    assert moved.consumer != old.consumer
    c = _coordinator(moved)
    end, served = first, list(c.ids(-1, first))
    while True:
        nxt = c.latest(end, 10)
        if nxt == end:
            break
        served += c.ids(end, nxt)
        end = nxt
    c.commit(end)
    assert sorted(served) == sorted(f"s/{i}" for i in ids)  # none stranded, none twice
    assert len(served) == len(set(served))
    assert redis_db.xpending("s", "g")["pending"] == 0  # all acked, whoever held them


def test_the_claim_log_stays_bounded_and_still_drops_redeliveries(redis_server, redis_db, tmp_path):
    """Claims acknowledged long ago are summarized into one mark per stream and deleted:
    a fresh start reads and folds a bounded log. A reset group position (XGROUP SETID 0)
    then hands every old entry out again by '>': none is claimed twice."""
    from pyspark_txn.state import EventKind, offset_log

    for i in range(600):
        redis_db.xadd("a" if i % 3 else "b", {"k": str(i)})
    o = options(redis_server, tmp_path, stream="a,b")
    c = _coordinator(o)
    end, served = -1, []
    for _ in range(200):
        nxt = c.latest(end, 4)
        served += c.ids(end, nxt)
        end = nxt
    c.commit(end)
    c.broker.close()
    assert len(served) == len(set(served)) == 600
    events = o.claim_log.store().events(o.claim_log.source_id)
    assert events[0].kind is EventKind.SUMMARY  # the history before it is deleted
    assert len(events) <= offset_log.SUMMARY_EVERY_EVENTS + 2
    state = o.claim_log.store().load_offsets(o.claim_log.source_id)
    kept = state.ids_between(-1, state.last_offset)
    assert len(kept) <= 4 * (offset_log.RETAIN_ACKED_CLAIMS + offset_log.SUMMARY_EVERY_EVENTS)
    assert set(state.marks) == {"a", "b"}
    # the group's position is reset: every entry comes again as new
    for s in ("a", "b"):
        redis_db.xgroup_setid(s, "g", "0")
    later = [f"a/{redis_db.xadd('a', {'k': 'late'}).decode()}"]
    c = _coordinator(o)
    nxt = c.latest(end, 1000)
    assert c.ids(end, nxt) == later  # the 600 old ones were dropped as redeliveries
    with pytest.raises(SourceError, match="summarized away"):
        c.ids(-1, 0)  # a checkpoint older than the log cannot be served


def test_an_unreachable_broker_is_named_without_its_password(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    o = RedisSourceOptions.parse(
        {
            "url": f"redis://u:s3cret@127.0.0.1:{port}/0",
            "stream": "s",
            "group": "g",
            "claimLog": str(tmp_path / "c"),
            "socketTimeoutMs": "500",
        }
    )
    with pytest.raises(
        SourceError, match=f"cannot reach Redis at redis://u:\\*\\*\\*@127.0.0.1:{port}/0"
    ) as e:
        o.connect().open()
    assert "s3cret" not in str(e.value)


def test_ack_committed_acks_claims_of_a_committed_batch(redis_server, redis_db, tmp_path):
    for i in range(6):
        redis_db.xadd("s", {"k": str(i)})
    o = options(redis_server, tmp_path)
    c = ClaimCoordinator(o.claim_log.store(), o.claim_log.source_id, opened(o), o.claim_log.uri)
    e0 = c.latest(-1, 4)
    e1 = c.latest(e0, 4)  # acks claim 0
    assert redis_db.xpending("s", "g")["pending"] == 2
    end = {"claim": e1, "source": "redis:g:s"}
    assert ack_committed(o, o.claim_log, end) == e1
    assert ack_committed(o, o.claim_log, end) == e1  # again: harmless
    assert redis_db.xpending("s", "g")["pending"] == 0
    with pytest.raises(SourceError, match="belongs to source 'redis:other'"):
        ack_committed(o, o.claim_log, {"claim": e1, "source": "redis:other"})


def test_json_values_follow_the_declared_types():
    import decimal

    t = pa.struct(
        [
            pa.field("ts", pa.timestamp("us", tz="UTC")),
            pa.field("d", pa.date32()),
            pa.field("n", pa.int32()),
            pa.field("m", pa.map_(pa.string(), pa.int64())),
            pa.field("tags", pa.list_(pa.string())),
            pa.field("dec", pa.decimal128(10, 2)),
            pa.field("raw", pa.binary()),
        ]
    )
    conv = _converter(t, "doc")
    v = conv(
        {
            "ts": "2024-01-02T03:04:05Z",
            "d": "2024-02-03",
            "n": 7,
            "m": {"a": 1},
            "tags": ["x", 2],
            "dec": "1.25",
            "raw": "aGk=",
            "ignored": True,
        }
    )
    got = pa.array([v, None], type=t).to_pylist()[0]
    assert got["ts"] == dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
    assert got["d"] == dt.date(2024, 2, 3) and got["n"] == 7 and got["m"] == [("a", 1)]
    assert got["tags"] == ["x", "2"] and got["dec"] == decimal.Decimal("1.25")
    assert got["raw"] == b"hi"
    row = _row_converter([pa.field("n", pa.int64())])
    assert row("s/1-0", {}) == [None]
    with pytest.raises(SourceError, match='message s/1-0: n: expected an integer, got "7"'):
        row("s/1-0", {"n": "7"})
    with pytest.raises(SourceError, match="expected an integer, got true"):
        row("s/1-0", {"n": True})


def test_json_numbers_keep_their_precision_and_not_null_is_checked():
    import decimal

    from pyspark_txn.sources.redis_rows import _json_document

    doc = _json_document(
        "s/1-0",
        {b"json": b'{"a": 0.123456789012345678, "b": 12345678901234567890.5, "x": 1.5, '
         b'"big": 12345678901234567890123}'},
        "json",
    )  # fmt: skip
    fields = [
        pa.field("a", pa.decimal128(38, 18)),
        pa.field("b", pa.decimal128(38, 2)),
        pa.field("x", pa.float64()),
        pa.field("big", pa.float64()),
    ]
    row = _row_converter(fields)("s/1-0", doc)
    got = [pa.array([v], f.type)[0].as_py() for v, f in zip(row, fields, strict=True)]
    assert got == [
        decimal.Decimal("0.123456789012345678"),
        decimal.Decimal("12345678901234567890.50"),
        1.5,
        1.2345678901234568e22,
    ]
    required = _row_converter([pa.field("n", pa.int64(), nullable=False)])
    with pytest.raises(SourceError, match="message s/2-0: n is declared NOT NULL"):
        required("s/2-0", {})


def test_the_password_option_reaches_redis(redis_server, redis_db, tmp_path):
    redis_db.config_set("requirepass", "pw-1")
    try:
        assert opened(options(redis_server, tmp_path, password="pw-1")).claim(5, 0) == []
        with pytest.raises(SourceError, match="refused PING|cannot reach Redis") as e:
            opened(options(redis_server, tmp_path, password="wrong-pw"))
        assert "wrong-pw" not in str(e.value)
    finally:
        admin = type(redis_db).from_url(redis_server.url, password="pw-1")
        admin.config_set("requirepass", "")
        admin.close()


def _xrange_calls(redis_db) -> int:
    return int(redis_db.info("commandstats").get("cmdstat_xrange", {}).get("calls", 0))


def test_read_tasks_take_what_the_claim_received_and_a_replay_reads_by_id(
    redis_server, redis_db, tmp_path
):
    """A batch planned by the process that claimed it ships the claimed entries in its
    partitions (no XRANGE on executors); a new process replaying it fetches by id, and
    both give the same rows."""
    from pyspark.sql.types import MapType, StringType, StructField, StructType

    schema = StructType(
        [
            StructField("stream", StringType()),
            StructField("id", StringType()),
            StructField("fields", MapType(StringType(), StringType())),
        ]
    )
    for i in range(12):
        redis_db.xadd("a" if i % 3 else "b", {"k": f"v{i}", "x": "é"})
    o = options(redis_server, tmp_path, stream="a,b", maxMessagesPerBatch="100")

    def rows(reader, parts):
        return [r for p in parts for batch in reader.read(p) for r in batch.to_pylist()]

    reader = o.reader(schema)
    start = reader.initialOffset()
    end = reader.latestOffset(start, None)
    parts = reader.partitions(start, end)
    assert len(parts) == 2 and all(p.received is not None for p in parts)
    before = _xrange_calls(redis_db)
    first = rows(reader, parts)
    assert _xrange_calls(redis_db) == before  # nothing read again
    assert sorted((r["stream"], r["id"]) for r in first) == sorted(
        (s, e.decode()) for s in ("a", "b") for e, _ in redis_db.xrange(s)
    )
    assert all(dict(r["fields"])["x"] == "é" for r in first)
    reader.stop()

    replay = o.reader(schema)  # a restarted query re-plans the same batch
    again = replay.partitions(start, end)
    assert all(p.received is None for p in again)
    assert rows(replay, again) == first
    assert _xrange_calls(redis_db) > before
    replay.stop()


def test_rows_match_redis_fields_whatever_their_shape_both_from_the_claim_and_by_id(
    redis_server, redis_db, tmp_path
):
    """Rows are built from the entries' flat field lists at once (no dict per entry); what
    they hold is what redis-py's parsing gives: a name given twice keeps its last value,
    entries with other fields, no fields but one, and stream names with '/' are read the
    same, from the claim's entries (first read) and by id (a replay)."""
    from pyspark.sql.types import MapType, StringType, StructField, StructType

    schema = StructType(
        [
            StructField("stream", StringType()),
            StructField("id", StringType()),
            StructField("fields", MapType(StringType(), StringType())),
        ]
    )
    streams = ["a/b", "plain"]
    for i in range(30):
        s = streams[i % 2]
        redis_db.xadd(s, {"n": str(i), "user": f"u{i}"})  # the usual: the same names
        if i % 7 == 0:  # a name twice: Redis keeps both pairs, redis-py the last
            redis_db.execute_command("XADD", s, "*", "n", str(i), "n", f"again{i}", "z", "1")
        if i % 11 == 0:
            redis_db.xadd(s, {"only": "one"})
    expected = {
        (s, e.decode()): sorted((k.decode(), v.decode()) for k, v in fields.items())
        for s in streams
        for e, fields in redis_db.xrange(s)
    }
    assert ("n", "again0") in expected[next(k for k, v in expected.items() if ("z", "1") in v)]
    o = options(redis_server, tmp_path, stream=",".join(streams), maxMessagesPerBatch="1000")

    def rows(reader, parts):
        got = [r for p in parts for batch in reader.read(p) for r in batch.to_pylist()]
        return {(r["stream"], r["id"]): sorted(r["fields"]) for r in got}  # pairs, as stored

    reader = o.reader(schema)
    start = reader.initialOffset()
    end = reader.latestOffset(start, None)
    parts = reader.partitions(start, end)
    assert all(p.received is not None for p in parts)
    assert rows(reader, parts) == expected
    reader.stop()
    replay = o.reader(schema)
    again = replay.partitions(start, end)
    assert all(p.received is None for p in again)
    assert rows(replay, again) == expected
    replay.stop()
