"""Phase 1 for Delta targets: stage a partition's rows as parquet files.

Data files are written where Delta readers expect them: the table root, or
``col=value/`` folders for partitioned tables, named
``part-<sink id>-<snapshot id>-<token>-<partition>-<attempt>-<n>.parquet``. They
are invisible to readers until phase 2 adds them to the Delta log. Before a
task creates the first file in a folder it writes a *marker* naming that
folder into ``txn-staged/<sink id>/<snapshot id>-<token>/``, so every file of an
attempt (of a crashed task too) is found by listing its markers' folders for
the attempt's name prefix. Leftovers have no leading underscore, so a full
VACUUM removes them too if we never get to.

Throughput: the task's thread keeps receiving rows from the JVM while one
encoder thread per partition writes the previous row group (pyarrow encodes
without the GIL), so encoding overlaps the transfer instead of following it.
Memory: one filling row group per open file plus one row group being encoded;
files roll over at ``target_file_rows``. Dictionary encoding is
used only for string and binary columns: for numbers it costs half the
encoding time and rarely pays off.
"""

from __future__ import annotations

import decimal
import json
import logging
import os
import time
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import date
from typing import Any, Literal

from ..state import TxnHandle
from ..storage import fs as _fs
from ..storage.options import StorageOptions

log = logging.getLogger(__name__)

STAGING_ROOT = "txn-staged"
PARQUET_CODECS = ("snappy", "zstd", "lz4", "gzip", "none")


def snapshot_dir(sink_id: str, snapshot_id: int, token: str) -> str:
    """The attempt's folder in the staging area, relative to the table root (id zero-padded
    so names sort, token so that two sinks sharing an id never share a folder). It holds
    the attempt's *markers*; the data files live where Delta readers expect them."""
    name = f"{snapshot_id:012d}-{token}" if token else f"{snapshot_id:012d}"
    return f"{STAGING_ROOT}/{sink_id}/{name}"


def parse_snapshot_dir(name: str) -> tuple[int, str] | None:
    """``(snapshot id, token)`` of a folder made by :func:`snapshot_dir`, else None."""
    base = name.rstrip("/").rsplit("/", 1)[-1]
    sid, _, token = base.partition("-")
    if not sid.isdigit() or not (token.isalnum() or token == ""):
        return None
    return int(sid), token


def data_file_prefix(sink_id: str, snapshot_id: int, token: str) -> str:
    """Every data file of one attempt starts with this name, in whatever folder it is."""
    return f"part-{sink_id}-{snapshot_id:012d}-{token}-"


MARKER_SUFFIX = ".dir"
HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"
_PATH_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def marker_name(partition: int, attempt: str, k: int) -> str:
    """The ``k``-th marker of task attempt ``<partition>-<attempt>``."""
    return f"{partition:05d}-{attempt}-{k:04d}{MARKER_SUFFIX}"


def write_marker(fs, path: str, rel_dir: str, local: bool) -> None:
    """Write a marker naming ``rel_dir`` (relative to the table root; "" is the root),
    durably, before the first file of its attempt goes into that folder."""
    if local:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(rel_dir)
            f.flush()
            os.fsync(f.fileno())
        _fs.fsync_dir(os.path.dirname(path))
        return
    fs.makedirs(os.path.dirname(path), exist_ok=True)
    with fs.open(path, "w") as f:
        f.write(rel_dir)


def fsync_folders(root: str, rel_dirs: Iterable[str]) -> None:
    """Make the entries of files in ``rel_dirs`` durable (local disks), and those of the
    folders themselves: every folder up to the table root, which is synced last."""
    folders: set[str] = set()
    for rel_dir in rel_dirs:
        parts = [p for p in rel_dir.split("/") if p]
        folders.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    for rel in sorted(folders, key=lambda d: -d.count("/")):  # deepest first
        _fs.fsync_dir(_fs.join(root, rel))
    _fs.fsync_dir(root)


def hive_dir(partition_values: Mapping[str, str | None]) -> str:
    """``col=value/...`` with every byte outside ``[A-Za-z0-9._-]`` percent-encoded (as
    delta-rs writes them), null as Hive's default partition."""

    def enc(text: str) -> str:
        return "".join(
            c if c in _PATH_SAFE else "".join(f"%{b:02X}" for b in c.encode()) for c in text
        )

    return "/".join(
        f"{enc(col)}={HIVE_NULL if v is None else enc(v)}" for col, v in partition_values.items()
    )


@dataclass(frozen=True)
class StagingConfig:
    """Everything an executor needs to stage; plain data, pickled into every task."""

    table_uri: str
    sink_id: str
    partition_by: tuple[str, ...] = ()
    storage: StorageOptions = field(default_factory=StorageOptions)
    row_group_rows: int = 1_000_000
    row_group_bytes: int = 128 << 20
    compression: str = "snappy"
    target_file_rows: int = 8_000_000


