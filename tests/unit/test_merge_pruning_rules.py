"""The pruning condition of the upsert MERGE (pyspark_txn.sinks.merge_pruning), pure: the
SQL it writes for each key type and layout, and, by hypothesis, that its ranges cover
every key of a batch and leave out every file between them that holds none (up to the
range limit). delta-rs reading that SQL: tests/contract/test_merge_pruning.py."""

from __future__ import annotations

import bisect
import datetime
import decimal

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from pyspark_txn.sinks.merge_pruning import file_bounds, key_ranges, pruning_predicate


def files(rows):
    """Flattened add actions as delta-rs gives them: (min.id, max.id, size_bytes)."""
    return pa.table(
        {
            "path": [f"f{i}" for i in range(len(rows))],
            "size_bytes": [r[2] for r in rows],
            "min.id": [r[0] for r in rows],
            "max.id": [r[1] for r in rows],
        }
    )


def test_one_int_key_without_statistics_is_one_range():
    source = pa.table({"id": [9, 3, 5, 3], "v": ["a", "b", "c", "d"]})
    assert pruning_predicate(source, ["id"]) == '(t."id" >= 3 AND t."id" <= 9)'
    assert pruning_predicate(source.slice(0, 1), ["id"]) == '(t."id" = 9)'
    assert pruning_predicate(source.slice(0, 0), ["id"]) is None


def test_string_date_and_decimal_literals_are_exact():
    source = pa.table(
        {
            "s": ["it's", "a\\b"],
            "d": pa.array([datetime.date(1, 1, 1), datetime.date(2024, 2, 29)]),
            "x": pa.array([decimal.Decimal("-0.010"), decimal.Decimal("7")], pa.decimal128(9, 3)),
        }
    )
    assert pruning_predicate(source, ["s"], alias="tt") == (
        "(tt.\"s\" >= 'a\\b' AND tt.\"s\" <= 'it''s')"
    )
    assert pruning_predicate(source, ["d"]) == (
        "(t.\"d\" >= CAST('0001-01-01' AS DATE) AND t.\"d\" <= CAST('2024-02-29' AS DATE))"
    )
    assert pruning_predicate(source, ["x"]) == (
        "(t.\"x\" >= CAST('-0.010' AS DECIMAL(9, 3)) AND t.\"x\" <= CAST('7.000' AS DECIMAL(9, 3)))"
    )


def test_keys_of_types_without_literals_add_nothing():
    source = pa.table(
        {
            "ts": pa.array([1, 2], pa.timestamp("us", "UTC")),
            "b": [True, False],
            "bin": [b"a", b"b"],
            "id": [1, 2],
        }
    )
    assert pruning_predicate(source, ["ts", "b", "bin"]) is None
    assert pruning_predicate(source, ["ts", "id"]) == '(t."id" >= 1 AND t."id" <= 2)'


def test_several_keys_are_each_bounded():
    source = pa.table({"a": [1, 5], "b": ["x", "y"]})
    assert pruning_predicate(source, ["a", "b"]) == (
        '(t."a" >= 1 AND t."a" <= 5) AND (t."b" >= \'x\' AND t."b" <= \'y\')'
    )


def test_a_partitioning_key_is_an_in_list_up_to_the_limit():
    source = pa.table({"p": ["b", "a", "b"], "id": [1, 2, 3]})
    assert pruning_predicate(source, ["p", "id"], ["p"]) == (
        '(t."p" IN (\'a\', \'b\')) AND (t."id" >= 1 AND t."id" <= 3)'
    )
    assert pruning_predicate(source, ["p"], ["p"], max_values=1) == (
        "(t.\"p\" >= 'a' AND t.\"p\" <= 'b')"
    )


def test_ranges_are_cut_where_whole_files_lie_between_the_keys():
    # files of ids 0-99, 100-199, ..., 900-999; the batch: 150-160, 820 and 5000 (new)
    layout = files([(lo, lo + 99, 10) for lo in range(0, 1000, 100)])
    source = pa.table({"id": [150, 160, 155, 820, 5000]})
    assert pruning_predicate(source, ["id"], files=layout) == (
        '(t."id" >= 150 AND t."id" <= 160 OR t."id" = 820 OR t."id" = 5000)'
    )
    # one range at most: min..max
    assert pruning_predicate(source, ["id"], files=layout, max_ranges=1) == (
        '(t."id" >= 150 AND t."id" <= 5000)'
    )
    # two: the gap that leaves out the most bytes (files 200-799) is cut first
    assert key_ranges([150, 160, 820, 5000], file_bounds(layout, "id"), 2) == [
        (150, 160),
        (820, 5000),
    ]


