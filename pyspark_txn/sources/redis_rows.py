"""``txn-redis``'s messages to rows: the payload formats (raw, binary, json) and bad messages
(a function of the entry alone, so a replay yields the same row)."""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import json
from collections.abc import Callable, Mapping, Sequence
from itertools import chain
from typing import Any

from ..errors import ConfigError, SourceError

FORMAT = "txn-redis"


class BadMessageError(SourceError):
    """A claimed message that cannot become a row: ``reason`` says why, without its id."""

    def __init__(self, message_id: str, reason: str) -> None:
        super().__init__(f"{FORMAT}: message {message_id}: {reason}")
        self.message_id = message_id
        self.reason = reason

    def __reduce__(self) -> Any:
        return (type(self), (self.message_id, self.reason))


def fields_dict(fields: Any) -> dict[bytes, bytes]:
    """An entry's fields as Redis sent them (``[name, value, ...]``) as a dict; a name
    given twice keeps its last value, as redis-py's parsing did."""
    if isinstance(fields, dict):
        return fields
    it = iter(fields)
    return dict(zip(it, it, strict=True))


def _shown(raw: bytes) -> str:
    """Bytes that are not UTF-8 text, for messages."""
    return repr(raw[:40]) + ("..." if len(raw) > 40 else "")


def _not_text(raw: Mapping[bytes, bytes], values: bool) -> str | None:
    """Why the entry's field names (and ``values``) are not all UTF-8 text; None if they are."""
    for name, value in raw.items():
        try:
            text = name.decode()
        except UnicodeDecodeError as e:
            return f"a field name is not UTF-8 text: {_shown(name)} ({e})"
        if values:
            try:
                value.decode()
            except UnicodeDecodeError as e:
                return f"field {text!r} is not UTF-8 text ({e})"
    return None


def _same_names(flats: Sequence[Any], pairs: Any, keys: Any) -> bool:
    """Whether every entry has the first one's field names, in its order, none twice (the
    usual stream: one producer's fields), checked on the Arrow array at once."""
    import pyarrow as pa

    first = list(flats[0][0::2]) if len(flats) else []
    return (
        len(first) > 0
        and bool((pairs == len(first)).all())
        and len(set(first)) == len(first)
        and keys.equals(pa.array(first * len(flats), pa.binary()))
    )


def _fields_map(fields: Sequence[Any], map_type: Any) -> tuple[Any, dict[int, str]]:
    """The ``fields`` column (``map<string,string>``, or ``map<string,binary>`` whose values
    stay bytes) and the bad messages: entries with a name (or, for strings, a value) that
    is not UTF-8, null in the column. Built from the entries' flat ``[name, value, ...]``
    lists as one Arrow array, names and values taken from it by position: Arrow checks
    the UTF-8 of all of them at once, and no Python work is done per field."""
    import pyarrow as pa

    text = pa.types.is_string(map_type.item_type)

    def build(skip: Mapping[int, str]) -> Any:
        import numpy as np

        flats = [[] if k in skip else f for k, f in enumerate(fields)] if skip else fields
        if any(isinstance(f, dict) for f in flats):  # parsed by redis-py (XAUTOCLAIM)
            flats = [[x for kv in f.items() for x in kv] if isinstance(f, dict) else f
                     for f in flats]  # fmt: skip
        pairs = np.fromiter(map(len, flats), np.int64, len(flats)) // 2
        flat = pa.array(list(chain.from_iterable(flats)), pa.binary())
        keys = flat.take(np.arange(0, len(flat), 2))
        items = flat.take(np.arange(1, len(flat), 2))
        # (an entry of one pair cannot repeat a name; one left out counts no pair)
        if (pairs > 1).any() and not _same_names(flats, pairs, keys):
            # a name given twice in an entry keeps its last value: that entry by entry
            owner = np.repeat(np.arange(len(flats)), pairs)
            distinct = pa.table({"e": owner, "k": keys}).group_by(["e", "k"]).aggregate([])
            if distinct.num_rows < len(keys):
                return build_by_entry(skip)
        return pa.MapArray.from_arrays(
            pa.array(np.concatenate([[0], np.cumsum(pairs)]), pa.int32()),
            keys.cast(pa.string()),
            items.cast(pa.string()) if text else items,
            type=map_type,
            mask=pa.array([k in skip for k in range(len(fields))]) if skip else None,
        )

    def build_by_entry(skip: Mapping[int, str]) -> Any:
        offsets: list[int] = [0]
        keys: list[bytes] = []
        values: list[bytes] = []
        for k, f in enumerate(fields):
            if k not in skip:
                raw = fields_dict(f)
                keys.extend(raw.keys())
                values.extend(raw.values())
            offsets.append(len(keys))
        items = pa.array(values, pa.binary())
        return pa.MapArray.from_arrays(
            pa.array(offsets, pa.int32()),
            pa.array(keys, pa.binary()).cast(pa.string()),
            items.cast(pa.string()) if text else items,
            type=map_type,
            mask=pa.array([k in skip for k in range(len(fields))]) if skip else None,
        )

    try:
        return build({}), {}
    except pa.ArrowInvalid:
        pass  # some message is not UTF-8: find which, and leave them out
    bad = {}
    for k, f in enumerate(fields):
        why = _not_text(fields_dict(f), text)
        if why is not None:
            bad[k] = why
    return build(bad), bad


