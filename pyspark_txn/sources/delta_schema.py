"""The source table's schema: logical to physical names (column mapping), which schema
changes are compatible (type widening, added nullable columns), and reading a data
file into the stream's Arrow schema."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from ..errors import SourceError
from ._partition_values import DECIMAL_TYPE, INTEGRAL_TYPES, type_name

READ_BATCH_ROWS = 65536  # rows per Arrow batch read from a data file
_FIELD_ID = b"PARQUET:field_id"


def _physical(field: Mapping[str, Any], mode: str) -> str:
    if mode == "none":
        return field["name"]
    return (field.get("metadata") or {}).get("delta.columnMapping.physicalName", field["name"])


def _field_id(field: Mapping[str, Any]) -> int | None:
    raw = (field.get("metadata") or {}).get("delta.columnMapping.id")
    return None if raw is None else int(raw)


def _widens(old: str, new: str) -> bool:
    """Delta type widening: values of ``old`` read losslessly as ``new``."""
    if old == new:
        return True
    if old in INTEGRAL_TYPES and new in INTEGRAL_TYPES:
        return INTEGRAL_TYPES.index(old) < INTEGRAL_TYPES.index(new)
    if old == "float" and new == "double":
        return True
    if old in ("byte", "short", "integer") and new == "double":
        return True
    if old == "date" and new == "timestamp_ntz":
        return True
    m_new = DECIMAL_TYPE.fullmatch(new)
    if m_new:
        p2, s2 = int(m_new[1]), int(m_new[2])
        m_old = DECIMAL_TYPE.fullmatch(old)
        if m_old:
            p1, s1 = int(m_old[1]), int(m_old[2])
            return s2 >= s1 and p2 - s2 >= p1 - s1
        digits = {"byte": 3, "short": 5, "integer": 10, "long": 20}.get(old)
        return digits is not None and p2 - s2 >= digits
    return False


def _type_change(old: Any, new: Any, mode: str, path: str) -> str | None:
    """Why data of Delta type ``old`` cannot be read as the stream's type ``new``; None if it can."""
    if isinstance(old, str) or isinstance(new, str):
        if isinstance(old, str) and isinstance(new, str) and _widens(old, new):
            return None
        return f"column {path!r} changed type from {type_name(old)} to {type_name(new)}"
    if old["type"] != new["type"]:
        return f"column {path!r} changed type from {type_name(old)} to {type_name(new)}"
    if old["type"] == "struct":
        return _struct_change(old, new, mode, path + ".")
    if old["type"] == "array":
        if old.get("containsNull", True) and not new.get("containsNull", True):
            return f"the elements of column {path!r} became nullable"
        return _type_change(old["elementType"], new["elementType"], mode, path + ".element")
    if old["type"] == "map":
        if old.get("valueContainsNull", True) and not new.get("valueContainsNull", True):
            return f"the values of column {path!r} became nullable"
        return _type_change(old["keyType"], new["keyType"], mode, path + ".key") or _type_change(
            old["valueType"], new["valueType"], mode, path + ".value"
        )
    return None


def _struct_change(old: Mapping, new: Mapping, mode: str, prefix: str = "") -> str | None:
    """Why the stream's struct ``new`` cannot carry the table's struct ``old``; None if it can.

    ``new`` may have more fields than ``old`` (they read as null): that is how a query
    restarted on a newer schema replays versions written before the change.
    """
    by_name = {f["name"]: f for f in new["fields"]}
    for f in old["fields"]:
        path = prefix + f["name"]
        where = f"column {path!r}"
        g = by_name.get(f["name"])
        if g is None:
            return f"{where} is not in the stream's schema (added or renamed)"
        if _physical(f, mode) != _physical(g, mode) or (
            mode == "id" and _field_id(f) != _field_id(g)
        ):
            return f"{where} now maps to other data (a column was dropped or renamed)"
        if f.get("nullable", True) and not g.get("nullable", True):
            return f"{where} became nullable"
        change = _type_change(f["type"], g["type"], mode, path)
        if change:
            return change
    return None


