"""Partition values of the Delta log, typed: the strings of ``partitionValues`` (and
the spellings Spark and others use for them) as Python values of the column's type."""

from __future__ import annotations

import re
from typing import Any

from ..errors import SourceError

INTEGRAL_TYPES = ("byte", "short", "integer", "long")
DECIMAL_TYPE = re.compile(r"decimal\((\d+),\s*(-?\d+)\)")


def type_name(t: Any) -> str:
    """A Delta schema type's name (primitive types are strings, others objects)."""
    return t if isinstance(t, str) else t.get("type", "?")


_TS = re.compile(
    r"(\d{4,})-(\d{1,2})-(\d{1,2})[ T](\d{1,2}):(\d{1,2}):(\d{1,2})(?:\.(\d{1,9}))?"
    r"\s*(Z|[+-]\d{2}:?\d{2}|UTC)?"
)
_DATE = re.compile(r"(\d{4,})-(\d{1,2})-(\d{1,2})")


def parse_partition_value(raw: str | None, delta_type: Any) -> Any:
    """A partition value as the log stores it (a string) -> the column's Python value."""
    import datetime as dt
    from decimal import Decimal

    if raw is None or raw == "":  # PROTOCOL.md: an empty string for any type is null
        return None
    t = delta_type
    try:
        if t == "string":
            return raw
        if t in INTEGRAL_TYPES:
            return int(raw)
        if t in ("float", "double"):
            return float(raw)  # also NaN, Infinity, -Infinity, inf
        if t == "boolean":
            if raw.lower() not in ("true", "false"):
                raise ValueError("expected true or false")
            return raw.lower() == "true"
        if t == "date":
            m = _DATE.fullmatch(raw.strip())
            if not m:
                raise ValueError("expected {year}-{month}-{day}")
            return dt.date(int(m[1]), int(m[2]), int(m[3]))
        if t in ("timestamp", "timestamp_ntz"):
            m = _TS.fullmatch(raw.strip())
            if not m:
                raise ValueError("expected {year}-{month}-{day} {hour}:{minute}:{second}[.micros]")
            micros = int(((m[7] or "") + "000000")[:6])
            value = dt.datetime(
                int(m[1]), int(m[2]), int(m[3]), int(m[4]), int(m[5]), int(m[6]), micros
            )
            zone = m[8]
            if zone and zone not in ("Z", "UTC"):
                sign = -1 if zone[0] == "-" else 1
                digits = zone[1:].replace(":", "")
                offset = dt.timedelta(hours=int(digits[:2]), minutes=int(digits[2:]))
                value = value - sign * offset
            if t == "timestamp_ntz":
                return value
            # no zone: the writer's zone, unknowable; read as UTC (as delta-rs does)
            return value.replace(tzinfo=dt.timezone.utc)
        if isinstance(t, str) and DECIMAL_TYPE.fullmatch(t):
            return Decimal(raw)
        if t == "binary":
            return raw.encode("utf-8")
    except (ValueError, ArithmeticError) as e:
        raise SourceError(
            f"txn-delta source: partition value {raw!r} is not a valid {t}: {e}"
        ) from None
    raise SourceError(f"txn-delta source: partition columns of type {type_name(t)} are unsupported")
