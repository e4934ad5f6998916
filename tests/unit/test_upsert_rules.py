"""The pure rules of upserts by key (pyspark_txn.sinks.upsert, .predicate): options,
the batch checks, the latest change per key, tombstones, SCD type 2 histories; a
hypothesis run against an oracle that applies the whole change log in sequence order."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyspark_txn.errors import ConfigError
from pyspark_txn.sinks.predicate import parse_predicate
from pyspark_txn.sinks.upsert import (
    DELETE_FLAG,
    END_AT,
    START_AT,
    BatchRefused,
    UpsertSpec,
    check_batch,
    latest_per_key,
    newer_sql,
    scd2_versions,
    with_delete_flag,
    without_tombstoned,
)

STREAM = pa.schema(
    [
        pa.field("id", pa.int64()),
        pa.field("v", pa.string()),
        pa.field("seq", pa.int64()),
        pa.field("op", pa.string()),
    ]
)


def spec(**opts):
    return UpsertSpec.parse({k.lower(): v for k, v in opts.items()})


def rows(*tuples):
    return pa.Table.from_pylist(
        [dict(zip(STREAM.names, t, strict=True)) for t in tuples], schema=STREAM
    )


# --- options ------------------------------------------------------------------------


def test_no_keys_is_an_append_sink_and_the_other_options_need_keys():
    assert UpsertSpec.parse({}) is None
    with pytest.raises(ConfigError, match="sequenceBy, deleteWhen needs option keys"):
        spec(sequenceBy="seq", deleteWhen="op = 'D'")


@pytest.mark.parametrize(
    ("opts", "message"),
    [
        ({"keys": "id,id"}, "repeats a column"),
        ({"keys": " , "}, "is empty"),
        ({"keys": "id", "scdType": "3"}, "expected 1 or 2"),
        ({"keys": "id", "scdType": "2"}, "exactly one column"),
        ({"keys": "id", "sequenceBy": "id"}, "cannot order the changes of its own key"),
        ({"keys": "id", "exceptColumns": "id"}, "names key columns"),
        ({"keys": "id", "sequenceBy": "seq", "exceptColumns": "seq"}, "keeps each row's sequence"),
        ({"keys": "id", "deleteWhen": "op = "}, "position 5"),
        ({"keys": "id", "tombstoneRetention": "7 days"}, "only with sequenceBy and deleteWhen"),
        ({"keys": "id", "sequenceBy": "seq", "tombstoneRetention": "1 day"}, "and deleteWhen"),
        (
            {"keys": "id", "sequenceBy": "seq", "deleteWhen": "op='D'", "tombstoneRetention": "x"},
            "positive duration",
        ),
    ],
)
def test_bad_options_are_refused_by_name(opts, message):
    with pytest.raises(ConfigError, match=message):
        spec(**opts)


@pytest.mark.parametrize(
    ("opts", "message"),
    [
        ({"keys": "nope"}, r"keys: columns \['nope'\] are not in the stream"),
        ({"keys": "id", "sequenceBy": "flags"}, "has no order"),
        ({"keys": "id", "deleteWhen": "op = 1"}, "cannot be evaluated"),
        ({"keys": "id", "deleteWhen": "zz = 'D'"}, r"columns \['zz'\] are not in the stream"),
        ({"keys": "id", "exceptColumns": "v,seq,op,flags"}, "no other column to write"),
    ],
)
def test_options_the_stream_contradicts_are_refused(opts, message):
    schema = STREAM.append(pa.field("flags", pa.list_(pa.int64())))
    with pytest.raises(ConfigError, match=message):
        spec(**opts).check_schema(schema)


def test_a_spec_round_trips_and_says_the_table_columns():
    s = spec(keys="id", sequenceBy="seq", deleteWhen="op = 'D'", exceptColumns="op", scdType="2")
    assert UpsertSpec.from_json(s.to_json()) == s
    assert s.table_schema(STREAM).names == ["id", "v", "seq", START_AT, END_AT]
    assert spec(keys="id", tombstoneRetention=None).tombstone_retention_s == 7 * 86400
    assert (
        spec(
            keys="id", sequenceBy="seq", deleteWhen="op='D'", tombstoneRetention="12 hours"
        ).tombstone_retention_s
        == 12 * 3600
    )


# --- a batch ------------------------------------------------------------------------------


def test_a_batch_with_null_keys_or_unordered_duplicates_is_refused():
    with pytest.raises(BatchRefused, match="'id' is null in 1"):
        check_batch(rows((None, "a", 1, "U")), spec(keys="id"))
    with pytest.raises(BatchRefused, match=r"share the same key .*\{'id': 1\}"):
        check_batch(rows((1, "a", 1, "U"), (1, "b", 2, "U")), spec(keys="id"))
    with pytest.raises(BatchRefused, match="same key and sequence"):
        check_batch(rows((1, "a", 1, "U"), (1, "b", 1, "U")), spec(keys="id", sequenceBy="seq"))
    check_batch(rows((1, "a", 1, "U"), (1, "b", 2, "U")), spec(keys="id", sequenceBy="seq"))


def test_the_greatest_sequence_per_key_wins_within_a_batch():
    s = spec(keys="id", sequenceBy="seq")
    got = latest_per_key(
        rows((1, "a", 3, "U"), (2, "x", 1, "U"), (1, "b", 5, "U"), (1, "c", 4, "U")), s
    )
    assert sorted((r["id"], r["v"]) for r in got.to_pylist()) == [(1, "b"), (2, "x")]


def test_the_delete_flag_and_tombstones():
    s = spec(keys="id", sequenceBy="seq", deleteWhen="op = 'D'")
    flagged = with_delete_flag(rows((1, "a", 3, "U"), (2, None, 4, "D"), (3, "c", 1, None)), s)
    assert flagged.column(DELETE_FLAG).to_pylist() == [False, True, False]
    tomb = pa.table({"id": pa.array([1, 3], pa.int64()), "seq": pa.array([3, 0], pa.int64())})
    kept = without_tombstoned(flagged, tomb, s)
    # id 1 at seq 3 is not newer than its delete at 3: dropped; id 3 at 1 > 0: kept
    assert kept.column("id").to_pylist() == [2, 3]
    assert newer_sql(spec(keys="id")) == "TRUE"
    two = spec(keys="id", sequenceBy="seq,v")
    assert newer_sql(two) == '(s."seq" > t."seq") OR (s."seq" = t."seq" AND s."v" > t."v")'


def test_predicates_follow_sql_null_rules():
    table = pa.table({"op": ["D", None, "U"], "n": [1, None, 3]})
    assert parse_predicate("op = 'D'").mask(table).to_pylist() == [True, False, False]
    assert parse_predicate("NOT op = 'D'").mask(table).to_pylist() == [False, False, True]
    assert parse_predicate("n IN (1, NULL)").mask(table).to_pylist() == [True, False, False]
    assert parse_predicate("op IS NULL OR n > 2").mask(table).to_pylist() == [False, True, True]
    with pytest.raises(ConfigError, match="not a predicate"):
        parse_predicate("'D'")


# --- the oracle ---------------------------------------------------------------------------

changes = st.lists(
    st.tuples(
        st.integers(0, 4),  # key
        st.integers(0, 30),  # sequence
        st.booleans(),  # delete?
    ),
    max_size=40,
)


def _batches(log, cuts):
    """The change log split into batches, duplicates of (key, seq) dropped (the sink
    refuses them within a batch; across batches the first wins, as in the oracle)."""
    seen, unique = set(), []
    for key, seq, deleted in log:
        if (key, seq) not in seen:
            seen.add((key, seq))
            unique.append((key, seq, deleted))
    out, start = [], 0
    for cut in sorted(cuts) + [len(unique)]:
        out.append(unique[start:cut])
        start = max(start, cut)
    return [b for b in out if b], unique


def _table_of(batch):
    return rows(*[(k, f"v{k}-{s}", s, "D" if d else "U") for k, s, d in batch])


@settings(max_examples=150, deadline=None)
@given(changes, st.lists(st.integers(0, 40), max_size=4))
def test_scd1_batches_equal_the_change_log_applied_in_sequence_order(log, cuts):
    s = spec(keys="id", sequenceBy="seq", deleteWhen="op = 'D'")
    batches, unique = _batches(log, cuts)
    table: dict[int, tuple[int, str]] = {}  # the merge, as phase 2 asks delta-rs for it
    tombstones: dict[int, int] = {}
    for batch in batches:
        source = latest_per_key(with_delete_flag(_table_of(batch), s), s)
        tomb = pa.table(
            {
                "id": pa.array(list(tombstones), pa.int64()),
                "seq": pa.array(list(tombstones.values()), pa.int64()),
            }
        )
        source = without_tombstoned(source, tomb, s)
        for r in source.to_pylist():
            current = table.get(r["id"])
            if r[DELETE_FLAG]:
                tombstones[r["id"]] = max(tombstones.get(r["id"], -1), r["seq"])
                if current is not None and r["seq"] > current[0]:
                    del table[r["id"]]
            elif current is None or r["seq"] > current[0]:
                table[r["id"]] = (r["seq"], r["v"])
    oracle: dict[int, tuple[int, str]] = {}
    for key in {k for k, _, _ in unique}:
        last = max((c for c in unique if c[0] == key), key=lambda c: c[1])
        if not last[2]:
            oracle[key] = (last[1], f"v{key}-{last[1]}")
    assert table == oracle


@settings(max_examples=150, deadline=None)
@given(changes, st.lists(st.integers(0, 40), max_size=4))
def test_scd2_batches_equal_the_history_of_the_whole_log(log, cuts):
    s = spec(keys="id", sequenceBy="seq", deleteWhen="op = 'D'", scdType="2")
    batches, unique = _batches(log, cuts)
    columns = [*s.table_schema(STREAM).names]
    table: dict[tuple[int, int], dict] = {}  # (key, start) -> row: the merge on both
    tombstones: set[tuple[int, int]] = set()
    for batch in batches:
        changed = with_delete_flag(_table_of(batch), s)
        touched = {r["id"] for r in changed.to_pylist()}
        existing = pa.Table.from_pylist(
            [r for (k, _), r in table.items() if k in touched],
            schema=s.table_schema(STREAM),
        )
        tomb = pa.Table.from_pylist(
            [{"id": k, "seq": q} for k, q in tombstones if k in touched],
            schema=pa.schema([pa.field("id", pa.int64()), pa.field("seq", pa.int64())]),
        )
        for r in scd2_versions(existing, changed, s, columns, tomb).to_pylist():
            table[(r["id"], r[START_AT])] = r
        tombstones |= {(r["id"], r["seq"]) for r in changed.to_pylist() if r[DELETE_FLAG]}
    oracle = {}
    for key in {k for k, _, _ in unique}:
        events = sorted((c for c in unique if c[0] == key), key=lambda c: c[1])
        for i, (k, seq, deleted) in enumerate(events):
            if not deleted:
                end = events[i + 1][1] if i + 1 < len(events) else None
                oracle[(k, seq)] = (f"v{k}-{seq}", end)
    assert {k: (r["v"], r[END_AT]) for k, r in table.items()} == oracle
