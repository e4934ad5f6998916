"""Delta ``add.stats`` of staged files, checked against delta-rs's own writer.

The oracle: the same Arrow data written with ``deltalake.write_deltalake``; its add
actions' stats are read straight from ``_delta_log``. Where delta-rs gives a bound, we
give the same value, except where noted (``DELIBERATE``); every bound we give is also
checked against the data itself; and tables committed from staged files the way
``DeltaTarget.commit`` does are read back, filtered, by delta-rs.
"""

import datetime as dt
import json
import math
import random
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, QueryBuilder, Schema, WriterProperties, write_deltalake
from deltalake.transaction import create_table_with_add_actions

from pyspark_txn.sinks.delta_target import add_actions
from pyspark_txn.sinks.staging import (
    StagingConfig,
    _string_max,
    _string_min,
    delta_stats,
    stage_partition,
)

UTC = dt.timezone.utc
D = Decimal
TS = pa.timestamp("us", tz="UTC")
TS_NTZ = pa.timestamp("us")
ONE_MS = dt.timedelta(milliseconds=1)


# --- helpers ------------------------------------------------------------------------


def strict(text: str) -> dict:
    """Parse stats as strict JSON (no NaN/Infinity tokens); numbers as exact Decimals."""

    def refuse(token):
        raise ValueError(f"non-JSON constant {token} in stats")

    return json.loads(text, parse_constant=refuse, parse_float=Decimal)


def log_adds(table_dir) -> list[dict]:
    adds = []
    for f in sorted((Path(table_dir) / "_delta_log").glob("*.json")):
        for line in f.read_text().splitlines():
            action = json.loads(line)
            if "add" in action:
                adds.append(action["add"])
    return adds


def delta_rs_stats(table: pa.Table, table_dir, rows_per_group=None, **kw) -> dict:
    props = None
    if rows_per_group:  # with delta-rs's default string truncation, which custom props drop
        props = WriterProperties(max_row_group_size=rows_per_group, statistics_truncate_length=64)
    write_deltalake(str(table_dir), table, writer_properties=props, **kw)
    (add,) = log_adds(table_dir)
    return strict(add["stats"])


def stage(table: pa.Table, table_dir, partition=0, rows_per_group=None, **kw):
    cfg = StagingConfig(
        table_uri=str(table_dir), sink_id="s", row_group_rows=rows_per_group or 1_000_000, **kw
    )
    batches = table.to_batches(max_chunksize=rows_per_group)
    return stage_partition(batches, cfg, 0, "tok", partition, table.schema)


def our_stats(table: pa.Table, table_dir, rows_per_group=None) -> dict:
    (h,) = stage(table, table_dir, rows_per_group=rows_per_group)
    if rows_per_group and rows_per_group < table.num_rows:
        assert pq.ParquetFile(Path(table_dir) / h.handle).metadata.num_row_groups > 1
    return strict(h.meta["stats"])


