"""Delta statistics for a staged parquet file (``add.stats``), from its footer, as delta-rs's
own writer makes them."""

from __future__ import annotations

import json
from datetime import date
from typing import Any

# --- Delta statistics -------------------------------------------------------------
# ``add.stats`` as delta-rs's own writer makes it (the reference this is tested
# against, tests/contract/test_stats.py), computed from the parquet footer: for every
# leaf column outside lists and maps, min/max combined over the row groups and the
# null count, nested in objects for struct fields. A bound that cannot be given exactly
# or safely is left out; the JSON is strict (no NaN or Infinity tokens).

# delta-rs keeps string bounds to 64 UTF-8 bytes (arrow-rs's parquet statistics truncation)
_STRING_STAT_BYTES = 64
# Years 1 to 9999: 0001-01-01 and 9999-12-31 in days, and in milliseconds, since the epoch
_DAYS = (-719_162, 2_932_896)
_MILLIS = (-62_135_596_800_000, 253_402_300_799_999)
_PER_MILLI = {"milliseconds": 1, "microseconds": 1_000, "nanoseconds": 1_000_000}
_OMIT = object()  # a bound with no representation in a Delta stats value


class _Number(str):
    """A JSON number written exactly as given (decimals: a float would round them)."""


def _stat_leaves(schema) -> list[tuple[tuple[str, ...], Any, bool]]:
    """(field path, arrow type, inside a list or map) of each parquet leaf column, in order."""
    import pyarrow as pa

    leaves: list[tuple[tuple[str, ...], Any, bool]] = []

    def walk(path: tuple[str, ...], t, repeated: bool) -> None:
        while isinstance(t, pa.ExtensionType):
            t = t.storage_type
        if pa.types.is_dictionary(t):
            walk(path, t.value_type, repeated)
        elif pa.types.is_struct(t):
            for i in range(t.num_fields):
                walk(path + (t.field(i).name,), t.field(i).type, repeated)
        elif pa.types.is_map(t):
            walk(path + ("key",), t.key_type, True)
            walk(path + ("value",), t.item_type, True)
        elif (
            pa.types.is_list(t)
            or pa.types.is_large_list(t)
            or pa.types.is_fixed_size_list(t)
            or pa.types.is_list_view(t)
            or pa.types.is_large_list_view(t)
        ):
            walk(path + ("element",), t.value_type, True)
        else:
            leaves.append((path, t, repeated))

    for f in schema:
        walk((f.name,), f.type, False)
    return leaves


def _stat_kind(t, column) -> tuple | None:
    """How to read one leaf's footer min/max: (kind, detail), or None for no min/max."""
    import pyarrow as pa

    physical = column.physical_type
    try:
        logical = json.loads(column.logical_type.to_json())
    except Exception:
        logical = {}
    ltype = logical.get("Type")
    if pa.types.is_boolean(t) and physical == "BOOLEAN":
        return ("bool", None)
    if pa.types.is_signed_integer(t) and physical in ("INT32", "INT64"):
        return ("int", None)
    if (pa.types.is_float32(t) or pa.types.is_float64(t)) and physical in ("FLOAT", "DOUBLE"):
        return ("float", None)
    if pa.types.is_decimal(t) and ltype == "Decimal":
        return ("decimal", int(logical["scale"]))
    if (
        pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)
    ) and physical == "BYTE_ARRAY":
        return ("string", None)
    if (pa.types.is_date32(t) or pa.types.is_date64(t)) and ltype == "Date" and physical == "INT32":
        return ("date", None)
    if pa.types.is_timestamp(t) and ltype == "Timestamp" and physical == "INT64":
        per_milli = _PER_MILLI.get(logical.get("timeUnit"))
        if per_milli is not None:
            return ("timestamp", (per_milli, t.tz is not None))
    # Binary (delta-rs writes no bounds), unsigned integers and half floats (no Delta
    # type), INT96 timestamps, times, intervals: no min/max rather than a doubtful one.
    return None