def _json_document(message_id: str, raw: Mapping[bytes, bytes], name: str) -> Any:
    """The JSON object in field ``name`` of an entry; only that field has to be UTF-8."""
    value = raw.get(name.encode())
    if value is None:
        shown = sorted(k.decode(errors="backslashreplace") for k in raw)[:10]
        raise BadMessageError(
            message_id, f"no field {name!r} (jsonField) to parse; its fields: {shown}"
        )
    try:
        text = value.decode()
    except UnicodeDecodeError as e:
        raise BadMessageError(message_id, f"field {name!r} is not UTF-8 text ({e})") from None
    try:
        doc = json.loads(text, parse_float=decimal.Decimal)  # decimals stay exact
    except ValueError as e:
        raise BadMessageError(message_id, f"field {name!r} is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise BadMessageError(
            message_id,
            f"field {name!r} holds a JSON {type(doc).__name__}, expected an object",
        )
    return doc


def _json_columns(rows: list, payload: list, bad: dict[int, str]) -> list[Any]:
    """The payload columns of converted rows (None: a bad message, null everywhere).

    A value Arrow refuses (a decimal with more digits than its column has) is found
    message by message and makes that message a bad one in ``bad``, in place.
    """
    import pyarrow as pa

    errors = (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError)
    while True:
        try:
            return [
                pa.array([None if r is None else r[j] for r in rows], type=f.type)
                for j, f in enumerate(payload)
            ]
        except errors as e:
            failed = e
        found = False
        for j, f in enumerate(payload):
            for k, row in enumerate(rows):
                if row is None:
                    continue
                try:
                    pa.array([row[j]], type=f.type)
                except errors as e:
                    bad[k] = f"{f.name} ({f.type}): {e}"
                    rows[k] = None
                    found = True
        if not found:  # no single value fails: not a message's fault
            raise SourceError(f"{FORMAT}: building the payload columns: {failed}") from failed


def _bad_message_column(fields: Sequence[Any], bad: Mapping[int, str], bad_type: Any) -> Any:
    """badMessageColumn: null for rows that were read, else why not and the entry's fields
    as they are in Redis (bytes: whatever the producer wrote survives)."""
    import pyarrow as pa

    if not bad:
        return pa.nulls(len(fields), bad_type)
    values: list[dict[str, Any] | None] = [None] * len(fields)
    for k, why in bad.items():
        values[k] = {"error": why, "fields": list(fields_dict(fields[k]).items())}
    return pa.array(values, type=bad_type)


# --- JSON values to Arrow values, by the declared type ---------------------------------------


class _BadValue(Exception):
    pass


def _show(v: Any) -> str:
    """A JSON value as its text, for messages (numbers are parsed as exact decimals)."""
    return json.dumps(v, default=str)[:60]