def leaves(tree: dict, prefix=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from leaves(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def same(a, b) -> bool:
    """Equal JSON values, telling -0.0 from 0.0."""
    if isinstance(a, Decimal) and isinstance(b, Decimal):
        return a == b and a.is_signed() == b.is_signed()
    return type(a) is type(b) and a == b


def leaf_arrays(table: pa.Table) -> dict:
    """Every leaf outside lists and maps, struct parents' nulls applied."""
    out = {}

    def walk(path, arr):
        if pa.types.is_struct(arr.type):
            for i, child in enumerate(arr.flatten()):
                walk(path + (arr.type.field(i).name,), child)
        elif not (pa.types.is_list(arr.type) or pa.types.is_map(arr.type)):
            out[path] = arr

    for name in table.column_names:
        walk((name,), table[name].combine_chunks())
    return out


def stat_as_python(t: pa.DataType, v):
    if pa.types.is_timestamp(t):
        parsed = dt.datetime.fromisoformat(v.replace("Z", "+00:00").replace(" ", "T"))
        assert (parsed.tzinfo is not None) == (t.tz is not None), v
        return parsed
    if pa.types.is_date32(t):
        return dt.date.fromisoformat(v)
    if pa.types.is_decimal(t):
        return Decimal(v)
    if pa.types.is_floating(t):  # what a reader parses: the nearest double
        return float(v)
    return v


def check_bounds(table: pa.Table, stats: dict) -> None:
    """Each bound holds for the data; each null count is the leaf's (with parents' nulls)."""
    arrays = leaf_arrays(table)
    assert stats["numRecords"] == table.num_rows
    for path, n in leaves(stats["nullCount"]):
        assert n == arrays[path].null_count, path
    for key, is_max in (("minValues", False), ("maxValues", True)):
        for path, v in leaves(stats.get(key, {})):
            arr = arrays[path]
            if v is None:  # unknown, as delta-rs writes non-finite float bounds
                assert pa.types.is_floating(arr.type), path
                continue
            values = [x for x in arr.to_pylist() if x is not None and x == x]  # not NaN
            assert values, path
            bound = stat_as_python(arr.type, v)
            if is_max:
                if pa.types.is_timestamp(arr.type):  # protocol: truncated down to the ms
                    assert max(values) - bound < ONE_MS, path
                else:
                    assert bound >= max(values), path
            else:
                assert bound <= min(values), path
            if isinstance(v, str):
                assert len(v.encode()) <= 64 or v in values, path


def compare_with_delta_rs(ours: dict, theirs: dict, approx=(), extra_counts=()) -> None:
    """Every bound and count delta-rs gives, we give the same; nothing it lacks but
    ``extra_counts``. ``approx``: decimal leaves, where delta-rs writes a float."""
    assert ours["numRecords"] == theirs["numRecords"]
    for key in ("minValues", "maxValues", "nullCount"):
        mine = dict(leaves(ours[key]))
        for path, v in leaves(theirs[key]):
            assert path in mine, (key, path, v)
            if path in approx:
                # DELIBERATE: delta-rs converts decimals to f64 (rounding either way, and
                # saturating at 2**63); we write the exact decimal, as Spark does.
                assert math.isclose(float(mine[path]), float(v), rel_tol=1e-12), (key, path)
            else:
                assert same(mine[path], v), (key, path, mine[path], v)
        extra = set(mine) - {p for p, _ in leaves(theirs[key])}
        assert extra <= (set(extra_counts) if key == "nullCount" else set()), (key, extra)


# --- every type, against delta-rs ---------------------------------------------------

LONG = "a" * 40


def every_type() -> pa.Table:
    """Every type, all bounded at the top level (see the unbounded tests for the rest)."""
    s_type = pa.struct([("a", pa.int32()), ("b", pa.struct([("c", pa.string())]))])
    f_type = pa.struct([(n, pa.float64()) for n in ("pinf", "ninf", "both", "nan", "allnan")])
    inf, nan = math.inf, math.nan
    rows = 8
    return pa.table(
        {
            "i8": pa.array([-128, 127, None, 0, 1, 2, 3, 4], pa.int8()),
            "i16": pa.array([-(2**15), 2**15 - 1, None, 0, 1, 2, 3, 4], pa.int16()),
            "i32": pa.array([-(2**31), 2**31 - 1, None, 0, 1, 2, 3, 4], pa.int32()),
            "i64": pa.array([-(2**63), 2**63 - 1, None, 0, 1, 2, 3, 4], pa.int64()),
            "f32": pa.array(
                [1.1, nan, None, -0.0, 2.5, 3.4028234663852886e38, 0.5, 1.0], pa.float32()
            ),
            "f64": pa.array([1.5, 1.7976931348623157e308, None, -0.0, -5e-324, 3.0, 0.1, 1e300]),
            "f64_nan": pa.array([nan, 1.0, None, 2.0, 3.0, 4.0, nan, 5.0]),
            "f64_zero": pa.array([-0.0, 0.0, None, -0.0, 0.0, -0.0, 0.0, -0.0]),
            "f64_negzero": pa.array([-0.0, -0.0, None, -0.0, -0.0, -0.0, -0.0, -0.0]),
            "d5": pa.array(
                [D("-999.99"), D("999.99"), None, D("0"), D("1.5"), D("-1.25"), D("0.01"), D("2")],
                pa.decimal128(5, 2),
            ),
            "d18": pa.array(
                [D("-12345678901234.5678"), D(1), None, D(0), D("1.5"), D("-1.25"), D(3), D(4)],
                pa.decimal128(18, 4),
            ),
            "d38": pa.array(
                [D("-" + "9" * 28 + ".9999999999"), D("9" * 28 + ".9999999999"), None]
                + [D("0"), D("1.5"), D("-1.25"), D("0.0000000001"), D("7")],
                pa.decimal128(38, 10),
            ),
            "s": pa.array(["abc", "zzz", None, "é" * 40, LONG, "\U0001f600" * 40, "", "m"]),
            "s_33": pa.array(["b" * 40, "b" * 39 + "c", None, "b", "c" * 33, "a", "bb", "c"]),
            "ls": pa.array(["x" * 70, "y", None, "é", "a", "b", "c", "d"], pa.large_string()),
            "b": pa.array([b"a", b"\xff", None, b"", b"x", b"y", b"z", b"w"]),
            "bo": pa.array([True, False, None, True, True, True, True, True]),
            "bo_true": pa.array([True, None, True, True, True, True, True, True]),
            "d": pa.array(
                [dt.date(1, 1, 1), dt.date(9999, 12, 31), None]
                + [dt.date(2020, 1, i) for i in range(1, 6)],
                pa.date32(),
            ),
            "ts": pa.array(
                [
                    dt.datetime(1, 1, 1, tzinfo=UTC),
                    dt.datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
                    None,
                    dt.datetime(2020, 1, 1, 1, 2, 3, 456789, tzinfo=UTC),
                    dt.datetime(1969, 12, 31, 23, 59, 59, 999500, tzinfo=UTC),
                    dt.datetime(2020, 1, 1, tzinfo=UTC),
                    dt.datetime(2020, 1, 1, 0, 0, 0, 120000, tzinfo=UTC),
                    dt.datetime(2020, 1, 1, tzinfo=UTC),
                ],
                TS,
            ),
            "ts_submilli": pa.array([1500, 2999, None, 1700, 2000, 2500, 1501, 2998], TS),
            "ts_negative": pa.array([-1500, -1, None, -1000, -999, -2, -3, -4], TS),
            "tsn": pa.array(
                [
                    dt.datetime(1, 1, 1),
                    dt.datetime(9999, 12, 31, 23, 59, 59, 999999),
                    None,
                    dt.datetime(2020, 1, 1, 1, 2, 3, 456789),
                    dt.datetime(1969, 12, 31, 23, 59, 59, 999500),
                    dt.datetime(2020, 1, 1),
                    dt.datetime(2020, 1, 1),
                    dt.datetime(2020, 1, 1),
                ],
                TS_NTZ,
            ),
            "st": pa.array(
                [
                    {"a": 1, "b": {"c": "x"}},
                    {"a": None, "b": {"c": None}},
                    None,
                    {"a": 4, "b": None},
                    {"a": 5, "b": {"c": "w"}},
                    {"a": -6, "b": {"c": "v"}},
                    {"a": 7, "b": {"c": "é" * 40}},
                    {"a": 8, "b": {"c": "z"}},
                ],
                s_type,
            ),
            # Nested non-finite floats: null bounds as delta-rs writes them (readers that
            # look at nested stats treat null as unknown); see the unbounded tests for
            # the top level.
            "fs": pa.array(
                [
                    {"pinf": inf, "ninf": -inf, "both": inf, "nan": nan, "allnan": nan},
                    {"pinf": 1.0, "ninf": 1.0, "both": -inf, "nan": 2.0, "allnan": None},
                ]
                + [{"pinf": 2.0, "ninf": 3.0, "both": 0.0, "nan": 1.0, "allnan": nan}] * 6,
                f_type,
            ),
            "l": pa.array([[1, 2], None, [], [3, None], [4], [5], [6], [7]], pa.list_(pa.int32())),
            "m": pa.array(
                [[("k", 1)], None, [], [("j", None)], [("a", 2)], [("b", 3)], [], []],
                pa.map_(pa.string(), pa.int32()),
            ),
            "all_null_i": pa.array([None] * rows, pa.int64()),
            "all_null_s": pa.array([None] * rows, pa.string()),
        }
    )


DECIMALS = {("d5",), ("d18",), ("d38",)}
# DELIBERATE: delta-rs writes no null count for binary columns; ours is exact (and lets
# the sink's NOT NULL check see nulls there).
BINARY_COUNTS = {("b",)}


@pytest.mark.parametrize("rows_per_group", [None, 2, 3])
def test_every_type_matches_delta_rs(tmp_path, rows_per_group):
    table = every_type()
    ours = our_stats(table, tmp_path / "ours", rows_per_group)
    theirs = delta_rs_stats(table, tmp_path / "theirs", rows_per_group)
    compare_with_delta_rs(ours, theirs, approx=DECIMALS, extra_counts=BINARY_COUNTS)
    check_bounds(table, ours)

    # The rules, spelled out.
    mins, maxs, nulls = ours["minValues"], ours["maxValues"], ours["nullCount"]
    assert maxs["i64"] == 2**63 - 1 and mins["i8"] == -128
    assert maxs["f64"] == D("1.7976931348623157e308") and mins["f64"] == D("-5e-324")
    assert maxs["f32"] == D(repr(3.4028234663852886e38))  # the float32's exact double
    assert same(mins["f32"], D("-0.0"))
    assert (mins["f64_nan"], maxs["f64_nan"]) == (D("1"), D("5"))  # NaN never counts
    assert same(mins["f64_zero"], D("-0.0")) and same(maxs["f64_zero"], D("0.0"))
    assert same(maxs["f64_negzero"], D("0.0"))  # the parquet rule: a zero max is +0.0
    assert mins["fs"] == {"pinf": D("1"), "ninf": None, "both": None, "nan": D("1")}
    assert maxs["fs"] == {"pinf": None, "ninf": D("3"), "both": None, "nan": D("2")}
    assert nulls["fs"]["allnan"] == 1
    assert mins["d38"] == D("-9999999999999999999999999999.9999999999")  # exact
    assert maxs["d5"] == D("999.99")
    assert mins["s"] == "" and maxs["s"] == "\U0001f600" * 15 + "\U0001f601"  # 64 bytes
    assert maxs["s_33"] == "c" * 33  # within 64 bytes: exact
    assert mins["ls"] == "a" and maxs["ls"] == "é"  # code point order
    assert "b" not in mins and "b" not in maxs and nulls["b"] == 1
    assert (mins["bo"], maxs["bo"], mins["bo_true"]) == (False, True, True)
    assert (mins["d"], maxs["d"]) == ("0001-01-01", "9999-12-31")
    assert mins["ts"] == "0001-01-01T00:00:00Z"
    assert maxs["ts"] == "9999-12-31T23:59:59.999Z"  # truncated down, as the protocol says
    assert (mins["ts_submilli"], maxs["ts_submilli"]) == (
        "1970-01-01T00:00:00.001Z",
        "1970-01-01T00:00:00.002Z",
    )
    assert mins["ts_negative"] == "1969-12-31T23:59:59.998Z"  # down, not towards zero
    assert maxs["ts_negative"] == "1969-12-31T23:59:59.999Z"
    assert (mins["tsn"], maxs["tsn"]) == ("0001-01-01 00:00:00", "9999-12-31 23:59:59.999")
    assert mins["st"] == {"a": -6, "b": {"c": "v"}}
    assert maxs["st"] == {"a": 8, "b": {"c": "é" * 31 + "ê"}}
    assert nulls["st"] == {"a": 2, "b": {"c": 3}}  # a parent's null is its leaves' null
    assert "l" not in nulls and "m" not in nulls  # as delta-rs: nothing for lists, maps
    assert (nulls["all_null_i"], nulls["all_null_s"]) == (8, 8)
    assert "all_null_i" not in mins and "all_null_s" not in maxs


def test_stats_are_strict_json(tmp_path):
    inner = pa.struct([("x", pa.float64())])
    table = pa.table(
        {
            "x": pa.array([math.inf, -math.inf, math.nan, -0.0, None]),
            "y": pa.array([math.nan] * 5, pa.float32()),
            "s": pa.array([{"x": v} for v in (math.inf, -math.inf, math.nan, 1.0, None)], inner),
        }
    )
    for rows_per_group in (None, 2):
        (h,) = stage(table, tmp_path / f"t{rows_per_group}", rows_per_group=rows_per_group)
        text = h.meta["stats"]
        for token in ("Infinity", "NaN"):
            assert token not in text
        stats = strict(text)  # raises on NaN/Infinity tokens
        assert stats == {"numRecords": 5, "nullCount": {"x": 1, "y": 0, "s": {"x": 1}}}


def test_partition_columns_have_no_stats(tmp_path):
    table = pa.table({"p": ["a", "a", "a"], "v": [3, 1, 2]})
    (h,) = stage(table, tmp_path / "ours", partition_by=("p",))
    ours = strict(h.meta["stats"])
    theirs = delta_rs_stats(table, tmp_path / "theirs", partition_by=["p"])
    compare_with_delta_rs(ours, theirs)
    expected = {"numRecords": 3, "minValues": {"v": 1}, "maxValues": {"v": 3}}
    assert ours == {**expected, "nullCount": {"v": 0}}


# --- columns without a bound --------------------------------------------------------------

DAY0 = dt.date(1970, 1, 1).toordinal()
YEAR_0 = dt.date(1, 1, 1).toordinal() - DAY0 - 1  # 0000-12-31, in days
YEAR_10000 = dt.date(9999, 12, 31).toordinal() - DAY0 + 1  # 10000-01-01
TS_YEAR_1 = -62_135_596_800_000_000  # 0001-01-01T00:00:00, in µs
TS_YEAR_10000 = 253_402_300_800_000_000  # 10000-01-01T00:00:00

UNBOUNDED = {
    "+inf": (pa.array([1.0, math.inf, None, 2.0]), ("x", ">", 1e308)),
    "-inf": (pa.array([1.0, -math.inf, None, 2.0]), ("x", "<", -1e308)),
    "both_inf": (pa.array([math.inf, -math.inf, None, 2.0]), ("x", "<", 0.0)),
    "all_nan": (pa.array([math.nan, math.nan, None, math.nan]), ("x", "!=", 5.0)),
    "f32_inf": (pa.array([1.0, math.inf, None, 2.0], pa.float32()), ("x", ">", 3e38)),
    "date_after_9999": (
        pa.array([0, YEAR_10000, None, 5], pa.date32()),
        ("x", ">", dt.date(9999, 1, 1)),
    ),
    "date_before_1": (pa.array([0, YEAR_0, None, 5], pa.date32()), ("x", "<", dt.date(1970, 1, 1))),
    "date_int32_edges": (
        pa.array([2**31 - 1, -(2**31), None, 0], pa.date32()),
        ("x", "=", dt.date(1970, 1, 1)),
    ),
    "ts_after_9999": (pa.array([0, TS_YEAR_10000, None, 5], TS), ("x", ">", pa.scalar(10, TS))),
    "ts_before_1": (pa.array([0, TS_YEAR_1 - 1, None, 5], TS), ("x", "<", pa.scalar(0, TS))),
    "tsn_int64_edges": (
        pa.array([2**63 - 1, -(2**63), None, 0], TS_NTZ),
        ("x", "=", pa.scalar(0, TS_NTZ)),
    ),
    # pyarrow keeps no footer bounds for a value over 4 KiB: the column's are unknown
    "string_over_4k": (pa.array(["a", "z" * 5000, None, "b"]), ("x", "=", "z" * 5000)),
}


@pytest.mark.parametrize("case", sorted(UNBOUNDED))
def test_a_top_level_column_without_bounds_costs_the_file_its_bounds(tmp_path, case):
    values, predicate = UNBOUNDED[case]
    table = pa.table({"id": pa.array([0, 1, 2, 3]), "x": values})
    (h,) = stage(table, tmp_path / "t")  # never an OverflowError
    stats = strict(h.meta["stats"])
    # DELIBERATE, unlike delta-rs (which keeps the other bounds): see delta_stats.
    assert stats == {"numRecords": 4, "nullCount": {"id": 0, "x": 1}}

    table_read = commit_staged(str(tmp_path / "t"), table.schema, [h])
    for f in (predicate, ("id", "=", 1)):
        expected = ids(table.filter(pq.filters_to_expression([f])))
        assert expected, f
        assert ids(table_read.to_pyarrow_table(filters=[f])) == expected, f
        sql = (
            QueryBuilder().register("t", table_read).execute(f"SELECT id FROM t WHERE {sql_of(f)}")
        )
        assert ids(sql.read_all()) == expected, f


def test_why_a_missing_bound_costs_the_file_its_bounds(tmp_path):
    """delta-rs's own table with +Infinity: max null, and its pyarrow dataset reads that
    as ``x <= null``, so a filtered read loses the row. (If this starts failing, delta-rs
    fixed it, and ``delta_stats`` could keep the other columns' bounds.)"""
    table = pa.table({"id": [0, 1], "x": [1.0, math.inf]})
    assert delta_rs_stats(table, tmp_path / "t")["maxValues"] == {"id": 1, "x": None}
    assert DeltaTable(str(tmp_path / "t")).to_pyarrow_table(filters=[("x", ">", 2.0)]).num_rows == 0


def test_nested_leaves_without_bounds_leave_only_their_bounds_out(tmp_path):
    day = YEAR_10000
    x_type = pa.struct(
        [
            ("d_both", pa.date32()),
            ("d_high", pa.date32()),
            ("d_low", pa.date32()),
            ("ts_both", TS),
            ("ts_edges", TS),
            ("ts_ns", pa.timestamp("ns", "UTC")),
            ("ts_ms", pa.timestamp("ms", "UTC")),
            ("tsn_both", TS_NTZ),
        ]
    )
    rows = [
        (YEAR_0, 0, YEAR_0, TS_YEAR_1 - 1, TS_YEAR_1, -(2**63), TS_YEAR_1 // 1000, TS_YEAR_1 - 1),
        (
            day,
            day,
            0,
            TS_YEAR_10000,
            TS_YEAR_10000 - 1,
            2**63 - 1,
            TS_YEAR_10000 // 1000,
            TS_YEAR_10000,
        ),
        (0, None, 5, 0, 0, 0, 0, 0),
    ]
    x = pa.array([dict(zip(x_type.names, r, strict=True)) for r in rows], x_type)
    table = pa.table({"id": [1, 2, 3], "x": x})
    (h,) = stage(table, tmp_path / "ours")  # no OverflowError
    stats = strict(h.meta["stats"])
    assert stats["minValues"] == {
        "id": 1,
        "x": {
            "d_high": "1970-01-01",
            "ts_edges": "0001-01-01T00:00:00Z",
            "ts_ns": "1677-09-21T00:12:43.145Z",
            "ts_ms": "0001-01-01T00:00:00Z",
        },
    }
    assert stats["maxValues"] == {
        "id": 3,
        "x": {
            "d_low": "1970-01-06",
            "ts_edges": "9999-12-31T23:59:59.999Z",
            "ts_ns": "2262-04-11T23:47:16.854Z",
        },
    }
    assert stats["nullCount"]["x"]["d_high"] == 1
    # DELIBERATE: delta-rs writes "0000-12-31" and "+10000-01-01" here, which its own
    # pyarrow reads then fail to parse ("year 0 is out of range").
    theirs = delta_rs_stats(table, tmp_path / "theirs")
    assert theirs["maxValues"]["x"]["d_both"] == "+10000-01-01"


# --- strings --------------------------------------------------------------------------

STRING_CASES = {
    "short": ["abc", "abd"],
    "exactly_64": ["z" * 64, "a"],
    "just_over": ["z" * 65, "a" * 65],
    "ascii_long": [LONG, "b" * 70],
    "two_byte": ["é" * 40, "è" * 33],
    "four_byte": ["\U0001f600" * 40, "\U0001f600" * 16],
    "cut_inside_char": ["a" * 63 + "é" + "zz", "b"],
    "max_char_kept_whole": ["\U0010ffff" * 70, "a"],
    "max_char_then_carry": ["a" * 60 + "\U0010ffff" + "zzz", "a"],
    "0x7f_grows": ["a" * 63 + "\x7f" + "zz", "a"],
    "0x7ff_grows": ["a" * 62 + "\u07ff" + "zz", "a"],
    "before_surrogates": ["a" * 61 + "\ud7ff" + "zz", "a"],
    "0xffff_grows": ["a" * 61 + "\uffff" + "zz", "a"],
    "nul_chars": ["\x00" * 70, "\x00"],
    "empty": ["", ""],
}


@pytest.mark.parametrize("rows_per_group", [None, 1])
def test_strings_match_delta_rs(tmp_path, rows_per_group):
    table = pa.table({k: pa.array(v + [None]) for k, v in STRING_CASES.items()})
    ours = our_stats(table, tmp_path / "ours", rows_per_group)
    theirs = delta_rs_stats(table, tmp_path / "theirs", rows_per_group)
    compare_with_delta_rs(ours, theirs)
    check_bounds(table, ours)
    assert ours["maxValues"]["max_char_kept_whole"] == "\U0010ffff" * 70
    assert ours["maxValues"]["max_char_then_carry"] == "a" * 59 + "b"
    assert ours["maxValues"]["0x7f_grows"] == "a" * 62 + "b"
    assert ours["minValues"]["cut_inside_char"] == "a" * 63


def test_string_bounds_hold_for_random_strings():
    alphabet = ["a", "z", "\x00", "\x7f", "\x80", "é", "\u07ff", "\u0800", "\ud7ff", "\ue000"]
    alphabet += ["\uffff", "\U00010000", "\U0001f600", "\U0010ffff"]
    rng = random.Random(7)
    for _ in range(3000):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 50)))
        b = s.encode()
        lo, hi = _string_min(b), _string_max(b)
        assert lo.decode() <= s <= hi.decode()
        assert len(lo) <= 64 and (len(hi) <= 64 or hi == b)
        assert s.startswith(lo.decode())
        if hi != b:  # hi also bounds everything that starts with the cut prefix
            assert lo.decode() + "\U0010ffff" * 3 < hi.decode()


