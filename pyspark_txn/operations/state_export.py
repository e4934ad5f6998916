"""Export the operator state of a stateful query as standalone Delta tables.

A named snapshot of a stateful query (``dropDuplicates``, aggregations with a
watermark, stream-stream joins, ``transformWithState``) is only complete with
the state its operators held at the snapshot's batch: without it the output
cannot be explained or checked. Spark reads that state with its ``statestore``
data source (at any batch whose state version is still retained) and lists
operators and stores with ``state-metadata``; this module writes what they
return as one Delta table per operator and store under
``<to>/state/<operatorId>/<storeName>`` (``transformWithState``: one per state
variable, ``<to>/state/<operatorId>/<storeName>/<stateVariable>``, and the
registered timers in ``.../_timers``), so any Delta reader (delta-rs, Spark,
DuckDB, ...) reads it without this package and without the checkpoint.

Columns are what the reader gives (``key`` and ``value`` structs, or
``list_element`` / ``user_map_key`` / ``user_map_value`` for
``transformWithState`` collections, plus ``partition_id``), except where Delta
has no type for them (see :func:`_delta_safe`): ``void`` fields are dropped,
structs left without fields with them (``dropDuplicates`` keeps
``value: struct<__dummy__: void>``, so its table has no ``value`` column), and
intervals become their Spark string form.

The tables are copies: they are not state Spark can restart from (a new query
cannot load operator state from them).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

from ..errors import ConfigError
from ..spark.options import check_location
from ..storage import fs as _fs

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]

#: The Spark setting that decides how many batches' state (and commit log) a checkpoint keeps.
RETENTION_SETTING = "spark.sql.streaming.minBatchesToRetain"
#: Folder of a ``transformWithState`` operator's registered timers, next to its state variables.
TIMERS = "_timers"
#: ``transformWithState`` time modes without timers.
_NO_TIMERS = {"notime", "none", ""}
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")


@dataclass(frozen=True)
class StateTable:
    """One exported state table: which operator and store it holds, and where it is."""

    operator_id: int
    operator_name: str
    store_name: str
    path: str  # relative to the export root, e.g. "state/0/default"
    rows: int
    partitions: int  # the operator's state store partitions (Spark's numPartitions)
    state_var: str | None = None  # transformWithState: the state variable (TIMERS: the timers)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> StateTable:
        return cls(
            operator_id=int(d["operator_id"]),
            operator_name=str(d["operator_name"]),
            store_name=str(d["store_name"]),
            path=str(d["path"]),
            rows=int(d["rows"]),
            partitions=int(d["partitions"]),
            state_var=None if d.get("state_var") is None else str(d["state_var"]),
        )


@dataclass(frozen=True)
class _Store:
    """One table to read: an operator's store (or one state variable of it)."""

    operator_id: int
    operator_name: str
    store_name: str
    partitions: int
    path: str
    options: dict[str, str] = field(default_factory=dict)
    state_var: str | None = None

    @property
    def label(self) -> str:
        what = f"operator {self.operator_id} ({self.operator_name}), store {self.store_name!r}"
        if self.state_var == TIMERS:
            return what + ", registered timers"
        if self.state_var is not None:
            return what + f", state variable {self.state_var!r}"
        return what


def has_state(checkpoint: str, fs_options: Any = None) -> bool:
    """Whether a Spark checkpoint holds operator state (a file under ``<checkpoint>/state``).

    Decided without Spark (through fsspec), so a caller without a SparkSession
    can tell a stateful query from a stateless one; it stops at the first file
    found, so a large state folder costs a few listings.
    """
    fs, root = _fs.filesystem(checkpoint, fs_options)
    # state/<op>/<partition>/<store>/<file> is the deepest layout (stream-stream joins)
    return _any_file(fs, _fs.join(root, "state"), depth=4)


