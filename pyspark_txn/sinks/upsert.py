"""Upserts by key: the options (``keys``, ``sequenceBy``, ``deleteWhen``,
``exceptColumns``, ``scdType``, ``tombstoneRetention``) parsed once into an
:class:`UpsertSpec`, and the pure work on one batch's rows (pyarrow in, pyarrow out) that
phase 2 merges into the table: no IO here, so every rule is tested on plain tables.

The rules (docs/upserts.md):
- a batch holds change records; ``keys`` say which row of the table each one changes;
- with ``sequenceBy`` the greatest sequence per key wins, within a batch and against
  the table (a change not newer than the row it would replace is ignored), and a
  delete is remembered (a tombstone, for ``tombstoneRetention``) so an older change
  arriving later cannot bring the row back;
- without ``sequenceBy`` a batch may hold one change per key (two are refused, naming
  the key: their order is not defined), and a change always replaces the row;
- ``scdType=2`` keeps every version with ``__START_AT`` / ``__END_AT`` (the sequence
  values) instead of replacing rows; a delete ends the key's current version.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .predicate import Predicate, parse_predicate

#: The SCD type 2 validity columns (as APPLY CHANGES names them).
START_AT = "__START_AT"
END_AT = "__END_AT"
#: A merge source's own column: whether the change is a delete (never written).
DELETE_FLAG = "__pyspark_txn_delete"

UPSERT_OPTIONS = {
    "keys": "comma-separated key columns: each batch is merged into the table by them "
    "(upserts, CDC; docs/upserts.md)",
    "sequenceBy": "comma-separated columns ordering the changes of one key (compared in "
    "order): the greatest wins, in a batch and against the table",
    "deleteWhen": "SQL predicate that makes a change row a delete, e.g. op = 'D'",
    "exceptColumns": "comma-separated change-record columns not written to the table",
    "scdType": "1 (default: one row per key) or 2 (every version, with __START_AT and __END_AT)",
    "tombstoneRetention": "how long a delete is remembered against older changes that "
    "arrive later (with sequenceBy and deleteWhen; default '7 days')",
}

_DEFAULT_RETENTION_S = 7 * 24 * 3600
_UNITS = {
    "second": 1,
    "seconds": 1,
    "minute": 60,
    "minutes": 60,
    "hour": 3600,
    "hours": 3600,
    "day": 86400,
    "days": 86400,
    "week": 604800,
    "weeks": 604800,
}


def _columns(opts: Mapping[str, str], key: str, option: str) -> tuple[str, ...]:
    raw = opts.get(key)
    if raw is None:
        return ()
    cols = tuple(c.strip() for c in raw.split(",") if c.strip())
    if not cols:
        raise ConfigError(f"option {option} is empty: give comma-separated column names")
    if len(set(cols)) != len(cols):
        raise ConfigError(f"option {option}={raw!r} repeats a column")
    return cols


def _retention(raw: str) -> int:
    m = re.fullmatch(r"\s*(?:interval\s+)?(\d+)\s*([a-z]+)\s*", raw.lower())
    if m is None or m.group(2) not in _UNITS or int(m.group(1)) < 1:
        raise ConfigError(
            f"option tombstoneRetention={raw!r}: expected a positive duration such as "
            "'7 days', '12 hours' or '30 minutes'"
        )
    return int(m.group(1)) * _UNITS[m.group(2)]


@dataclass(frozen=True)
class UpsertSpec:
    """How a batch of change records is merged into the table. Plain data: pickled to
    executors, kept in every record (``target_meta``) so a restart can check it."""

    keys: tuple[str, ...]
    sequence_by: tuple[str, ...] = ()
    delete_when: str | None = None
    except_columns: tuple[str, ...] = ()
    scd_type: int = 1
    tombstone_retention_s: int = _DEFAULT_RETENTION_S

    @classmethod
    def parse(cls, opts: Mapping[str, str]) -> UpsertSpec | None:
        """From the sink's lower-cased options; None without ``keys`` (an append sink),
        where the other upsert options are refused by name."""
        keys = _columns(opts, "keys", "keys")
        if not keys:
            given = [name for name in UPSERT_OPTIONS if name != "keys" and name.lower() in opts]
            if given:
                raise ConfigError(
                    f"option {', '.join(given)} needs option keys (the columns each change "
                    "record is merged by, e.g. .option('keys', 'id'))"
                )
            return None
        sequence = _columns(opts, "sequenceby", "sequenceBy")
        delete_when = opts.get("deletewhen")
        if delete_when is not None:
            parse_predicate(delete_when)  # refused by position now, not at the first batch
            delete_when = delete_when.strip()
        scd = opts.get("scdtype", "1").strip()
        if scd not in ("1", "2"):
            raise ConfigError(f"option scdType={opts['scdtype']!r}: expected 1 or 2")
        if scd == "2" and len(sequence) != 1:
            raise ConfigError(
                "option scdType=2 needs option sequenceBy with exactly one column: its values "
                f"become {START_AT} and {END_AT} of each version"
            )
        retention = opts.get("tombstoneretention")
        if retention is not None and not (sequence and delete_when):
            raise ConfigError(
                "option tombstoneRetention applies only with sequenceBy and deleteWhen (only "
                "then are deletes remembered)"
            )
        spec = cls(
            keys=keys,
            sequence_by=sequence,
            delete_when=delete_when,
            except_columns=_columns(opts, "exceptcolumns", "exceptColumns"),
            scd_type=int(scd),
            tombstone_retention_s=_retention(retention) if retention else _DEFAULT_RETENTION_S,
        )
        spec._check_names()
        return spec

    def _check_names(self) -> None:
        overlap = set(self.keys) & set(self.sequence_by)
        if overlap:
            raise ConfigError(
                f"options keys and sequenceBy share {sorted(overlap)}: a key column cannot "
                "order the changes of its own key"
            )
        kept = [c for c in self.except_columns if c in self.keys]
        if kept:
            raise ConfigError(f"option exceptColumns names key columns {kept}: keys are written")
        if self.scd_type == 1:
            seq = [c for c in self.except_columns if c in self.sequence_by]
            if seq:
                raise ConfigError(
                    f"option exceptColumns names sequenceBy columns {seq}: with scdType=1 the "
                    "table keeps each row's sequence, to refuse older changes"
                )

    @property
    def predicate(self) -> Predicate | None:
        return parse_predicate(self.delete_when) if self.delete_when else None

    @property
    def keeps_tombstones(self) -> bool:
        """Deletes are remembered where a change older than one may arrive after it: with
        a sequence (SCD type 2 too: a delete that ends no version yet, because the
        change it deletes has not arrived, shows nowhere in the history)."""
        return bool(self.sequence_by) and self.delete_when is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "keys": list(self.keys),
            "sequence_by": list(self.sequence_by),
            "delete_when": self.delete_when,
            "except_columns": list(self.except_columns),
            "scd_type": self.scd_type,
            "tombstone_retention_s": self.tombstone_retention_s,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> UpsertSpec:
        return cls(
            keys=tuple(d["keys"]),
            sequence_by=tuple(d.get("sequence_by") or ()),
            delete_when=d.get("delete_when"),
            except_columns=tuple(d.get("except_columns") or ()),
            scd_type=int(d.get("scd_type") or 1),
            tombstone_retention_s=int(d.get("tombstone_retention_s") or _DEFAULT_RETENTION_S),
        )

    def describe(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)

    # --- the stream's schema ----------------------------------------------------------
    def check_schema(self, schema: Any, partition_by: Sequence[str] = ()) -> None:
        """Refuse, before any data is touched, options the stream's columns contradict."""
        import pyarrow as pa

        names = schema.names
        for option, cols in (
            ("keys", self.keys),
            ("sequenceBy", self.sequence_by),
            ("exceptColumns", self.except_columns),
        ):
            missing = [c for c in cols if c not in names]
            if missing:
                raise ConfigError(
                    f"option {option}: columns {missing} are not in the stream {names}"
                )
        for c in self.keys:
            t = schema.field(c).type
            if pa.types.is_nested(t) or pa.types.is_floating(t) or pa.types.is_map(t):
                raise ConfigError(
                    f"option keys: column {c!r} has type {t}; a key must be a string, "
                    "integer, decimal, date, timestamp, boolean or binary column"
                )
        for c in self.sequence_by:
            t = schema.field(c).type
            if not _orderable(t):
                raise ConfigError(
                    f"option sequenceBy: column {c!r} has type {t}, which has no order; "
                    "use a number, string, date or timestamp column"
                )
        written = [c for c in names if c not in self.except_columns]
        if [c for c in written if c not in self.keys] == [] and self.scd_type == 1:
            raise ConfigError(
                "options keys and exceptColumns leave no other column to write: nothing "
                "would ever be updated"
            )
        excluded_parts = [c for c in partition_by if c in self.except_columns]
        if excluded_parts:
            raise ConfigError(
                f"option partitionBy names {excluded_parts}, which exceptColumns leaves out "
                "of the table"
            )
        if self.scd_type == 2:
            for reserved in (START_AT, END_AT):
                if reserved in names:
                    raise ConfigError(
                        f"option scdType=2: the stream has a column {reserved!r}, which the "
                        "history's validity columns would overwrite"
                    )
        if DELETE_FLAG in names:
            raise ConfigError(f"the stream has a column {DELETE_FLAG!r}, which this sink uses")
        predicate = self.predicate
        if predicate is not None:
            predicate.check_schema(schema)

    def table_schema(self, stream_schema: Any) -> Any:
        """The table's columns: the stream's minus ``exceptColumns``, with the validity
        columns of SCD type 2."""
        import pyarrow as pa

        fields = [f for f in stream_schema if f.name not in self.except_columns]
        if self.scd_type == 2:
            seq = stream_schema.field(self.sequence_by[0]).type
            fields += [pa.field(START_AT, seq), pa.field(END_AT, seq)]
        return pa.schema(fields)