def test_strings_read_back_as_written(tmp_path):
    """delta-rs parses string bounds (and column names) to exactly the text we wrote."""
    tricky = [
        "\U0010ffff\U0010fffe",
        "\x00nul",
        'quo"te',
        "back\\slash",
        "new\nline",
        "\U0001f600é",
    ]
    table = pa.table({f'c{i} é"': pa.array([v, v + "x"]) for i, v in enumerate(tricky)})
    uri = str(tmp_path / "t")
    handles = stage(table, uri)
    assert "\\ud" not in handles[0].meta["stats"].lower()  # raw UTF-8: no surrogate escapes
    (parsed,) = pa.table(
        commit_staged(uri, table.schema, handles).get_add_actions(flatten=True)
    ).to_pylist()
    for i, v in enumerate(tricky):
        assert (parsed[f'min.c{i} é"'], parsed[f'max.c{i} é"']) == (v, v + "x"), v


# --- row groups and missing footer statistics -------------------------------------------


class _Footer:
    """Row groups of several parquet files seen as one file's metadata."""

    def __init__(self, *metas):
        self.schema = metas[0].schema
        self.num_columns = metas[0].num_columns
        self.num_rows = sum(m.num_rows for m in metas)
        self.groups = [m.row_group(i) for m in metas for i in range(m.num_row_groups)]
        self.num_row_groups = len(self.groups)

    def row_group(self, i):
        return self.groups[i]