class _ChecksumWriter:
    """A write-only file that CRCs every byte on the way out and fsyncs on close."""

    def __init__(self, raw, local: bool) -> None:
        self.raw = raw
        self.local = local
        self.crc = 0
        self.size = 0
        self.closed = False

    def write(self, data) -> int:
        self.crc = zlib.crc32(data, self.crc)
        self.size += len(data)
        return self.raw.write(data)

    def flush(self) -> None:
        self.raw.flush()

    def tell(self) -> int:
        return self.size

    def close(self) -> None:
        if self.closed:
            return
        self.raw.flush()
        if self.local:
            os.fsync(self.raw.fileno())
        self.raw.close()
        self.closed = True

    @property
    def checksum(self) -> str:
        return f"crc32:{self.crc:08x}"


def partition_value(v: Any) -> str | None:
    """A partition value as the Delta log spells it. An empty string is null there (the
    protocol's rule, and what Spark writes), so it is written as null."""
    if v is None or v == "":
        return None
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, date):
        return v.isoformat()
    return str(v)


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
    from datetime import date, datetime, timedelta

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


class _RollingFile:
    """One partition value's output: buffered row groups, rolling files.

    ``add`` runs on the task's thread; ``_write`` and ``_close_file`` run on
    the stager's encoder thread, in submission order.
    """

    def __init__(self, stager: PartitionStager, partition_values: dict[str, str | None]) -> None:
        self.stager = stager
        self.partition_values = partition_values
        self.buffer: list = []
        self.buffered_rows = 0
        self.buffered_bytes = 0
        self.writer: Any = None  # pq.ParquetWriter of the open file
        self.file: Any = None
        self.path = ""
        self.file_rows = 0
        self.rel_dir = hive_dir(partition_values)

    def add(self, batch) -> None:
        self.buffer.append(batch)
        self.buffered_rows += batch.num_rows
        self.buffered_bytes += batch.nbytes
        cfg = self.stager.cfg
        if self.buffered_rows >= cfg.row_group_rows or self.buffered_bytes >= cfg.row_group_bytes:
            self.flush()

    def flush(self) -> None:
        import pyarrow as pa

        if not self.buffered_rows:
            return
        table = pa.Table.from_batches(self.buffer, schema=self.stager.file_schema)
        self.buffer, self.buffered_rows, self.buffered_bytes = [], 0, 0
        self.stager.submit(lambda: self._write(table))

    def _write(self, table) -> None:
        import pyarrow.parquet as pq

        if self.writer is None:
            self.path, raw = self.stager.open_new_file(self.rel_dir)
            self.file = _ChecksumWriter(raw, self.stager.local)
            self.writer = pq.ParquetWriter(
                self.file,
                self.stager.file_schema,
                use_dictionary=self.stager.dictionary_columns,
                compression=self.stager.cfg.compression,
            )
        self.writer.write_table(table, row_group_size=max(table.num_rows, 1))
        self.file_rows += table.num_rows
        if self.file_rows >= self.stager.cfg.target_file_rows:
            self._close_file()

    def _close_file(self) -> None:
        if self.writer is None:
            return
        self.writer.close()
        self.file.close()
        metadata = self.writer.writer.metadata
        self.stager.handles.append(
            TxnHandle(
                partition=self.stager.partition,
                handle=self.path,
                rows=metadata.num_rows,
                bytes=self.file.size,
                checksum=self.file.checksum,
                meta={
                    "partition_values": self.partition_values,
                    "stats": delta_stats(metadata, self.stager.file_schema),
                    "mtime": int(time.time() * 1000),
                },
            )
        )
        self.writer = self.file = None
        self.file_rows = 0

    def finish(self) -> None:
        self.flush()
        self.stager.submit(self._close_file)

    def abandon(self) -> None:
        """Release an unfinished file after a failure; abort or recovery deletes it."""
        if self.writer is None:
            return
        try:
            self.writer.close()
        except Exception:  # already failing: the first error is the one to report
            log.debug("closing an abandoned staged file failed", exc_info=True)
        self.file.raw.close()
        self.writer = self.file = None


def dictionary_columns(schema) -> list[str] | Literal[False]:
    """The top-level columns worth dictionary encoding: strings and binaries. Both Delta
    writers (this one and the fast path's Spark writer) use the same rule, so a table
    gets the same files whichever path wrote it."""
    import pyarrow as pa

    names = [
        f.name
        for f in schema
        if pa.types.is_string(f.type)
        or pa.types.is_large_string(f.type)
        or pa.types.is_binary(f.type)
        or pa.types.is_large_binary(f.type)
    ]
    return names or False