# --- reading a data file into the stream's Arrow schema ----------------------------------


def _source_fields(arrow_fields, mode: str):
    """Index the file's fields by what the mapping mode resolves columns with."""
    out: dict[Any, int] = {}
    for i, f in enumerate(arrow_fields):
        if mode == "id":
            raw = (f.metadata or {}).get(_FIELD_ID)
            if raw is not None:
                out[int(raw)] = i
        else:
            out[f.name] = i
    return out


def _lookup(index: Mapping[Any, int], field: Mapping[str, Any], mode: str) -> int | None:
    if mode == "id":
        fid = _field_id(field)
        return None if fid is None else index.get(fid)
    return index.get(_physical(field, mode))


def _conform(arr, target, delta_type: Any, mode: str, where: str):
    """An Arrow array read from a file -> the stream's Arrow type, resolving nested fields."""
    import pyarrow as pa

    if pa.types.is_struct(target):
        if not pa.types.is_struct(arr.type):
            raise SourceError(f"txn-delta source: {where} is {arr.type} in the file, not a struct")
        children = arr.flatten()
        index = _source_fields(list(arr.type), mode)
        by_name = {f["name"]: f for f in delta_type["fields"]}
        cols = []
        for field in target:
            df = by_name.get(field.name)
            if df is None:
                raise SourceError(f"txn-delta source: {where}.{field.name} is not in the table")
            i = _lookup(index, df, mode)
            if i is None:
                cols.append(pa.nulls(len(arr), field.type))
            else:
                cols.append(
                    _conform(children[i], field.type, df["type"], mode, where + "." + field.name)
                )
        return pa.StructArray.from_arrays(
            cols, fields=list(target), mask=arr.is_null() if arr.null_count else None
        )
    if pa.types.is_list(target) or pa.types.is_large_list(target):
        if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)):
            raise SourceError(f"txn-delta source: {where} is {arr.type} in the file, not a list")
        values = _conform(
            arr.values, target.value_type, delta_type["elementType"], mode, where + ".element"
        )
        cls = pa.LargeListArray if pa.types.is_large_list(target) else pa.ListArray
        offsets = arr.offsets.cast(pa.int64() if cls is pa.LargeListArray else pa.int32())
        return cls.from_arrays(
            offsets, values, type=target, mask=arr.is_null() if arr.null_count else None
        )
    if pa.types.is_map(target):
        if not pa.types.is_map(arr.type):
            raise SourceError(f"txn-delta source: {where} is {arr.type} in the file, not a map")
        keys = _conform(arr.keys, target.key_type, delta_type["keyType"], mode, where + ".key")
        items = _conform(
            arr.items, target.item_type, delta_type["valueType"], mode, where + ".value"
        )
        return pa.MapArray.from_arrays(
            arr.offsets, keys, items, type=target, mask=arr.is_null() if arr.null_count else None
        )
    if arr.type == target:
        return arr
    try:
        return arr.cast(target, safe=not pa.types.is_timestamp(target))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise SourceError(
            f"txn-delta source: {where} is {arr.type} in the file and cannot be read as {target}: {e}"
        ) from e


def _partition_column(value: Any, target, n: int, where: str):
    import pyarrow as pa

    try:
        # repr too: values that compare equal can differ (0.0 and -0.0, 1 and True)
        return _constant_column(value, target, n, repr(value))
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as e:
        raise SourceError(
            f"txn-delta source: partition value {value!r} of {where} does not fit {target}: {e}"
        ) from e


@functools.lru_cache(maxsize=16)
def _constant_column(value: Any, target, n: int, _spelled: str):
    """``n`` times ``value`` as an Arrow array of type ``target``. Cached: every batch of
    a file, and every file of a version in the change feed, repeats the same few
    columns (Arrow arrays are immutable, so one can serve them all)."""
    import pyarrow as pa

    if value is None:
        return pa.nulls(n, target)
    return pa.repeat(pa.scalar(value, type=target), n)