def test_a_row_group_without_statistics_leaves_the_column_out(tmp_path):
    table = pa.table(
        {"id": [1, 2, 3], "st": [{"a": 1, "s": "x"}, {"a": 2, "s": "y"}, {"a": None, "s": "z"}]}
    )
    pq.write_table(table, tmp_path / "with.parquet")
    pq.write_table(table, tmp_path / "without.parquet", write_statistics=["id", "st.s"])
    metas = [pq.ParquetFile(tmp_path / f).metadata for f in ("with.parquet", "without.parquet")]
    assert metas[1].row_group(0).column(1).statistics is None
    stats = strict(delta_stats(_Footer(*metas), table.schema))
    assert stats == {
        "numRecords": 6,
        "minValues": {"id": 1, "st": {"s": "x"}},
        "maxValues": {"id": 3, "st": {"s": "z"}},
        "nullCount": {"id": 0, "st": {"s": 0}},
    }
    # At the top level, an unknown column costs the file its bounds (see delta_stats).
    flat = table.flatten()
    pq.write_table(flat, tmp_path / "flat_with.parquet")
    pq.write_table(flat, tmp_path / "flat_without.parquet", write_statistics=["id", "st.s"])
    metas = [
        pq.ParquetFile(tmp_path / f).metadata for f in ("flat_with.parquet", "flat_without.parquet")
    ]
    stats = strict(delta_stats(_Footer(*metas), flat.schema))
    assert stats == {"numRecords": 6, "nullCount": {"id": 0, "st.s": 0}}


