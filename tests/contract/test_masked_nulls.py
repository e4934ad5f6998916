"""NOT NULL fields under null parents, as Spark sends ``when(c, struct(...))``: the
staged parquet file must be writable and read back with the same rows."""

from __future__ import annotations

import datetime as dt
import decimal
import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pyspark_txn.sinks.staging import fill_masked_nulls, has_nested_required

REQUIRED = [
    pa.field("i", pa.int32(), nullable=False),
    pa.field("s", pa.string(), nullable=False),
    pa.field("b", pa.binary(), nullable=False),
    pa.field("flag", pa.bool_(), nullable=False),
    pa.field("d", pa.decimal128(20, 4), nullable=False),
    pa.field("day", pa.date32(), nullable=False),
    pa.field("ts", pa.timestamp("us", tz="UTC"), nullable=False),
    pa.field("inner", pa.struct([pa.field("c", pa.int64(), nullable=False)]), nullable=False),
    pa.field("xs", pa.list_(pa.field("e", pa.int32(), nullable=False)), nullable=False),
]
STRUCT = pa.struct(REQUIRED)
SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        pa.field("st", STRUCT),  # nullable, its fields not
        pa.field("arr", pa.list_(pa.field("element", STRUCT))),  # null elements
        pa.field("m", pa.map_(pa.string(), pa.field("value", STRUCT))),  # null values
    ]
)
VALUE = {
    "i": 7,
    "s": "x",
    "b": b"\x00\xff",
    "flag": True,
    "d": decimal.Decimal("1.2345"),
    "day": dt.date(2026, 11, 24),
    "ts": dt.datetime(2026, 11, 24, 1, 2, 3, tzinfo=dt.timezone.utc),
    "inner": {"c": 5},
    "xs": [1, 2],
}


def _spark_like(rows: list[dict]) -> pa.RecordBatch:
    """Build the batch as Spark does: a null parent's NOT NULL children hold nulls too."""

    def null_children(t):
        return {f.name: None for f in t}

    def struct_array(values: list, t) -> pa.Array:
        children = []
        for f in t:
            col = [None if v is None else v[f.name] for v in values]
            if pa.types.is_struct(f.type):
                children.append(struct_array(col, f.type))
            else:
                children.append(pa.array(col, f.type))
        mask = pa.array([v is None for v in values])
        return pa.StructArray.from_arrays(children, fields=list(t), mask=mask)

    ids = pa.array([r["id"] for r in rows], pa.int64())
    st = struct_array([r["st"] for r in rows], STRUCT)
    elements = [e for r in rows for e in (r["arr"] or [])]
    offsets, n = [0], 0
    for r in rows:
        n += len(r["arr"] or [])
        offsets.append(n)
    arr = pa.ListArray.from_arrays(
        pa.array(offsets, pa.int32()),
        struct_array(elements, STRUCT),
        type=SCHEMA.field("arr").type,
        mask=pa.array([r["arr"] is None for r in rows]),
    )
    items = [v for r in rows for v in (r["m"] or {}).values()]
    keys = [k for r in rows for k in (r["m"] or {})]
    offsets, n = [0], 0
    for r in rows:
        n += len(r["m"] or {})
        offsets.append(n)
    m = pa.MapArray.from_arrays(
        pa.array(offsets, pa.int32()),
        pa.array(keys, pa.string()),
        struct_array(items, STRUCT),
        type=SCHEMA.field("m").type,
        mask=pa.array([r["m"] is None for r in rows]),
    )
    assert null_children(STRUCT)  # (the struct has fields)
    return pa.RecordBatch.from_arrays([ids, st, arr, m], schema=SCHEMA)


ROWS = [
    {"id": 0, "st": VALUE, "arr": [VALUE, None], "m": {"a": VALUE, "b": None}},
    {"id": 1, "st": None, "arr": None, "m": None},
    {"id": 2, "st": None, "arr": [None], "m": {"z": None}},
    {"id": 3, "st": VALUE, "arr": [], "m": {}},
]


def _write_read(batch: pa.RecordBatch) -> list[dict]:
    out = io.BytesIO()
    pq.write_table(pa.Table.from_batches([batch]), out)
    out.seek(0)
    return pq.read_table(out).to_pylist()


def _expected(rows: list[dict]) -> list[dict]:
    def conv(r):
        return {**r, "m": None if r["m"] is None else list(r["m"].items())}

    return [conv(r) for r in rows]


@pytest.mark.parametrize("sliced", [False, True], ids=["whole", "sliced"])
def test_nulls_of_not_null_fields_under_null_parents_are_written_and_read_back(sliced):
    batch = _spark_like(ROWS)
    rows = ROWS
    if sliced:  # arrays with an offset, as a split batch has
        batch, rows = batch.slice(1, 3), ROWS[1:]
    with pytest.raises(pa.ArrowInvalid, match="non-nullable but contains nulls"):
        _write_read(batch)  # what the sink did before
    assert has_nested_required(batch.schema)
    filled = fill_masked_nulls(batch)
    assert filled.schema.equals(batch.schema)
    assert _write_read(filled) == _expected(rows)


def test_schemas_without_nested_not_null_fields_are_left_alone():
    plain = pa.schema(
        [pa.field("id", pa.int64(), nullable=False), pa.field("s", pa.struct([("a", pa.int32())]))]
    )
    assert not has_nested_required(plain)
    assert has_nested_required(SCHEMA)


def test_a_null_in_a_not_null_top_level_column_is_still_refused():
    batch = pa.RecordBatch.from_arrays(
        [pa.array([1, None], pa.int64())],
        schema=pa.schema([pa.field("id", pa.int64(), nullable=False)]),
    )
    with pytest.raises(pa.ArrowInvalid, match="non-nullable but contains nulls"):
        _write_read(fill_masked_nulls(batch))