def _utf8_len(code: int) -> int:
    return 1 if code < 0x80 else 2 if code < 0x800 else 3 if code < 0x10000 else 4


def _string_min(b: bytes) -> bytes:
    """The longest prefix of at most 64 bytes that ends on a character: still <= ``b``."""
    if len(b) <= _STRING_STAT_BYTES:
        return b
    cut = _STRING_STAT_BYTES
    while cut and (b[cut] & 0xC0) == 0x80:  # b[cut] continues a character: not a boundary
        cut -= 1
    return b[:cut] if cut else b


def _string_max(b: bytes) -> bytes:
    """At most 64 bytes that are still >= ``b`` and anything ``b`` is the max of.

    As arrow-rs: cut as :func:`_string_min`, then raise the last character that has a
    successor of the same UTF-8 length and drop what follows it; if none has, keep
    ``b`` whole. A string above the cut prefix's raised form is above ``b``, so the
    bound holds for every value <= ``b``.
    """
    if len(b) <= _STRING_STAT_BYTES:
        return b
    s = _string_min(b).decode("utf-8")
    for i in range(len(s) - 1, -1, -1):
        code = ord(s[i]) + 1
        if 0xD800 <= code <= 0xDFFF or code > 0x10FFFF:
            continue
        if _utf8_len(code) == _utf8_len(code - 1):
            return (s[:i] + chr(code)).encode("utf-8")
    return b


def _stat_value(kind: tuple, raw: Any, is_max: bool) -> Any:
    """A footer min/max (physical value) as a comparable key; None when unusable."""
    import math

    name, detail = kind
    if name == "bool":
        return bool(raw)
    if name == "float":
        v = float(raw)
        return None if math.isnan(v) else v
    if name == "decimal":
        if isinstance(raw, (bytes, bytearray)):  # big-endian two's complement
            return int.from_bytes(raw, "big", signed=True) if raw else None
        return int(raw)
    if name == "string":
        b = bytes(raw)
        try:
            b.decode("utf-8")
        except UnicodeDecodeError:
            return None
        return _string_max(b) if is_max else _string_min(b)
    return int(raw)  # int, date (days), timestamp (footer unit)


def _stat_json(kind: tuple, key: Any, is_max: bool) -> Any:
    """The Delta stats value of a combined key, or _OMIT."""
    import math
    from datetime import datetime, timedelta

    name, detail = kind
    if name == "float":
        if not math.isfinite(key):
            return None  # as delta-rs writes ±Infinity bounds: null, i.e. unknown
        if key == 0:  # the parquet rule: a zero min is -0.0, a zero max +0.0
            return 0.0 if is_max else -0.0
        return key
    if name == "decimal":
        scale = detail
        if scale <= 0:
            return _Number(str(key * 10**-scale))
        digits = str(abs(key)).rjust(scale + 1, "0")
        return _Number(f"{'-' if key < 0 else ''}{digits[:-scale]}.{digits[-scale:]}")
    if name == "string":
        return key.decode("utf-8")
    if name == "date":
        if not _DAYS[0] <= key <= _DAYS[1]:
            return _OMIT  # years beyond 1..9999 have no ISO-8601 form readers accept
        return date.fromordinal(key + 719_163).isoformat()
    if name == "timestamp":
        per_milli, utc = detail
        millis = key // per_milli  # the protocol truncates down to milliseconds
        if not _MILLIS[0] <= millis <= _MILLIS[1]:
            return _OMIT
        d = datetime(1970, 1, 1) + timedelta(milliseconds=millis)
        text = (
            f"{d.year:04d}-{d.month:02d}-{d.day:02d}{'T' if utc else ' '}"
            f"{d.hour:02d}:{d.minute:02d}:{d.second:02d}"
        )
        if d.microsecond:
            text += f".{d.microsecond // 1000:03d}"
        return text + "Z" if utc else text
    return key  # bool, int