def test_what_cannot_be_read_gets_no_bounds(tmp_path):
    table = pa.table({"id": [1, 2], "u": pa.array([1, 255], pa.uint8())})
    pq.write_table(table, tmp_path / "f.parquet")
    meta = pq.ParquetFile(tmp_path / "f.parquet").metadata
    # Unsigned integers have no Delta type of their own (delta-rs maps uint8 to byte).
    assert strict(delta_stats(meta, table.schema)) == {
        "numRecords": 2,
        "nullCount": {"id": 0, "u": 0},
    }
    # A footer that does not match the schema: nothing but the row count.
    other = pa.schema([("id", pa.int64()), ("u", pa.int32()), ("v", pa.int32())])
    assert strict(delta_stats(meta, other)) == {"numRecords": 2, "nullCount": {}}


def test_row_groups_combine(tmp_path):
    table = pa.table(
        {
            "i": pa.array([5, None, -3, 9, None, None]),
            "f": pa.array([math.nan, math.nan, 2.0, -0.0, 7.5, None]),  # an all-NaN group
            "s": pa.array([None, None, "m", "b" * 70, "c", "a"]),  # an all-null group
            "st": pa.array([{"big": v} for v in ["x" * 5000, "a", "b", "c", "d", "e"]]),
        }
    )
    ours = our_stats(table, tmp_path / "ours", rows_per_group=2)
    check_bounds(table, ours)
    assert ours["minValues"] == {"i": -3, "f": D("-0.0"), "s": "a"}
    assert ours["maxValues"] == {"i": 9, "f": D("7.5"), "s": "m"}
    assert ours["nullCount"] == {"i": 3, "f": 1, "s": 2, "st": {"big": 0}}
    # DELIBERATE: pyarrow keeps no bounds for a row group with a value over 4 KiB, so the
    # leaf's bounds are unknown for the file; delta-rs writes truncated ones.
    theirs = delta_rs_stats(table, tmp_path / "theirs", rows_per_group=2)
    assert theirs["maxValues"]["st"]["big"] == "x" * 63 + "y"
    for key in ("minValues", "maxValues"):
        theirs[key].pop("st")
    compare_with_delta_rs(ours, theirs)


