"""Nulls under null parents: Spark marks a NOT NULL field null where its nullable parent
struct is null, which parquet's writer refuses; such nulls are replaced before writing."""

from __future__ import annotations

import decimal
from typing import Any

# --- nulls under null parents -------------------------------------------------------
# Spark hands ``when(c, struct(...))`` over as a nullable struct whose fields are NOT
# NULL, and marks the fields null where the struct is: valid Arrow, but parquet's writer
# refuses a non-nullable column holding nulls. Under a null parent a child's value is
# never read, so such nulls are replaced by any value of the type.


def has_nested_required(schema) -> bool:
    """Whether a field below the top level is NOT NULL (only then can Spark send nulls
    the writer refuses)."""
    import pyarrow as pa

    def walk(t, top: bool, nullable: bool) -> bool:
        if not top and not nullable:
            return True
        if pa.types.is_struct(t):
            return any(walk(f.type, False, f.nullable) for f in t)
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            return walk(t.value_type, False, t.value_field.nullable)
        if pa.types.is_map(t):
            return walk(t.item_type, False, t.item_field.nullable)
        return False

    return any(walk(f.type, True, f.nullable) for f in schema)


def fill_masked_nulls(batch):
    """``batch`` with every null of a NOT NULL field below the top level replaced (see
    above). A top-level column is left alone: a null there is a real error, reported by
    the writer."""
    import pyarrow as pa

    # (a sliced list's offsets cannot take a null mask: copy it to offset 0 first)
    columns = [_fill_children(pa.concat_arrays([c]) if c.offset else c) for c in batch.columns]
    return pa.RecordBatch.from_arrays(columns, schema=batch.schema)


def _fill_children(arr):
    """``arr`` with its children's masked nulls filled; its own nulls kept."""
    import pyarrow as pa

    t = arr.type
    mask = arr.is_null() if arr.null_count else None
    if pa.types.is_struct(t):
        children = [_fill_field(arr.field(i), f) for i, f in enumerate(t)]
        return pa.StructArray.from_arrays(children, fields=list(t), mask=mask)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        values = _fill_field(arr.values, t.value_field)
        cls = pa.ListArray if pa.types.is_list(t) else pa.LargeListArray
        return cls.from_arrays(arr.offsets, values, type=t, mask=mask)
    if pa.types.is_map(t):
        items = _fill_field(arr.items, t.item_field)
        return pa.MapArray.from_arrays(arr.offsets, arr.keys, items, type=t, mask=mask)
    return arr


def _fill_field(arr, field):
    arr = _fill_children(arr)
    if field.nullable or arr.null_count == 0:
        return arr
    return _without_nulls(arr)


def _without_nulls(arr):
    """``arr`` with no null left: nested values become present (their own children are
    filled as needed), scalars take the type's zero."""
    import pyarrow as pa
    import pyarrow.compute as pc

    t = arr.type
    if pa.types.is_struct(t):
        return pa.StructArray.from_arrays(
            [_fill_field(arr.field(i), f) for i, f in enumerate(t)], fields=list(t)
        )
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        cls = pa.ListArray if pa.types.is_list(t) else pa.LargeListArray
        return cls.from_arrays(arr.offsets, arr.values, type=t)  # null slots: empty lists
    if pa.types.is_map(t):
        return pa.MapArray.from_arrays(arr.offsets, arr.keys, arr.items, type=t)
    return pc.fill_null(arr, _zero(t))


def _zero(t: Any) -> Any:
    import pyarrow as pa

    if pa.types.is_boolean(t):
        value: Any = False
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        value = ""
    elif pa.types.is_fixed_size_binary(t):
        value = b"\0" * t.byte_width
    elif pa.types.is_binary(t) or pa.types.is_large_binary(t):
        value = b""
    elif pa.types.is_decimal(t):
        value = decimal.Decimal(0)
    elif pa.types.is_date(t) or pa.types.is_timestamp(t):
        return pa.scalar(0, pa.int64() if pa.types.is_timestamp(t) else pa.int32()).cast(t)
    else:
        value = 0
    return pa.scalar(value, t)
