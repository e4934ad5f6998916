"""PostgreSQL's binary COPY format built from Arrow buffers with numpy, without a
Python object per value.

Covers the column types most streams carry (integers, floats, booleans, dates,
timestamps, text, bytea) when the table column has the matching type; anything
else (numeric, arrays, jsonb, narrowing casts) goes through psycopg's
``write_row``. Rows without nulls and without variable-width columns are one
packed numpy record each (a byte-swapping copy); otherwise every field is
scattered to its offset.

Format: a signature, then per row an int16 field count and per field an int32
length (-1 for NULL) and the value in network byte order; an int16 -1 ends it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

SIGNATURE = b"PGCOPY\n\xff\r\n\x00" + b"\x00\x00\x00\x00" + b"\x00\x00\x00\x00"
TRAILER = b"\xff\xff"
_PG_EPOCH_DAYS = 10_957  # 2000-01-01 - 1970-01-01
_PG_EPOCH_US = 946_684_800_000_000

# oids (see postgres_target)
_INT2, _INT4, _INT8, _FLOAT4, _FLOAT8, _BOOL, _DATE = 21, 23, 20, 700, 701, 16, 1082
_TIMESTAMP, _TIMESTAMPTZ, _TEXT, _VARCHAR, _BPCHAR, _BYTEA = 1114, 1184, 25, 1043, 1042, 17

# kind -> (big-endian numpy type, width); None for variable width
_FIXED = {
    "i2": (">i2", 2),
    "i4": (">i4", 4),
    "i8": (">i8", 8),
    "f4": (">f4", 4),
    "f8": (">f8", 8),
    "bool": ("u1", 1),
    "date": (">i4", 4),
    "ts": (">i8", 8),
}


def fast_kind(t, oid: int) -> str | None:
    """How the fast path encodes Arrow type ``t`` into a column of type ``oid``, or None."""
    import pyarrow as pa

    if oid == _INT2 and (pa.types.is_int8(t) or pa.types.is_int16(t)):
        return "i2"
    if oid == _INT4 and pa.types.is_int32(t):
        return "i4"
    if oid == _INT8 and pa.types.is_int64(t):
        return "i8"
    if oid == _FLOAT4 and pa.types.is_float32(t):
        return "f4"
    if oid == _FLOAT8 and pa.types.is_float64(t):
        return "f8"
    if oid == _BOOL and pa.types.is_boolean(t):
        return "bool"
    if oid == _DATE and pa.types.is_date32(t):
        return "date"
    if pa.types.is_timestamp(t) and t.unit == "us":
        if (oid == _TIMESTAMPTZ and t.tz) or (oid == _TIMESTAMP and not t.tz):
            return "ts"
    if oid in (_TEXT, _VARCHAR, _BPCHAR) and pa.types.is_string(t):
        return "str"
    if oid == _BYTEA and pa.types.is_binary(t):
        return "str"
    return None


def _fixed_values(arr, kind: str) -> np.ndarray:
    """The column's values (nulls as 0) as a big-endian numpy array."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if arr.null_count:
        arr = arr.fill_null(False if kind == "bool" else 0)
    if kind == "bool":
        return np.asarray(arr.to_numpy(zero_copy_only=False), dtype="u1")
    if kind == "date":
        days = arr.cast(pa.int32()).to_numpy()
        return (days - _PG_EPOCH_DAYS).astype(">i4")
    if kind == "ts":
        us = pc.cast(arr, pa.int64()).to_numpy()
        return (us - _PG_EPOCH_US).astype(">i8")
    return arr.to_numpy().astype(_FIXED[kind][0])


def encode(batch, kinds: Sequence[str]) -> bytes:
    """One Arrow batch as binary COPY rows (no signature, no trailer)."""
    n = batch.num_rows
    cols = [batch.column(i) for i in range(batch.num_columns)]
    if all(k in _FIXED for k in kinds) and not any(c.null_count for c in cols):
        return _encode_packed(cols, kinds, n)
    return _encode_scattered(cols, kinds, n)


def _encode_packed(cols, kinds: Sequence[str], n: int) -> bytes:
    fields: list[tuple[str, str]] = [("n", ">i2")]
    for i, k in enumerate(kinds):
        fields += [(f"l{i}", ">i4"), (f"v{i}", _FIXED[k][0])]
    rec = np.empty(n, dtype=np.dtype(fields))  # packed: numpy adds no padding here
    rec["n"] = len(kinds)
    for i, (c, k) in enumerate(zip(cols, kinds, strict=True)):
        rec[f"l{i}"] = _FIXED[k][1]
        rec[f"v{i}"] = _fixed_values(c, k)
    return rec.tobytes()


def _var_parts(arr):
    """(offsets[n+1], data) of a string or binary array, sliced as the array is."""
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int32)[
        arr.offset : arr.offset + len(arr) + 1
    ]
    data_buf = arr.buffers()[2]
    data = (
        np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.empty(0, np.uint8)
    )
    return offsets.astype(np.int64), data


def _encode_scattered(cols, kinds: Sequence[str], n: int) -> bytes:
    valids: list[Any] = []
    widths: list[Any] = []
    payloads: list[Any] = []
    sizes = np.full(n, 2, dtype=np.int64)
    for c, k in zip(cols, kinds, strict=True):
        valid = (
            np.ones(n, dtype=bool)
            if not c.null_count
            else ~np.asarray(c.is_null().to_numpy(zero_copy_only=False))
        )
        if k in _FIXED:
            w = _FIXED[k][1]
            width = np.where(valid, w, 0)
            payloads.append(_fixed_values(c, k).view(np.uint8).reshape(n, w))
        else:
            offsets, data = _var_parts(c)
            width = np.diff(offsets)
            width[~valid] = 0
            payloads.append((offsets, data))
        valids.append(valid)
        widths.append(width)
        sizes += 4 + width
    ends = np.cumsum(sizes)
    total = int(ends[-1]) if n else 0
    buf = np.empty(total, dtype=np.uint8)
    pos = ends - sizes
    count = np.array([len(kinds)], dtype=">i2").view(np.uint8)
    buf[pos[:, None] + np.arange(2)] = count
    pos = pos + 2
    for k, valid, width, payload in zip(kinds, valids, widths, payloads, strict=True):
        lens = np.where(valid, width, -1).astype(">i4").view(np.uint8).reshape(n, 4)
        buf[pos[:, None] + np.arange(4)] = lens
        pos = pos + 4
        if k in _FIXED:
            w = _FIXED[k][1]
            at = pos[valid]
            buf[at[:, None] + np.arange(w)] = payload[valid]
        else:
            offsets, data = payload
            lengths = width
            src_start = offsets[:-1]
            used = int(lengths.sum())
            if used:
                # every byte of row i goes from src_start[i] + j to pos[i] + j
                shift = np.repeat(pos - src_start, lengths)
                src = np.repeat(src_start, lengths) + (
                    np.arange(used) - np.repeat(np.cumsum(lengths) - lengths, lengths)
                )
                buf[src + shift] = data[src]
        pos = pos + width
    return buf.tobytes()