def _converter(t, where: str) -> Callable[[Any], Any]:
    """A function from a JSON value to what ``pa.array(..., type=t)`` accepts; strict."""
    import pyarrow as pa

    def need(kinds: tuple[type, ...], what: str) -> Callable[[Any], Any]:
        def conv(v: Any) -> Any:
            if v is None:
                return None
            if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
                raise _BadValue(f"{where}: expected {what}, got {_show(v)}")
            return v

        return conv

    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return lambda v: v if v is None or isinstance(v, str) else json.dumps(v, default=float)
    if pa.types.is_boolean(t):
        return need((bool,), "true or false")
    if pa.types.is_integer(t):
        integer = need((int,), "an integer")
        low, high = -(2 ** (t.bit_width - 1)), 2 ** (t.bit_width - 1)  # Spark's are signed

        def bounded(v: Any) -> Any:
            if integer(v) is not None and not low <= v < high:
                raise _BadValue(f"{where}: {v} is out of range for {t}")
            return v

        return bounded
    if pa.types.is_floating(t):
        number = need((int, float, decimal.Decimal), "a number")
        return lambda v: None if v is None else float(number(v))
    if pa.types.is_decimal(t):

        def dec(v: Any) -> Any:
            if v is None:
                return None
            if isinstance(v, bool) or not isinstance(v, (int, float, str, decimal.Decimal)):
                raise _BadValue(f"{where}: expected a decimal number, got {_show(v)}")
            try:
                return decimal.Decimal(str(v))
            except decimal.InvalidOperation:
                raise _BadValue(f"{where}: {v!r} is not a decimal number") from None

        return dec
    if pa.types.is_date(t):

        def date(v: Any) -> Any:
            if v is None:
                return None
            try:
                return dt.date.fromisoformat(v)
            except (TypeError, ValueError):
                raise _BadValue(f"{where}: expected an ISO date, got {_show(v)}") from None

        return date
    if pa.types.is_timestamp(t):
        aware = t.tz is not None

        def ts(v: Any) -> Any:
            if v is None:
                return None
            try:
                d = dt.datetime.fromisoformat(v[:-1] + "+00:00" if v.endswith("Z") else v)
            except (TypeError, ValueError, AttributeError):
                raise _BadValue(f"{where}: expected an ISO timestamp, got {_show(v)}") from None
            if aware and d.tzinfo is None:
                return d.replace(tzinfo=dt.timezone.utc)  # Spark's Arrow path is UTC
            if not aware and d.tzinfo is not None:
                return d.astimezone(dt.timezone.utc).replace(tzinfo=None)
            return d

        return ts
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):

        def b64(v: Any) -> Any:
            if v is None:
                return None
            try:
                return base64.b64decode(v, validate=True)
            except (TypeError, ValueError):
                raise _BadValue(f"{where}: expected base64 text, got {_show(v)}") from None

        return b64
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        item = _converter(t.value_type, f"{where}[]")

        def lst(v: Any) -> Any:
            if v is None:
                return None
            if not isinstance(v, list):
                raise _BadValue(f"{where}: expected an array, got {_show(v)}")
            return [item(x) for x in v]

        return lst
    if pa.types.is_map(t):
        if not pa.types.is_string(t.key_type):
            raise ConfigError(
                f"{FORMAT}: column {where} is a map with {t.key_type} keys; JSON object keys "
                "are strings: use map<string,...>"
            )
        value = _converter(t.item_type, f"{where}{{}}")

        def mp(v: Any) -> Any:
            if v is None:
                return None
            if not isinstance(v, dict):
                raise _BadValue(f"{where}: expected an object, got {_show(v)}")
            return [(k, value(x)) for k, x in v.items()]

        return mp
    if pa.types.is_struct(t):
        fields = [
            (
                t.field(i).name,
                t.field(i).nullable,
                _converter(t.field(i).type, f"{where}.{t.field(i).name}"),
            )
            for i in range(t.num_fields)
        ]

        def struct(v: Any) -> Any:
            if v is None:
                return None
            if not isinstance(v, dict):
                raise _BadValue(f"{where}: expected an object, got {_show(v)}")
            out = {name: conv(v.get(name)) for name, _, conv in fields}
            for name, nullable, _ in fields:
                if out[name] is None and not nullable:  # the JVM would fail on it instead
                    raise _BadValue(f"{where}.{name} is declared NOT NULL, but has no value")
            return out

        return struct
    raise ConfigError(
        f"{FORMAT}: column {where} has type {t}, which payloadFormat=json cannot fill"
    )


def _row_converter(payload, required: Sequence[str] = ()) -> Callable[[str, dict], list[Any]]:
    """JSON object -> row values; a :class:`BadMessageError` for a value of another type or
    a missing one in a NOT NULL column (``required``: NOT NULL in ``schema``, nullable in
    the reported schema)."""
    must = {name.lower() for name in required}
    convs = [
        (f.name, f.nullable and f.name.lower() not in must, _converter(f.type, f.name))
        for f in payload
    ]

    def convert(message_id: str, doc: dict) -> list[Any]:
        try:
            row = [conv(doc.get(name)) for name, _, conv in convs]
        except _BadValue as e:
            raise BadMessageError(message_id, str(e)) from None
        for (name, nullable, _), value in zip(convs, row, strict=True):
            if value is None and not nullable:  # Arrow would fail deep in the JVM instead
                raise BadMessageError(
                    message_id,
                    f"{name} is declared NOT NULL in option schema, but the message has no "
                    "value for it",
                )
        return row

    return convert