def test_a_file_a_key_falls_in_is_never_cut_out():
    # a wide file that holds key 10 spans the gap: no file lies wholly in it, no cut
    layout = files([(0, 950, 1), (900, 999, 1)])
    assert key_ranges([10, 990], file_bounds(layout, "id")) == [(10, 990)]
    # a file wholly in the gap is cut out; the wide one still overlaps the range of 10
    layout = files([(0, 950, 1), (400, 500, 1), (900, 999, 1)])
    assert key_ranges([10, 990], file_bounds(layout, "id")) == [(10, 10), (990, 990)]


def test_files_without_statistics_of_the_key_give_no_cut():
    layout = pa.table({"path": ["a", "b"], "size_bytes": [1, 1], "min.id": [None, 500]})
    assert file_bounds(layout, "id") is None  # no max.id at all
    layout = layout.append_column("max.id", pa.array([None, 600]))
    assert file_bounds(layout, "id") == [(500, 600, 1)]
    assert key_ranges([1, 1000], file_bounds(layout, "id")) == [(1, 1), (1000, 1000)]


def test_string_statistics_cut_string_keys():
    layout = pa.table(
        {"size_bytes": [1, 1, 1], "min.id": ["a", "m", "x"], "max.id": ["c", "p", "z"]}
    )
    source = pa.table({"id": ["b", "y"]})
    assert pruning_predicate(source, ["id"], files=layout) == "(t.\"id\" = 'b' OR t.\"id\" = 'y')"


@settings(max_examples=300, deadline=None)
@given(
    keys=st.lists(st.integers(-1000, 1000), min_size=1, max_size=40, unique=True),
    layout=st.lists(
        st.tuples(st.integers(-1100, 1100), st.integers(0, 300), st.integers(1, 50)),
        max_size=30,
    ),
    max_ranges=st.integers(1, 8),
)
def test_ranges_cover_every_key_and_skip_files_between_them(keys, layout, max_ranges):
    values = sorted(keys)
    bounds = [(lo, lo + width, size) for lo, width, size in layout]
    ranges = key_ranges(values, bounds, max_ranges)
    assert 1 <= len(ranges) <= max_ranges
    assert all(lo <= hi for lo, hi in ranges)
    assert all(
        a[1] < b[0] for a, b in zip(ranges[:-1], ranges[1:], strict=True)
    )  # sorted, disjoint
    # every key is inside a range, and every range starts and ends at a key
    for k in values:
        assert any(lo <= k <= hi for lo, hi in ranges), (k, ranges)
    assert all(lo in values and hi in values for lo, hi in ranges)
    # a file holding a key overlaps a range (it is read)
    for lo, hi, _ in bounds:
        if any(lo <= k <= hi for k in values):
            assert any(lo <= r_hi and r_lo <= hi for r_lo, r_hi in ranges)
    # with ranges enough, every file that holds no key overlaps none (it is skipped)
    empty_gaps = set()
    for lo, hi, _ in bounds:
        i = bisect.bisect_left(values, lo)
        if i == len(values) or values[i] > hi:
            empty_gaps.add(i)
    if len(empty_gaps - {0, len(values)}) <= max_ranges - 1:
        for lo, hi, _ in bounds:
            if not any(lo <= k <= hi for k in values):
                assert not any(lo <= r_hi and r_lo <= hi for r_lo, r_hi in ranges)


def test_beyond_the_sorting_limit_a_string_key_is_one_range(monkeypatch):
    from pyspark_txn.sinks import merge_pruning

    layout = pa.table({"size_bytes": [1], "min.id": ["m"], "max.id": ["p"]})
    source = pa.table({"id": ["b", "y", "c"]})
    assert pruning_predicate(source, ["id"], files=layout) == (
        "(t.\"id\" >= 'b' AND t.\"id\" <= 'c' OR t.\"id\" = 'y')"
    )
    monkeypatch.setattr(merge_pruning, "MAX_SORTED", 2)
    assert pruning_predicate(source, ["id"], files=layout) == (
        "(t.\"id\" >= 'b' AND t.\"id\" <= 'y')"
    )


def test_a_large_int_batch_is_cut_at_its_gaps():
    import numpy as np

    keys = np.random.default_rng(1).permutation(np.arange(2_000_000, 4_000_000))
    keys = np.concatenate([keys, [10, 9_000_000]])  # one old key, one far above
    layout = files([(lo, lo + 249_999, 1) for lo in range(0, 8_000_000, 250_000)])
    got = pruning_predicate(pa.table({"id": keys}), ["id"], files=layout)
    assert got == '(t."id" = 10 OR t."id" >= 2000000 AND t."id" <= 3999999 OR t."id" = 9000000)'