# --- nested columns and decimals -----------------------------------------------------------


def test_nested_columns_match_delta_rs(tmp_path):
    inner = pa.struct([("a", pa.int32()), ("b", pa.struct([("c", pa.string())]))])
    table = pa.table(
        {
            "s": pa.array(
                [
                    {"a": 1, "b": {"c": "x"}},
                    None,
                    {"a": None, "b": None},
                    {"a": 3, "b": {"c": "y"}},
                ],
                inner,
            ),
            "ls": pa.array([[{"a": 1, "b": {"c": "x"}}], None, [], [None]], pa.list_(inner)),
            "ms": pa.array(
                [[("k", {"a": 1, "b": None})], None, [], [("j", None)]], pa.map_(pa.string(), inner)
            ),
            "sl": pa.array(
                [{"l": [1, 2], "i": 3}, None, {"l": None, "i": None}, {"l": [], "i": 4}],
                pa.struct([("l", pa.list_(pa.int32())), ("i", pa.int32())]),
            ),
            "sb": pa.array(
                [{"b": b"x"}, None, {"b": None}, {"b": b"y"}], pa.struct([("b", pa.binary())])
            ),
            "s_null": pa.array(
                [{"a": None}, None, None, {"a": None}], pa.struct([("a", pa.int32())])
            ),
        }
    )
    ours = our_stats(table, tmp_path / "ours")
    theirs = delta_rs_stats(table, tmp_path / "theirs")
    compare_with_delta_rs(ours, theirs, extra_counts={("sb", "b")})
    check_bounds(table, ours)
    assert ours["nullCount"] == {
        "s": {"a": 2, "b": {"c": 2}},
        "sl": {"i": 2},
        "sb": {"b": 2},
        "s_null": {"a": 4},
    }
    assert ours["minValues"] == {"s": {"a": 1, "b": {"c": "x"}}, "sl": {"i": 3}}
    assert ours["maxValues"] == {"s": {"a": 3, "b": {"c": "y"}}, "sl": {"i": 4}}


def test_decimal_bounds_are_exact(tmp_path):
    table = pa.table(
        {
            "d38_0": pa.array([D("9" * 38), D("-" + "9" * 38), D(1)], pa.decimal128(38, 0)),
            "d38_38": pa.array(
                [D("0." + "9" * 38), D("-0." + "0" * 37 + "1"), D(0)], pa.decimal128(38, 38)
            ),
            "d9": pa.array([D("-1.000000001"), D("0.000000001"), None], pa.decimal128(10, 9)),
            "d1": pa.array([D(1), D(-9), D(0)], pa.decimal128(1, 0)),
        }
    )
    ours = our_stats(table, tmp_path / "ours")
    check_bounds(table, ours)
    assert ours["minValues"] == {
        "d38_0": D("-" + "9" * 38),
        "d38_38": D("-0." + "0" * 37 + "1"),
        "d9": D("-1.000000001"),
        "d1": D(-9),
    }
    assert ours["maxValues"]["d38_0"] == D("9" * 38)
    assert ours["maxValues"]["d38_38"] == D("0." + "9" * 38)
    assert ours["maxValues"]["d9"] == D("0.000000001")
    # DELIBERATE: delta-rs's float bounds are wrong here (max 2**63-1 < 10**38-1), and
    # its own skipping then loses rows; ours are exact and read back exactly.
    theirs = delta_rs_stats(table, tmp_path / "theirs")
    assert theirs["maxValues"]["d38_0"] < D("9" * 38)
    uri = str(tmp_path / "committed")
    read = commit_staged(uri, table.schema, stage(table, uri))
    (parsed,) = pa.table(read.get_add_actions(flatten=True)).to_pylist()
    assert parsed["max.d38_0"] == D("9" * 38) and parsed["min.d38_38"] == D("-1e-38")
    f = [("d38_0", ">", D("1" + "0" * 30))]
    assert ids_of(read.to_pyarrow_table(filters=f), "d38_0") == [D("9" * 38)]


# --- end to end: staged files committed as the sink does, read back by delta-rs -----------------