def _any_file(fs: Any, path: str, depth: int) -> bool:
    try:
        entries = fs.ls(path, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return False
    dirs = []
    for entry in entries:
        name = str(entry.get("name", "")).rstrip("/")
        if name == path.rstrip("/"):  # some filesystems list a path itself
            continue
        if entry.get("type") == "directory":
            dirs.append(name)
        else:
            return True
    return depth > 0 and any(_any_file(fs, d, depth - 1) for d in dirs)


def _spark_errors() -> tuple[type[BaseException], ...]:
    """The exceptions a Spark read raises (classic and Connect)."""
    from pyspark.errors import PySparkException

    errors: list[type[BaseException]] = [PySparkException]
    try:
        from py4j.protocol import Py4JJavaError

        errors.append(Py4JJavaError)
    except ImportError:  # pragma: no cover - Spark Connect clients have no py4j
        pass
    return tuple(errors)


def _messages(exc: BaseException) -> list[str]:
    """The error's message, then those of its JVM causes (a failed job wraps the real one)."""
    messages = [str(exc).strip()]
    java = getattr(exc, "java_exception", None)
    for _ in range(10):
        if java is None:
            break
        try:
            messages.append(str(java.getMessage() or "").strip())
            java = java.getCause()
        except Exception:  # noqa: BLE001 - the JVM is gone: keep what was read
            break
    return [m for m in messages if m]


def _describe(exc: BaseException) -> str:
    """Spark's error condition and its message's first line, without the JVM stack."""
    condition = None
    for getter in ("getCondition", "getErrorClass"):
        fn = getattr(exc, getter, None)
        if fn is not None:
            try:
                condition = fn()
            except Exception:  # noqa: BLE001 - only decoration of an error being raised
                condition = None
            if condition:
                break
    lines = [m.splitlines()[0].strip() for m in _messages(exc)]
    # py4j's own line ("An error occurred while calling o81.getResult.") says nothing:
    # prefer the first message naming an error condition, else the innermost one
    first = next((line for line in lines if line.startswith("[")), None)
    if first is None:
        first = lines[-1] if len(lines) > 1 else (lines or [type(exc).__name__])[0]
    if condition and condition not in first:
        first = f"[{condition}] {first}"
    return first[:500]


def _looks_unretained(exc: BaseException) -> bool:
    """Whether a failed state read looks like state files that were already cleaned up."""
    text = "\n".join(_messages(exc))
    return any(
        s in text
        for s in (
            "CANNOT_LOAD_STATE_STORE",
            "STDS_OFFSET_LOG_UNAVAILABLE",
            "STDS_COMMITTED_BATCH_UNAVAILABLE",
            "FileNotFoundException",
            "does not exist",
        )
    )


def _retention_hint(batch_id: int) -> str:
    return (
        f"Spark keeps the state and commit log of the last {RETENTION_SETTING} batches "
        f"(default 100) only; batch {batch_id} is older than that. Export a later batch, or "
        f"run the query with a larger {RETENTION_SETTING} to keep more"
    )


def _path_part(name: str) -> str:
    """A folder name for a store or state variable: itself when plain, else sanitized + hash."""
    if _SAFE_NAME.match(name) and name != TIMERS:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    return f"{re.sub(r'[^A-Za-z0-9_-]', '_', name).strip('_') or 'x'}-{digest}"


def _read_metadata(spark: Any, checkpoint: str, batch_id: int | None = None) -> list[Any]:
    reader = spark.read.format("state-metadata")
    if batch_id is not None:
        reader = reader.option("batchId", str(batch_id))
    try:
        return reader.load(checkpoint).collect()
    except _spark_errors() as exc:
        at = "" if batch_id is None else f" at batch {batch_id}"
        raise ConfigError(
            f"cannot list the stateful operators of {checkpoint}{at} with Spark's "
            f"state-metadata reader: {_describe(exc)}"
        ) from exc


def _no_state_error(checkpoint: str, fs_options: Any) -> ConfigError:
    try:
        files = has_state(checkpoint, fs_options)
    except Exception:  # noqa: BLE001 - a scheme fsspec cannot open: Spark's answer stands
        files = False
    if files:
        return ConfigError(
            f"the checkpoint {checkpoint} has state files but Spark's state-metadata reader "
            "lists no stateful operator: its operator metadata is missing (a checkpoint "
            "written by an older Spark); run the query once with this Spark to write it"
        )
    return ConfigError(
        f"the checkpoint {checkpoint} holds no operator state (the query is stateless): "
        "there is no state to export"
    )


def _committed_range(rows: list[Any], checkpoint: str) -> tuple[int, int]:
    lows = [r.minBatchId for r in rows if r.minBatchId is not None]
    highs = [r.maxBatchId for r in rows if r.maxBatchId is not None]
    if not lows or not highs:
        raise ConfigError(
            f"the checkpoint {checkpoint} has no committed batch in Spark's commit log yet"
        )
    return min(lows), max(highs)


def _check_batch(
    spark: Any,
    checkpoint: str,
    batch_id: int,
    rows: list[Any],
    wait_s: float,
    fs_options: Any,
) -> list[Any]:
    """The metadata rows once ``batch_id`` is in Spark's commit log and still retained.

    The sink commits a batch before Spark writes that batch's commit file, and
    Spark's reader only reads committed batches: the batch right after the last
    committed one is waited for (up to ``wait_s``), any later one is an error.
    """
    low, high = _committed_range(rows, checkpoint)
    deadline = time.monotonic() + wait_s
    while batch_id == high + 1 and time.monotonic() < deadline:
        time.sleep(0.2)
        rows = _read_metadata(spark, checkpoint)
        if not rows:
            raise _no_state_error(checkpoint, fs_options)
        low, high = _committed_range(rows, checkpoint)
    if batch_id > high:
        raise ConfigError(
            f"batch {batch_id} is not committed in Spark's checkpoint {checkpoint} (its last "
            f"committed batch is {high}): Spark's state reader reads committed batches only"
            + (
                f"; the query has not finished batch {batch_id} (waited {wait_s:g} s)"
                if batch_id == high + 1
                else ""
            )
        )
    if batch_id < low:
        raise ConfigError(
            f"the state of batch {batch_id} is no longer retained in {checkpoint} (its oldest "
            f"committed batch is {low}). " + _retention_hint(batch_id)
        )
    return rows


def _stores(spark: Any, checkpoint: str, batch_id: int, rows: list[Any]) -> list[_Store]:
    """One entry per table: operators and stores, and transformWithState's state variables."""
    tws_props: dict[int, dict[str, Any]] | None = None
    stores: list[_Store] = []
    for row in sorted(rows, key=lambda r: (int(r.operatorId), str(r.stateStoreName))):
        op_id, store = int(row.operatorId), str(row.stateStoreName)
        base = f"state/{op_id}/{_path_part(store)}"
        entry = partial(
            _Store,
            operator_id=op_id,
            operator_name=str(row.operatorName),
            store_name=store,
            partitions=int(row.numPartitions or 0),
        )
        props = _properties(row.operatorProperties)
        if "stateVariables" not in props:
            stores.append(entry(path=base, options={"storeName": store}))
            continue
        # transformWithState: the reader needs a state variable, and the variables can
        # change between runs of the query, so take those of this batch's metadata
        if tws_props is None:
            tws_props = {
                int(r.operatorId): _properties(r.operatorProperties)
                for r in _read_metadata(spark, checkpoint, batch_id)
            }
        props = tws_props.get(op_id) or props
        names = sorted(str(v["stateName"]) for v in props.get("stateVariables", []))
        # names starting with "$" are Spark's own column families (timers, TTL indexes):
        # the reader refuses them; the timers are read with readRegisteredTimers below
        for name in (n for n in names if not n.startswith("$")):
            stores.append(
                entry(
                    path=f"{base}/{_path_part(name)}",
                    options={"stateVarName": name},
                    state_var=name,
                )
            )
        if str(props.get("timeMode", "")).lower() not in _NO_TIMERS:
            stores.append(
                entry(
                    path=f"{base}/{TIMERS}",
                    options={"readRegisteredTimers": "true"},
                    state_var=TIMERS,
                )
            )
    return stores


def _properties(raw: str | None) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _delta_safe(col: Any, dtype: Any) -> Any:
    """``col`` as a type Delta can store, or None when it carries nothing Delta can hold.

    Delta (and Parquet) have no ``void`` type and no empty struct: a ``void``
    field is always null, so it is dropped, and a struct left without fields
    with it (``dropDuplicates`` stores ``struct<__dummy__: void>``). Delta has no
    interval type, and Spark's Arrow conversion refuses year-month and calendar
    intervals (day-time ones become Arrow durations, which delta-rs refuses):
    intervals are cast to their Spark string form (``INTERVAL '1 02:03:04' DAY
    TO SECOND``). Timestamps (with or without time zone), maps, arrays and
    nested structs are written as they are.
    """
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    if not _needs_change(dtype):
        return col
    if isinstance(dtype, T.NullType):
        return None
    if isinstance(dtype, (T.YearMonthIntervalType, T.DayTimeIntervalType, T.CalendarIntervalType)):
        return col.cast("string")
    if isinstance(dtype, T.StructType):
        if _repeats(dtype):
            # an aggregation's state can hold two fields of one name (two sum()s give a
            # value struct<sum, sum>), which Arrow and Delta refuse: cast by position to
            # unique names, the second one sum_2
            seen: dict[str, int] = {}
            renamed = []
            for f in dtype.fields:
                seen[f.name] = seen.get(f.name, 0) + 1
                name = f.name if seen[f.name] == 1 else f"{f.name}_{seen[f.name]}"
                renamed.append(T.StructField(name, f.dataType, f.nullable))
            dtype = T.StructType(renamed)
            col = col.cast(dtype)
        fields = []
        for f in dtype.fields:
            converted = _delta_safe(col.getField(f.name), f.dataType)
            if converted is not None:
                fields.append(converted.alias(f.name))
        if not fields:
            return None
        return F.when(col.isNull(), F.lit(None)).otherwise(F.struct(*fields))
    if isinstance(dtype, T.ArrayType):
        return F.transform(col, lambda x: _element(x, dtype.elementType))
    if isinstance(dtype, T.MapType):
        if _needs_change(dtype.keyType):
            col = F.transform_keys(col, lambda k, _v: _element(k, dtype.keyType))
        if _needs_change(dtype.valueType):
            col = F.transform_values(col, lambda _k, v: _element(v, dtype.valueType))
        return col
    return col  # a user-defined type: Spark writes its SQL type as it is


def _element(col: Any, dtype: Any) -> Any:
    """An array element or map key/value cannot be dropped: one Delta cannot hold is a null string."""
    from pyspark.sql import functions as F

    converted = _delta_safe(col, dtype)
    return F.lit(None).cast("string") if converted is None else converted


def _needs_change(dtype: Any) -> bool:
    from pyspark.sql import types as T

    from ..spark.types import any_nested_type

    return any_nested_type(
        dtype,
        lambda d: (
            isinstance(
                d,
                (
                    T.NullType,
                    T.YearMonthIntervalType,
                    T.DayTimeIntervalType,
                    T.CalendarIntervalType,
                ),
            )
            or _repeats(d)
        ),
    )


def _repeats(dtype: Any) -> bool:
    """A struct with two fields of one name."""
    from pyspark.sql import types as T

    if not isinstance(dtype, T.StructType):
        return False
    names = [f.name for f in dtype.fields]
    return len(set(names)) != len(names)


def _state_frame(spark: Any, checkpoint: str, batch_id: int, store: _Store) -> Any:
    """Spark's state reader for one table, with the columns made storable in Delta."""
    reader = spark.read.format("statestore").option("batchId", str(batch_id))
    reader = reader.option("operatorId", str(store.operator_id))
    for key, value in store.options.items():
        reader = reader.option(key, value)
    df = reader.load(checkpoint)
    columns: list[Any] = []
    for f in df.schema.fields:
        if not _needs_change(f.dataType):
            columns.append(f.name)
            continue
        converted = _delta_safe(df[f.name], f.dataType)
        if converted is None:
            log.debug("state of %s: column %s (%s) dropped", store.label, f.name, f.dataType)
        else:
            columns.append(converted.alias(f.name))
    return df.select(*columns)


def export_state(
    spark: Any,
    checkpoint: str,
    batch_id: int,
    to: str,
    *,
    storage_options: Mapping[str, str] | None = None,
    progress: Progress | None = None,
    wait_s: float = 10.0,
    fs_options: Any = None,
) -> list[StateTable]:
    """Write the operator state committed at the end of batch ``batch_id`` as Delta tables.

    One table per operator and store at ``<to>/state/<operatorId>/<storeName>``
    (read with Spark's ``statestore`` reader, ``batchId`` = ``batch_id``), listed
    with Spark's ``state-metadata`` reader. Every table is checked readable
    before the first is written; each is written with delta-rs in one commit
    (``mode="error"``: an existing table there is an error). ``wait_s``: how long
    to wait for Spark's commit file of the batch right after the last committed
    one (the sink commits a batch just before Spark records it).
    ``fs_options``: fsspec options for looking at the checkpoint without Spark.
    Returns the tables written, in order of operator and store.
    """
    if batch_id < 0:
        raise ConfigError(f"batch id {batch_id}: expected a batch id >= 0")
    check_location("to", to)
    if spark is None:
        try:
            stateful = has_state(checkpoint, fs_options)
        except Exception as exc:  # noqa: BLE001 - cannot look: say what is needed
            raise ConfigError(
                f"exporting the state of {checkpoint} needs a SparkSession (pass spark=...)"
            ) from exc
        if stateful:
            raise ConfigError(
                f"the query at {checkpoint} is stateful: exporting its state tables needs a "
                "SparkSession (pass spark=...)"
            )
        raise _no_state_error(checkpoint, fs_options)
    from deltalake import DeltaTable, write_deltalake

    root = _fs.normalize_uri(to)
    options = dict(storage_options or {})
    rows = _read_metadata(spark, checkpoint)
    if not rows:
        raise _no_state_error(checkpoint, fs_options)
    _check_state_readable(checkpoint)
    rows = _check_batch(spark, checkpoint, batch_id, rows, wait_s, fs_options)
    stores = _stores(spark, checkpoint, batch_id, rows)

    # everything is checked before anything is written: readable, and no table there yet
    frames = []
    for store in stores:
        uri = _fs.join(root, store.path)
        if DeltaTable.is_deltatable(uri, storage_options=options):
            raise ConfigError(f"state table {uri} exists already; export to a new location")
        try:
            frames.append(_state_frame(spark, checkpoint, batch_id, store))
        except _spark_errors() as exc:
            raise _read_error(checkpoint, batch_id, store, exc) from exc

    tables: list[StateTable] = []
    for i, (store, df) in enumerate(zip(stores, frames, strict=True)):
        uri = _fs.join(root, store.path)
        started = time.monotonic()
        try:
            data = df.toArrow()
        except _spark_errors() as exc:
            raise _read_error(checkpoint, batch_id, store, exc) from exc
        write_deltalake(
            uri,
            data,
            mode="error",
            storage_options=options or None,
            description=f"Spark state of {store.label} at batch {batch_id} of {checkpoint}",
        )
        table = StateTable(
            operator_id=store.operator_id,
            operator_name=store.operator_name,
            store_name=store.store_name,
            path=store.path,
            rows=data.num_rows,
            partitions=store.partitions,
            state_var=store.state_var,
        )
        tables.append(table)
        log.info(
            "state of %s at batch %d: %d rows to %s in %.0f ms",
            store.label,
            batch_id,
            table.rows,
            uri,
            (time.monotonic() - started) * 1000,
        )
        if progress is not None:
            progress(i + 1, len(stores))
    log.info(
        "exported the state of %s at batch %d: %d tables, %d rows, to %s",
        checkpoint,
        batch_id,
        len(tables),
        sum(t.rows for t in tables),
        _fs.join(root, "state"),
    )
    return tables


#: Characters Spark's ``statestore`` reader cannot take in a checkpoint's path: it looks
#: for the batch under the path with them percent-encoded ("No committed batch found,
#: checkpoint location: file:///tmp/a%20b/chk"), where the query wrote: measured for a
#: space, '{' and '"' with PySpark 4.3; the rest are the others a URI must encode.
_UNREADABLE_STATE_PATH = frozenset(' "<>\\^`{|}')


def _check_state_readable(checkpoint: str) -> None:
    bad = sorted(set(checkpoint) & _UNREADABLE_STATE_PATH)
    if bad:
        raise ConfigError(
            f"the state of {checkpoint} cannot be exported: Spark's statestore reader does not "
            f"find the state of a checkpoint whose path has {' or '.join(map(repr, bad))} "
            "(it reads the path percent-encoded). Export without it (state='skip'), or "
            "run the query with a checkpointLocation without those characters"
        )


def _read_error(checkpoint: str, batch_id: int, store: _Store, exc: BaseException) -> ConfigError:
    message = (
        f"cannot read the state of {store.label} at batch {batch_id} from {checkpoint}: "
        f"{_describe(exc)}"
    )
    if _looks_unretained(exc):
        message += (
            f". Its state files look cleaned up: Spark's maintenance deletes the state of "
            f"batches older than the last {RETENTION_SETTING} (default 100) on its own "
            "schedule; export a later batch, or run the query with a larger "
            f"{RETENTION_SETTING} to keep more"
        )
    return ConfigError(message)
