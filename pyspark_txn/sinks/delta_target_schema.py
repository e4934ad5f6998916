"""The Delta target's schema rules: the stream schema as staged (base64 Arrow IPC), the
drift between a table and the stream, what a new table gets (every field nullable),
and the schemas, column mappings and table features the sink refuses to write."""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError


def schema_to_b64(schema) -> str:
    return base64.b64encode(schema.serialize().to_pybytes()).decode()


def schema_from_b64(text: str):
    import pyarrow as pa

    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text)))


def _normal_type(t):
    import pyarrow as pa

    if pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return pa.string()
    if pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return pa.binary()
    if pa.types.is_timestamp(t):
        return pa.timestamp("us", tz="UTC" if t.tz else None)
    return _nullable_type(t)  # nested NOT NULL is the stream's claim, not a schema change


def table_arrow_schema(dt):
    """The table's schema as a pyarrow schema (delta-rs returns arro3 objects)."""
    import pyarrow as pa

    return pa.schema(dt.schema().to_arrow())


def schema_drift(table_schema, stream_schema) -> tuple[list[str], list[str]]:
    """(columns the stream adds, human-readable incompatibilities). Nullable columns of
    the table the stream lacks are none of these: they are null in the stream's rows."""
    table = {f.name: f for f in table_schema}
    by_lower = {name.lower(): name for name in table}
    added, problems = [], []
    for f in stream_schema:
        old = table.pop(f.name, None)
        if old is None and by_lower.get(f.name.lower()) in table:
            other = table.pop(by_lower[f.name.lower()])
            problems.append(
                f"column {f.name!r} of the stream differs only by case from the table's "
                f"{other.name!r}; Delta names are case-insensitive: rename it to {other.name!r}"
            )
        elif old is None:
            added.append(f.name)
        elif _normal_type(old.type) != _normal_type(f.type):
            problems.append(
                f"column {f.name!r} is {old.type} in the table but {f.type} in the stream"
            )
    # As Spark's Delta sink: a nullable column the stream lacks reads as null in its
    # rows (a data file without a column of the table has nulls there, for every Delta
    # reader); a NOT NULL one cannot be left empty.
    problems += [
        f"column {name!r} of the table is NOT NULL and missing from the stream"
        for name, f in table.items()
        if not f.nullable
    ]
    return added, problems


def as_nullable(schema):
    """Every field nullable, nested ones too: what Spark's Delta writer gives a new table.
    Spark marks derived columns NOT NULL; a table that kept that would refuse the next
    query that writes a null there."""
    import pyarrow as pa

    return pa.schema([_nullable_field(f) for f in schema], metadata=schema.metadata)


def _nullable_field(f):
    import pyarrow as pa

    return pa.field(f.name, _nullable_type(f.type), nullable=True, metadata=f.metadata)


def _nullable_type(t):
    import pyarrow as pa

    if pa.types.is_struct(t):
        return pa.struct([_nullable_field(t.field(i)) for i in range(t.num_fields)])
    if pa.types.is_large_list(t):
        return pa.large_list(_nullable_field(t.value_field))
    if pa.types.is_list(t):
        return pa.list_(_nullable_field(t.value_field))
    if pa.types.is_map(t):
        return pa.map_(t.key_type, _nullable_field(t.item_field))
    return t


#: Columns the change data feed adds to what it reads (Delta's protocol reserves them).
CDF_COLUMNS = frozenset({"_change_type", "_commit_version", "_commit_timestamp"})


def cdf_reserved(config: Mapping[str, str], names) -> list[str]:
    """The column ``names`` a table with the change data feed on reserves for itself."""
    if str(config.get("delta.enableChangeDataFeed", "")).lower() != "true":
        return []
    return sorted(set(names) & CDF_COLUMNS)


def batch_nulls(columns, txns) -> dict[str, int]:
    """Nulls the staged files' statistics count in ``columns`` (a table's NOT NULL
    ones), by column; a file whose statistics give no count for one counts none."""
    nulls: dict[str, int] = {}
    if not columns:
        return nulls
    for t in txns:
        counts = json.loads(t.meta.get("stats") or "{}").get("nullCount", {})
        for c in columns:
            n = counts.get(c)
            if isinstance(n, int) and n > 0:
                nulls[c] = nulls.get(c, 0) + n
    return nulls


