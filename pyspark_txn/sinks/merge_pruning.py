"""Which files of the target an upsert MERGE can skip: a condition on the target's key
columns alone, from the keys of the batch (and the files' key statistics), added to the
MERGE's join predicate.

Why it is needed: delta-rs's Python ``merge`` runs with ``streamed_exec=True`` by
default, and a streamed source gives it nothing to prune by (``merge/filter.rs``,
``generalize_filter``: with a streaming source every term that names the source is
dropped). Only terms on target columns and literals are kept; delta-rs pushes those to
its scan, which skips files by their ``add.stats`` min/max and their partition values,
and rewrites only the files it reads. So each batch names its keys' bounds as literals:

- a key that partitions the table: ``t.k IN (...)`` of the batch's values (partition
  pruning), up to :data:`MAX_VALUES` values, a range beyond;
- any other key: ``t.k >= lo AND t.k <= hi``; for the first such key, with the files'
  statistics, the range is cut at the gaps between the batch's keys that hold whole
  files (up to :data:`MAX_RANGES` ranges, the gaps that exclude the most bytes first),
  so a batch of recent keys plus a few old ones reads the files of those keys, not
  everything in between.

The condition never changes what matches: every key of the source lies inside it, and
a target row matches only a source row with equal keys. Key types without an exact SQL
literal here (timestamps, whose statistics Delta truncates to milliseconds; booleans;
binary) add no condition: those merges read every file, as before.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

from .upsert import quote

#: At most this many ranges of one key (an OR that delta-rs evaluates per file).
MAX_RANGES = 32
#: At most this many values of a partitioning key in an IN list (a range beyond).
MAX_VALUES = 256
#: Ranges of a key other than an integer are cut for batches of at most this many
#: distinct values (sorting them takes Python objects); one range beyond.
MAX_SORTED = 200_000


def pruning_predicate(
    source: Any,
    keys: Sequence[str],
    partition_columns: Sequence[str] = (),
    files: Any = None,
    *,
    alias: str = "t",
    max_ranges: int = MAX_RANGES,
    max_values: int = MAX_VALUES,
) -> str | None:
    """SQL on ``alias``'s key columns that every row matching a row of ``source`` (by
    ``keys``) satisfies and that files holding none of its keys fail; None where there
    is nothing to add (no rows, no key of a type with literals here).

    ``files``: the table's add actions, flattened (``DeltaTable.get_add_actions(
    flatten=True)`` as a pyarrow table: ``min.<key>``, ``max.<key>``, ``size_bytes``),
    to cut ranges at gaps that hold whole files; without them one range per key."""
    if source.num_rows == 0:
        return None
    terms = []
    cut = False  # gaps are cut for one key: ranges of several keys are not a box
    for key in keys:
        render = _literal(source.schema.field(key).type)
        if render is None:
            continue
        column, sql = source.column(key), f"{alias}.{quote(key)}"
        if key in partition_columns:
            values = _distinct(column, max_values)
            if values is not None:
                terms.append(f"{sql} IN ({', '.join(render(v) for v in values)})")
                continue
        ranges = None
        if files is not None and not cut and key not in partition_columns:
            bounds = file_bounds(files, key)
            if bounds:
                cut = True
                values = _sorted_keys(column)
                ranges = key_ranges(values, bounds, max_ranges) if values is not None else None
        if ranges is None:
            ranges = _min_max(column)
        if not ranges:
            continue
        rendered = [_range_sql(sql, lo, hi, render) for lo, hi in ranges]
        terms.append(rendered[0] if len(rendered) == 1 else " OR ".join(rendered))
    if not terms:
        return None
    return " AND ".join(f"({t})" for t in terms)


def key_ranges(
    values: Sequence[Any],
    bounds: Sequence[tuple[Any, Any, int]] | None = None,
    max_ranges: int = MAX_RANGES,
) -> list[tuple[Any, Any]]:
    """Ranges ``(lo, hi)`` that cover every value of ``values`` (sorted; repeats allowed).

    One range from the least to the greatest value, cut at the gaps between two
    neighbouring values that hold whole files (``bounds``: each file's min, max and
    weight): a file none of the values falls in is left outside every range where its
    gap is among the ``max_ranges - 1`` gaps of the greatest summed weight."""
    if len(values) == 0:
        return []
    if not bounds or max_ranges < 2 or len(values) < 2:
        return [(values[0], values[-1])]
    weights: dict[int, int] = {}  # i: the gap between values[i - 1] and values[i]
    for lo, hi, weight in bounds:
        try:
            if lo > hi:
                continue
            i = bisect.bisect_left(values, lo)
            if 0 < i < len(values) and values[i] > hi:
                weights[i] = weights.get(i, 0) + weight
        except TypeError:  # statistics of another type than the keys: no cut from them
            continue
    cuts = sorted(sorted(weights, key=lambda i: (-weights[i], i))[: max_ranges - 1])
    ranges, start = [], 0
    for c in cuts:
        ranges.append((values[start], values[c - 1]))
        start = c
    ranges.append((values[start], values[-1]))
    return ranges


def file_bounds(files: Any, key: str) -> list[tuple[Any, Any, int]] | None:
    """Each file's (min, max, size in bytes) of ``key`` from flattened add actions; files
    without both bounds are left out (they are read: nothing says they cannot match).
    None where the actions have no statistics of the key."""
    names = files.schema.names
    if f"min.{key}" not in names or f"max.{key}" not in names:
        return None
    lows = files.column(f"min.{key}").to_pylist()
    highs = files.column(f"max.{key}").to_pylist()
    sizes = files.column("size_bytes").to_pylist() if "size_bytes" in names else [1] * len(lows)
    return [
        (lo, hi, size or 1)
        for lo, hi, size in zip(lows, highs, sizes, strict=True)
        if lo is not None and hi is not None
    ]


def _sorted_keys(column: Any) -> Any:
    """The values of ``column`` in order, to bisect: a numpy array for integers (sorting
    5M keys takes ~0.3 s there, ~20x less than Python's), else the distinct values as a
    list, up to :data:`MAX_SORTED` of them; None beyond, or where a value has no Python
    form (a date outside the years 1-9999): then the key gets one range."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_signed_integer(column.type):
        import numpy as np

        return np.sort(column.to_numpy())
    distinct = pc.unique(column)
    if len(distinct) > MAX_SORTED:
        return None
    try:
        return distinct.take(pc.array_sort_indices(distinct)).to_pylist()
    except (ValueError, OverflowError):
        return None


def _distinct(column: Any, limit: int) -> list[Any] | None:
    """The distinct values of ``column``, sorted, where there are at most ``limit``."""
    import pyarrow.compute as pc

    distinct = pc.unique(column)
    if len(distinct) > limit:
        return None
    try:
        return sorted(distinct.to_pylist())
    except (ValueError, OverflowError):
        return None


def _min_max(column: Any) -> list[tuple[Any, Any]] | None:
    """``[(least, greatest)]`` of ``column``; None where they have no Python form."""
    import pyarrow.compute as pc

    bounds = pc.min_max(column)
    try:
        lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
    except (ValueError, OverflowError):
        return None
    return None if lo is None or hi is None else [(lo, hi)]


def _range_sql(column: str, lo: Any, hi: Any, render: Any) -> str:
    if lo == hi:
        return f"{column} = {render(lo)}"
    return f"{column} >= {render(lo)} AND {column} <= {render(hi)}"


def _literal(t: Any) -> Any:
    """A function that writes a value of arrow type ``t`` as a DataFusion SQL literal of
    that type, exactly; None for types left unpruned (module doc)."""
    import pyarrow as pa

    if pa.types.is_signed_integer(t):
        return lambda v: str(int(v))
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return lambda v: "'" + v.replace("'", "''") + "'"
    if pa.types.is_date(t):
        return lambda v: f"CAST('{v.isoformat()}' AS DATE)"
    if pa.types.is_decimal(t):
        precision, scale = t.precision, t.scale
        if precision > 38:  # DataFusion's SQL DECIMAL stops at 38 digits
            return None
        return lambda v: f"CAST('{v:f}' AS DECIMAL({precision}, {scale}))"
    return None