BIG = D("9" * 28 + ".9999999999")
NEG_BIG = D("-" + "9" * 28 + ".9999999999")  # not -BIG: that rounds to 28 digits
S_TYPE = pa.struct([("a", pa.int32()), ("b", pa.struct([("c", pa.string())]))])
E2E_SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("f64", pa.float64()),
        ("f32", pa.float32()),
        ("d38", pa.decimal128(38, 10)),
        ("s", pa.string()),
        ("b", pa.binary()),
        ("bo", pa.bool_()),
        ("d", pa.date32()),
        ("ts", TS),
        ("tsn", TS_NTZ),
        ("st", S_TYPE),
        ("l", pa.list_(pa.int32())),
        ("m", pa.map_(pa.string(), pa.int32())),
        ("nan", pa.float64()),
    ]
)
TS_BASE = 1_577_836_800_000_000  # 2020-01-01T00:00:00 in µs
F32_MAX = 3.4028234663852886e38


def e2e_rows(first_id: int, n: int, edits=()) -> pa.Table:
    rows = []
    for i in range(first_id, first_id + n):
        rows.append(
            {
                "id": i,
                "f64": i / 7,
                "f32": float(i),
                "d38": D(i) / 4,
                "s": f"row {i:05d}",
                "b": bytes([i % 256]),
                "bo": i % 2 == 0,
                "d": dt.date(2020, 1, 1).toordinal() - DAY0 + i,
                "ts": TS_BASE + i * 1_000_001,
                "tsn": TS_BASE + i * 1_000_001,
                "st": {"a": i, "b": {"c": f"c{i}"}} if i % 3 else None,
                "l": [i, None],
                "m": [("k", i)],
                "nan": math.nan if i % 4 == 0 else float(i),
            }
        )
    for j, values in edits:
        rows[j].update(values)
    return pa.Table.from_pylist(rows, schema=E2E_SCHEMA)


# Extreme, but every top-level column bounded.
HIGH_EDITS = [
    (0, dict(f64=1.7976931348623157e308, f32=F32_MAX, d38=BIG, s="\U0001f600" * 40, d=2_932_896)),
    (1, dict(f64=-1.7976931348623157e308, f32=-F32_MAX, d38=NEG_BIG, s="é" * 40, d=-719_162)),
    (2, dict(f64=-0.0, f32=-0.0, d38=D("-0.0000000001"), s="\U0010ffff" * 20)),
    (0, dict(ts=TS_YEAR_10000 - 1, tsn=TS_YEAR_10000 - 1)),  # 9999-12-31T23:59:59.999999
    (1, dict(ts=TS_YEAR_1, tsn=TS_YEAR_1)),
    (2, dict(ts=TS_BASE + 999, tsn=TS_BASE + 999)),  # a sub-millisecond value
    (4, dict(st={"a": None, "b": None})),
]
# What has no bound: ±Infinity, dates and timestamps beyond years 1 to 9999.
WILD_EDITS = [
    (0, dict(f64=math.inf, f32=math.inf)),
    (1, dict(f64=-math.inf, f32=-math.inf)),
    (2, dict(d=YEAR_10000, ts=TS_YEAR_10000)),
    (3, dict(d=YEAR_0, tsn=TS_YEAR_1 - 1)),
    (4, dict(d=2**31 - 1)),
]

# (tuple filter, the same in SQL)
E2E_FILTERS = [
    (("id", ">=", 1000), "id >= 1000"),
    (("id", "<", 3), "id < 3"),
    (("f64", ">", 1e308), "f64 > 1e308"),
    (("f64", "<", -1e308), "f64 < -1e308"),
    (("f64", "=", 1.7976931348623157e308), "f64 = 1.7976931348623157e308"),
    (("f32", "<", -3e38), "f32 < -3e38"),
    (("f32", ">=", F32_MAX), f"f32 >= CAST({F32_MAX!r} AS FLOAT)"),
    (("d38", ">=", BIG), f"d38 >= CAST('{BIG}' AS DECIMAL(38, 10))"),
    (("d38", "<=", NEG_BIG), f"d38 <= CAST('-{BIG}' AS DECIMAL(38, 10))"),
    (
        ("d38", ">", D("9999999999999999999999999999.9")),
        "d38 > CAST('9999999999999999999999999999.9' AS DECIMAL(38, 10))",
    ),
    (("s", "=", "\U0001f600" * 40), "s = '" + "\U0001f600" * 40 + "'"),
    (("s", ">=", "\U0010ffff" * 20), "s >= '" + "\U0010ffff" * 20 + "'"),
    (("s", "=", "é" * 40), "s = '" + "é" * 40 + "'"),
    (("s", "=", "row 00007"), "s = 'row 00007'"),
    (("d", ">", dt.date(9999, 12, 30)), "d > DATE '9999-12-30'"),
    (("d", "<", dt.date(1, 1, 2)), "d < DATE '0001-01-02'"),
    (("d", "=", dt.date(9999, 12, 31)), "d = DATE '9999-12-31'"),
    (("ts", "=", pa.scalar(TS_YEAR_10000 - 1, TS)), None),
    (("ts", ">", pa.scalar(TS_YEAR_10000 - 1000, TS)), None),
    (("ts", "=", pa.scalar(TS_BASE + 999, TS)), None),
    (("ts", "<=", pa.scalar(TS_YEAR_1, TS)), None),
    (("tsn", "=", pa.scalar(TS_YEAR_10000 - 1, TS_NTZ)), None),
    (("tsn", "<", pa.scalar(TS_YEAR_1 + 1, TS_NTZ)), None),
    (("bo", "=", True), "bo = true"),
]


def sql_of(f) -> str:
    column, op, value = f
    if isinstance(value, pa.TimestampScalar):
        zone = ', Some("UTC")' if value.type.tz else ""
        return f"{column} {op} arrow_cast({value.value}, 'Timestamp(Microsecond{zone})')"
    if isinstance(value, dt.date):
        return f"{column} {op} DATE '{value.isoformat()}'"
    if isinstance(value, str):
        return f"{column} {op} '{value}'"
    return f"{column} {op} {value!r}"