def check_writable_schema(schema) -> None:
    """Refuse what Delta cannot store, by column name, before anything is staged."""
    import pyarrow as pa
    from deltalake import Schema

    seen: dict[str, str] = {}
    for name in schema.names:
        other = seen.setdefault(name.lower(), name)
        if other != name:
            raise ConfigError(
                f"columns {other!r} and {name!r} differ only by case; Delta column names are "
                "case-insensitive: rename one"
            )
    for f in schema:
        try:
            Schema.from_arrow(_one_field_schema(f))
        except Exception as e:
            spark_name = " (a Spark interval)" if _contains_type(f.type, _is_interval) else ""
            raise ConfigError(
                f"column {f.name!r} has type {f.type}{spark_name}, which a Delta table cannot "
                f"store ({e}); cast it (e.g. intervals to a string or a number) before the sink"
            ) from None
        if _contains_type(f.type, pa.types.is_null):
            raise ConfigError(
                f"column {f.name!r} has type NULL (void: e.g. a bare lit(None)); give it a "
                "type with .cast(...) before the sink"
            )
        if _contains_type(f.type, lambda t: pa.types.is_struct(t) and t.num_fields == 0):
            raise ConfigError(
                f"column {f.name!r} has a struct with no fields (e.g. a bare struct()), which "
                "parquet cannot store; drop it or give the struct a field before the sink"
            )


def _one_field_schema(f):
    import pyarrow as pa

    return pa.schema([f])


def _contains_type(t, matches) -> bool:
    """Whether ``t`` or any type nested in it (struct fields, list values, map keys and
    items) satisfies ``matches``."""
    import pyarrow as pa

    if matches(t):
        return True
    if pa.types.is_struct(t):
        return any(_contains_type(t.field(i).type, matches) for i in range(t.num_fields))
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return _contains_type(t.value_type, matches)
    if pa.types.is_map(t):
        return _contains_type(t.key_type, matches) or _contains_type(t.item_type, matches)
    return False


def _is_interval(t) -> bool:
    import pyarrow as pa

    return pa.types.is_duration(t) or pa.types.is_interval(t)


# Writer features delta-rs's append honours; anything else may need rules we do not follow.
_KNOWN_WRITER_FEATURES = {
    "appendOnly",
    "invariants",
    "timestampNtz",
    "domainMetadata",
    "v2Checkpoint",
    "vacuumProtocolCheck",
    "changeDataFeed",
    "deletionVectors",
}


def check_table_features(dt, uri: str) -> None:
    """Refuse target tables whose rules an append through this sink would break.

    Appends honour NOT NULL (checked per batch before the record), appendOnly
    and change data feed (appends need no CDC files). Everything else that
    constrains what a writer may add is refused by name, before anything is
    staged: CHECK constraints, legacy invariants, generated and identity
    columns, column mapping (files would need physical names), and writer
    features this sink does not know.
    """
    constraints = sorted(check_constraints(dt))
    if constraints:
        raise ConfigError(
            f"the Delta table at {uri} has CHECK constraints {constraints}, which txn-delta "
            "cannot enforce yet; drop them or write through a sink that enforces them"
        )
    mode = column_mapping_mode(dt)
    if mode != "none":
        raise ConfigError(
            f"the Delta table at {uri} uses column mapping (mode {mode!r}), which txn-delta "
            "cannot write yet"
        )
    for path, key in rule_columns(dt):
        what = _COLUMN_RULES[key]
        raise ConfigError(
            f"column {path!r} of the Delta table at {uri} is {what} ({key}), which txn-delta "
            "cannot honour yet; write to a table without it"
        )
    unknown = unknown_writer_features(dt)
    if unknown:
        raise ConfigError(
            f"the Delta table at {uri} needs writer features {unknown} that txn-delta does "
            "not support"
        )


def check_constraints(dt) -> dict[str, str]:
    """The table's CHECK constraints: name -> expression (Spark SQL, as Delta keeps it)."""
    config = dt.metadata().configuration or {}
    prefix = "delta.constraints."
    return {k[len(prefix) :]: v for k, v in config.items() if k.startswith(prefix)}


def column_mapping_mode(dt) -> str:
    return (dt.metadata().configuration or {}).get("delta.columnMapping.mode", "none")


def rule_columns(dt) -> list[tuple[str, str]]:
    """(column path, metadata key) of every column that carries a writer rule
    (generated, identity, legacy invariant)."""
    return list(_rule_metadata(json.loads(dt.schema().to_json())))


def rule_name(key: str) -> str:
    """What a column rule of :func:`rule_columns` makes a column, in words."""
    return _COLUMN_RULES[key]


def unknown_writer_features(dt, also_known: frozenset[str] = frozenset()) -> list[str]:
    """The table's writer features this sink does not honour (besides ``also_known``)."""
    features = set(dt.protocol().writer_features or ())
    return sorted(features - _KNOWN_WRITER_FEATURES - also_known)


_COLUMN_RULES = {
    "delta.generationExpression": "a generated column",
    "delta.identity.start": "an identity column",
    "delta.invariants": "guarded by an invariant",
}


def _rule_metadata(schema_json: Mapping[str, Any], prefix: str = ""):
    """(column path, metadata key) of every field that carries a writer rule."""
    for f in schema_json.get("fields", ()):
        path = f"{prefix}{f['name']}"
        for key in _COLUMN_RULES:
            if key in (f.get("metadata") or {}):
                yield path, key
        t = f.get("type")
        if isinstance(t, dict) and t.get("type") == "struct":
            yield from _rule_metadata(t, path + ".")