def _orderable(t: Any) -> bool:
    import pyarrow as pa

    return (
        pa.types.is_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_decimal(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_date(t)
        or pa.types.is_timestamp(t)
    )


# --- one batch's rows ------------------------------------------------------------------


class BatchRefused(ConfigError):
    """A batch whose change records cannot be merged as given (null keys, two changes of
    one key that nothing orders): refused before its record is written."""


def check_batch(rows: Any, spec: UpsertSpec) -> None:
    """Null keys or sequences, and two changes of one key the rules cannot order."""
    import pyarrow.compute as pc

    for option, cols in (("keys", spec.keys), ("sequenceBy", spec.sequence_by)):
        for c in cols:
            nulls = rows.column(c).null_count
            if nulls:
                raise BatchRefused(
                    f"option {option}: column {c!r} is null in {nulls} change record(s) of "
                    f"this batch; every change needs its {'key' if option == 'keys' else 'sequence'}"
                )
    by = list(spec.keys) + list(spec.sequence_by)
    if rows.num_rows < 2:
        return
    counts = rows.group_by(by).aggregate([([], "count_all")])
    twice = counts.filter(pc.greater(counts.column("count_all"), 1))
    if twice.num_rows:
        first = {c: twice.column(c)[0].as_py() for c in by}
        what = (
            "the same key and sequence"
            if spec.sequence_by
            else "the same key (without sequenceBy their order is not defined)"
        )
        raise BatchRefused(
            f"{twice.num_rows} change(s) of this batch share {what}, e.g. {first}; give "
            "sequenceBy columns that order them, or deduplicate the stream"
        )


def with_delete_flag(rows: Any, spec: UpsertSpec) -> Any:
    """``rows`` with :data:`DELETE_FLAG` (from ``deleteWhen``; false without it)."""
    import pyarrow as pa

    predicate = spec.predicate
    flag = predicate.mask(rows) if predicate is not None else pa.array([False] * rows.num_rows)
    return rows.append_column(DELETE_FLAG, flag)


def latest_per_key(rows: Any, spec: UpsertSpec) -> Any:
    """The change with the greatest sequence of each key (all of them without
    ``sequenceBy``: then each key is there once, :func:`check_batch`)."""
    import pyarrow as pa

    if not spec.sequence_by or rows.num_rows < 2:
        return rows
    keys = rows.select(list(spec.keys))
    if keys.group_by(list(spec.keys)).aggregate([]).num_rows == rows.num_rows:
        return rows  # one change per key (the common case): no sort of every row
    order = [(k, "ascending") for k in spec.keys] + [(s, "descending") for s in spec.sequence_by]
    ranked = rows.append_column("__i", pa.array(range(rows.num_rows), pa.int64())).sort_by(order)
    firsts = ranked.group_by(list(spec.keys), use_threads=False).aggregate([("__i", "first")])
    keep = firsts.column("__i_first").combine_chunks().sort()
    return rows.take(keep)


def without_tombstoned(source: Any, tombstones: Any, spec: UpsertSpec) -> Any:
    """Drop changes whose key was deleted at a sequence not older than theirs (a late
    change must not bring a deleted row back). ``tombstones``: keys and sequences."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if tombstones is None or tombstones.num_rows == 0 or source.num_rows == 0:
        return source
    renamed = tombstones.select(list(spec.keys) + list(spec.sequence_by)).rename_columns(
        list(spec.keys) + [f"__t_{s}" for s in spec.sequence_by]
    )
    # keys, sequence and a row number only: pyarrow joins refuse list, struct and map
    # columns beside the keys (a trial wedged an upsert with an array column here)
    indexed = source.select(list(spec.keys) + list(spec.sequence_by)).append_column(
        "__i", pa.array(range(source.num_rows), pa.int64())
    )
    joined = indexed.join(renamed, keys=list(spec.keys), join_type="inner")
    if joined.num_rows == 0:
        return source
    newer = _lexicographic_greater(
        joined, list(spec.sequence_by), [f"__t_{s}" for s in spec.sequence_by]
    )
    stale = joined.filter(pc.invert(newer)).column("__i")
    keep = pc.invert(pc.is_in(indexed.column("__i"), value_set=stale.combine_chunks()))
    return source.filter(keep)


def _lexicographic_greater(table: Any, left: Sequence[str], right: Sequence[str]) -> Any:
    """Row-wise (left...) > (right...) in order (no nulls: checked before)."""
    import pyarrow.compute as pc

    result = None
    equal_so_far = None
    for a, b in zip(left, right, strict=True):
        gt = pc.greater(table.column(a), table.column(b))
        eq = pc.equal(table.column(a), table.column(b))
        step = gt if equal_so_far is None else pc.and_(equal_so_far, gt)
        result = step if result is None else pc.or_(result, step)
        equal_so_far = eq if equal_so_far is None else pc.and_(equal_so_far, eq)
    return result


def newer_sql(spec: UpsertSpec, source: str = "s", target: str = "t") -> str:
    """SQL: the source row's sequence is greater than the target row's ("TRUE" without
    ``sequenceBy``: every change replaces the row)."""
    if not spec.sequence_by:
        return "TRUE"
    terms = []
    for i, s in enumerate(spec.sequence_by):
        same = [f"{source}.{quote(p)} = {target}.{quote(p)}" for p in spec.sequence_by[:i]]
        terms.append(" AND ".join([*same, f"{source}.{quote(s)} > {target}.{quote(s)}"]))
    return " OR ".join(f"({t})" for t in terms)


def quote(column: str) -> str:
    """A column name as DataFusion SQL quotes it."""
    return '"' + column.replace('"', '""') + '"'


# --- SCD type 2 ---------------------------------------------------------------------------


def scd2_versions(
    existing: Any,
    changes: Any,
    spec: UpsertSpec,
    columns: Sequence[str],
    tombstones: Any = None,
) -> Any:
    """Every version of the keys ``changes`` touch, with their validity, from the table's
    rows of those keys (``existing``: ``columns`` with ``__START_AT``/``__END_AT``), the
    deletes remembered for them (``tombstones``: keys and sequence) and the batch's changes
    (with :data:`DELETE_FLAG`).

    The history is rebuilt from events sorted by sequence: a version starts at each
    upsert and ends at the next change of its key (upsert or delete); a delete starts
    nothing. Existing versions are kept (same key and start: the same change, replayed),
    so late changes land in their place in the history. Returns only the versions
    that are new or whose end changed."""
    import pyarrow as pa

    seq = spec.sequence_by[0]
    keys = list(spec.keys)
    data_cols = [c for c in columns if c not in (START_AT, END_AT)]
    events: dict[tuple, dict[Any, tuple[bool, dict | None]]] = {}
    known: dict[tuple, dict[Any, Any]] = {}  # key -> start -> end, as in the table
    for row in existing.to_pylist() if existing is not None else []:
        k = tuple(row[c] for c in keys)
        start, end = row[START_AT], row[END_AT]
        known.setdefault(k, {})[start] = end
        events.setdefault(k, {})[start] = (False, {c: row[c] for c in data_cols})
    for k, versions in known.items():  # a version ending where none starts: a delete
        for end in versions.values():
            if end is not None and end not in versions:
                events[k].setdefault(end, (True, None))
    for row in tombstones.to_pylist() if tombstones is not None else []:
        events.setdefault(tuple(row[c] for c in keys), {}).setdefault(row[seq], (True, None))
    for row in changes.to_pylist():
        k = tuple(row[c] for c in keys)
        at = row[seq]
        if at in events.get(k, {}):
            continue  # the table has this change already
        deleted = bool(row[DELETE_FLAG])
        events.setdefault(k, {})[at] = (
            deleted,
            None if deleted else {c: row[c] for c in data_cols},
        )
    out = []
    for k, by_seq in events.items():
        order = sorted(by_seq)
        for i, at in enumerate(order):
            deleted, values = by_seq[at]
            if deleted:
                continue
            end = order[i + 1] if i + 1 < len(order) else None
            if known.get(k, {}).get(at, "absent") == end:
                continue  # unchanged
            assert values is not None
            out.append({**values, START_AT: at, END_AT: end})
    schema = pa.schema([changes.schema.field(c) for c in data_cols])
    seq_type = changes.schema.field(seq).type
    schema = schema.append(pa.field(START_AT, seq_type)).append(pa.field(END_AT, seq_type))
    return pa.Table.from_pylist(out, schema=schema)