def _leaf_stats(metadata, ci: int, kind: tuple | None) -> tuple[Any, Any, int | None]:
    """(min key, max key, null count) of leaf ``ci`` over all row groups; None = unknown."""
    nulls: int | None = 0
    lo = hi = None
    bounded = kind is not None
    for rg in range(metadata.num_row_groups):
        st = metadata.row_group(rg).column(ci).statistics
        if st is None:  # unknown for one row group: unknown for the file
            return None, None, None
        nulls = nulls + st.null_count if nulls is not None and st.has_null_count else None
        if not bounded or kind is None:
            continue
        if not st.has_min_max:
            # All null, or all NaN (NaN never counts in parquet bounds): nothing to add.
            # Values without bounds (e.g. strings too long for pyarrow's footer): unknown.
            if st.num_values and kind[0] != "float":
                bounded = False
            continue
        a = _stat_value(kind, st.min_raw, False)
        b = _stat_value(kind, st.max_raw, True)
        if a is None or b is None:
            bounded = False
            continue
        lo = a if lo is None else min(lo, a)
        hi = b if hi is None else max(hi, b)
    if not bounded:
        lo = hi = None
    return lo, hi, nulls


def _is_binary(t) -> bool:
    """Delta's binary: no min/max anywhere, so none missing either."""
    import pyarrow as pa

    return (
        pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_fixed_size_binary(t)
        or pa.types.is_binary_view(t)
    )


def _put(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for name in path[:-1]:
        tree = tree.setdefault(name, {})
    tree[path[-1]] = value


def _stats_json(value: Any) -> str:
    """Strict JSON; text as raw UTF-8, as delta-rs writes it (its reader decodes the
    escape of a character above U+FFFFF wrongly)."""
    if isinstance(value, dict):
        items = (f"{_stats_json(k)}:{_stats_json(v)}" for k, v in value.items())
        return "{" + ",".join(items) + "}"
    if isinstance(value, _Number):
        return str(value)
    return json.dumps(value, allow_nan=False, ensure_ascii=False)


def delta_stats(metadata, schema) -> str:
    """Delta ``stats`` JSON from a parquet footer: numRecords, nullCount, safe min/max.

    ``schema`` is the file's arrow schema (partition columns excluded). Struct fields
    nest (``{"s": {"a": 0}}``); columns inside lists and maps get nothing, as with
    delta-rs. A footer whose columns do not match the schema gets only numRecords.

    A top-level column that has values but lacks a bound (±Infinity, all NaN, a date
    beyond year 9999, a string pyarrow kept no bounds for...) costs the whole file its
    min/max: delta-rs's pyarrow datasets (``DeltaTable.to_pyarrow_table(filters=...)``,
    ``to_pyarrow_dataset``) read a missing bound as ``col >= null`` and drop the file
    from every filter on that column. Null counts stay.
    """
    mins: dict[str, Any] = {}
    maxs: dict[str, Any] = {}
    nulls: dict[str, Any] = {}
    leaves = _stat_leaves(schema)
    unbounded = len(leaves) != metadata.num_columns
    if unbounded:
        leaves = []
    for ci, (path, t, repeated) in enumerate(leaves):
        column = metadata.schema.column(ci)
        if repeated or column.max_repetition_level or column.path != ".".join(path):
            continue
        kind = _stat_kind(t, column)
        lo, hi, n = _leaf_stats(metadata, ci, kind)
        if n is not None:
            _put(nulls, path, n)
        bounds = 0
        if lo is not None and kind is not None:
            for tree, key, is_max in ((mins, lo, False), (maxs, hi, True)):
                value = _stat_json(kind, key, is_max)
                if value is not _OMIT:
                    _put(tree, path, value)
                    bounds += value is not None
        if len(path) == 1 and bounds < 2 and n != metadata.num_rows and not _is_binary(t):
            unbounded = True
    stats: dict[str, Any] = {"numRecords": metadata.num_rows}
    if not unbounded:
        stats.update(minValues=mins, maxValues=maxs)
    stats["nullCount"] = nulls
    return _stats_json(stats)