def commit_staged(uri: str, schema: pa.Schema, handles) -> DeltaTable:
    """What ``DeltaTarget.commit`` does for a new table."""
    adds = add_actions(handles)
    create_table_with_add_actions(uri, Schema.from_arrow(schema), adds, mode="error")
    return DeltaTable(uri)


def scanned_files(table: DeltaTable, where: str) -> set[str]:
    plan = QueryBuilder().register("t", table).execute(f"EXPLAIN SELECT id FROM t WHERE {where}")
    text = "\n".join(pa.table(plan.read_all())["plan"].to_pylist())
    names = {uri.rsplit("/", 1)[1] for uri in table.file_uris()}
    return {name for name in names if name in text}


def ids(table) -> list:
    return ids_of(table, "id")


def ids_of(table, column) -> list:
    return sorted(pa.table(table)[column].to_pylist())


def test_end_to_end_extreme_values_read_back_and_filtered(tmp_path):
    uri = str(tmp_path / "table")
    low = e2e_rows(0, 50)
    high = e2e_rows(1000, 30, HIGH_EDITS)
    wild = e2e_rows(2000, 10, WILD_EDITS)
    handles = stage(low, uri, partition=0) + stage(high, uri, partition=1)
    handles += stage(wild, uri, partition=2)
    for h, part in zip(handles, (low, high, wild), strict=True):
        check_bounds(part, strict(h.meta["stats"]))
    table = commit_staged(uri, E2E_SCHEMA, handles)
    data = pa.concat_tables([low, high, wild])

    # Everything reads back.
    read = table.to_pyarrow_table().sort_by("id")
    assert read.drop_columns(["nan"]).equals(data.drop_columns(["nan"]))
    as_text = [t["nan"].cast(pa.string()).to_pylist() for t in (read, data)]  # NaN != NaN
    assert as_text[0] == as_text[1]

    # delta-rs parses the stats to what they say.
    parsed = {p["path"]: p for p in pa.table(table.get_add_actions(flatten=True)).to_pylist()}
    p_low, p_high, p_wild = (parsed[h.handle] for h in handles)
    assert p_high["max.d38"] == BIG and p_high["min.d38"] == NEG_BIG
    assert p_high["max.f64"] == 1.7976931348623157e308 and p_high["max.f32"] == F32_MAX
    assert p_high["max.ts"] == dt.datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=UTC)
    assert p_high["min.tsn"] == dt.datetime(1, 1, 1)
    assert (p_high["min.d"], p_high["max.d"]) == (dt.date(1, 1, 1), dt.date(9999, 12, 31))
    assert p_high["max.s"] == "\U0010ffff" * 20 and p_high["min.s"] == "row 01003"
    assert p_high["null_count.st.a"] == 11 and p_high["null_count.st.b.c"] == 11
    assert p_low["max.nan"] == 49.0 and p_low["null_count.b"] == 0
    assert all(p_wild[k] is None for k in p_wild if k.startswith(("min.", "max.")))
    assert p_wild["null_count.f64"] == 0 and p_wild["num_records"] == 10

    # Filtered reads (stats used for skipping) return what filtering the data returns,
    # through pyarrow datasets and through DataFusion.
    qb = QueryBuilder().register("t", table)
    for f, sql in E2E_FILTERS:
        expected = ids(data.filter(pq.filters_to_expression([f])))
        assert expected, f
        assert ids(table.to_pyarrow_table(filters=[f])) == expected, f
        got = qb.execute(f"SELECT id FROM t WHERE {sql or sql_of(f)}").read_all()
        assert ids(got) == expected, f
    a, c = (pc.struct_field(data["st"], path) for path in (["a"], ["b", "c"]))
    for where, mask in [
        ("t.st['a'] >= 1020", pc.greater_equal(a, 1020)),
        ("t.st['b']['c'] = 'c1028'", pc.equal(c, "c1028")),
        (
            "t.st['a'] IS NULL AND t.id >= 1000",
            pc.and_(pc.is_null(a), pc.greater_equal(data["id"], 1000)),
        ),
    ]:
        expected = ids(data.filter(mask))
        assert expected, where
        assert ids(qb.execute(f"SELECT id FROM t WHERE {where}").read_all()) == expected, where

    # Skipping happens, and only where the stats allow it (the wild file has no bounds).
    f_low, f_high, f_wild = (h.handle.rsplit("/", 1)[-1] for h in handles)
    assert scanned_files(table, "id >= 1000 AND id < 2000") == {f_high, f_wild}
    assert scanned_files(table, "id < 50") == {f_low, f_wild}
    assert scanned_files(table, "d38 > 1000") == {f_high, f_wild}
    assert scanned_files(table, "s = 'row 00007'") == {f_low, f_wild}
    assert scanned_files(table, "d > DATE '2030-01-01'") == {f_high, f_wild}


def test_end_to_end_polars_reads_the_table(tmp_path):
    pl = pytest.importorskip("polars")
    uri = str(tmp_path / "table")
    parts = [e2e_rows(0, 20), e2e_rows(1000, 30, HIGH_EDITS), e2e_rows(2000, 10, WILD_EDITS)]
    handles = [h for i, part in enumerate(parts) for h in stage(part, uri, partition=i)]
    commit_staged(uri, E2E_SCHEMA, handles)
    assert pl.read_delta(uri).height == 60
    for expr, expected in [
        (pl.col("f64") > 1.7976931348623157e308, [2000]),
        (pl.col("f64") < -1e308, [1001, 2001]),
        (pl.col("f64") >= 1.7976931348623157e308, [1000, 2000]),
        (pl.col("id") >= 1000, list(range(1000, 1030)) + list(range(2000, 2010))),
        (pl.col("s") == "é" * 40, [1001]),
        (pl.col("d38") >= BIG, [1000]),
    ]:
        got = pl.scan_delta(uri).filter(expr).select("id").collect()
        assert sorted(got["id"].to_list()) == expected, expr