class PartitionStager:
    """Stages one Spark partition of one snapshot. Use :func:`stage_partition`."""

    def __init__(
        self, cfg: StagingConfig, snapshot_id: int, token: str, partition: int, schema
    ) -> None:
        import pyarrow as pa

        self.cfg = cfg
        self.partition = partition
        self.schema = schema
        self.file_schema = pa.schema([f for f in schema if f.name not in cfg.partition_by])
        self.dictionary_columns = dictionary_columns(self.file_schema)
        self.fill_masked_nulls = has_nested_required(schema)
        self.table_root = cfg.table_uri
        self.fs, self.fs_root = _fs.filesystem(cfg.table_uri, cfg.storage)
        self.local = _fs.is_local(cfg.table_uri)
        self.marker_dir = snapshot_dir(cfg.sink_id, snapshot_id, token)
        self.prefix = data_file_prefix(cfg.sink_id, snapshot_id, token)
        self.attempt = uuid.uuid4().hex[:8]
        self.marked: set[str] = set()
        self.files_opened = 0
        self.handles: list[TxnHandle] = []
        self.outputs: dict[tuple, _RollingFile] = {}
        self._encoder = ThreadPoolExecutor(1, thread_name_prefix="txn-stage")
        self._pending: Future | None = None

    def submit(self, work: Callable[[], None]) -> None:
        """Run ``work`` on the encoder thread after the previous work finished.

        Waiting for the previous work first bounds memory to one row group in
        flight, and re-raises its error on the task's thread.
        """
        self.wait()
        self._pending = self._encoder.submit(work)

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Stop the encoder thread (also after a failure: nothing may write later)."""
        try:
            self.wait()
        finally:
            self._encoder.shutdown(wait=True)
            for out in self.outputs.values():  # files are left open only by a failure
                out.abandon()

    def _mark(self, rel_dir: str) -> None:
        """Record, before the first file is created in ``rel_dir``, that this attempt may
        write there: how aborts and sweeps find every file, even of a crashed task."""
        if rel_dir in self.marked:
            return
        name = marker_name(self.partition, self.attempt, len(self.marked))
        write_marker(self.fs, _fs.join(self.fs_root, self.marker_dir, name), rel_dir, self.local)
        self.marked.add(rel_dir)

    def open_new_file(self, rel_dir: str):
        self._mark(rel_dir)
        name = f"{self.prefix}{self.partition:05d}-{self.attempt}-{self.files_opened:04d}.parquet"
        self.files_opened += 1
        rel = f"{rel_dir}/{name}" if rel_dir else name
        full = _fs.join(self.fs_root, rel)
        if self.local:
            os.makedirs(os.path.dirname(full), exist_ok=True)
            return rel, open(full, "wb")
        if rel_dir:
            self.fs.makedirs(_fs.join(self.fs_root, rel_dir), exist_ok=True)
        return rel, self.fs.open(full, "wb")

    def add(self, batch) -> None:
        if batch.num_rows == 0:
            return
        if not batch.schema.equals(self.schema):
            batch = batch.cast(self.schema)
        if self.fill_masked_nulls:
            batch = fill_masked_nulls(batch)
        if not self.cfg.partition_by:
            out = self.outputs.get(())
            if out is None:
                out = self.outputs[()] = _RollingFile(self, {})
            out.add(batch)
            return
        for key, part in _split_by(batch, self.cfg.partition_by):
            out = self.outputs.get(key)
            if out is None:
                values = {
                    c: partition_value(v) for c, v in zip(self.cfg.partition_by, key, strict=True)
                }
                out = self.outputs[key] = _RollingFile(self, values)
            out.add(part.select([f.name for f in self.file_schema]))

    def finish(self) -> list[TxnHandle]:
        for out in self.outputs.values():
            out.finish()
        self.wait()
        if self.local:
            fsync_folders(self.fs_root, self.marked)
        return self.handles


def _split_by(batch, columns: tuple[str, ...]) -> Iterator[tuple[tuple, Any]]:
    import pyarrow as pa
    import pyarrow.compute as pc

    table = pa.Table.from_batches([batch])
    keys = table.select(list(columns)).group_by(list(columns)).aggregate([]).to_pylist()
    for key in keys:
        mask = None
        for c in columns:
            v = key[c]
            m = pc.is_null(table[c]) if v is None else pc.equal(table[c], v)
            mask = m if mask is None else pc.and_(mask, m)
        part = table.filter(mask)
        for b in part.to_batches():
            yield tuple(key[c] for c in columns), b


def stage_partition(
    batches: Iterable,
    cfg: StagingConfig,
    snapshot_id: int,
    token: str,
    partition: int,
    schema,
) -> list[TxnHandle]:
    """Write every batch of one partition; return the staged files' handles."""
    stager = PartitionStager(cfg, snapshot_id, token, partition, schema)
    try:
        for batch in batches:
            stager.add(batch)
        return stager.finish()
    finally:
        stager.close()


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
