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
from .delta_stats import (  # noqa: F401 (re-exported: callers import them from here)
    _string_max,
    _string_min,
    delta_stats,
)
from .masked_nulls import (
    fill_masked_nulls,
    has_nested_required,
)

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
        self,
        cfg: StagingConfig,
        snapshot_id: int,
        token: str,
        partition: int,
        schema,
        attempt: str | None = None,
        marked: Iterable[str] = (),
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
        self.attempt = attempt or uuid.uuid4().hex[:8]
        # folders whose marker the caller wrote already (as marker_name(partition,
        # attempt, k), k counting from 0), durably, before this attempt writes there
        self.marked: set[str] = set(marked)
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
    *,
    attempt: str | None = None,
    marked: Iterable[str] = (),
) -> list[TxnHandle]:
    """Write every batch of one partition; return the staged files' handles.

    ``attempt`` and ``marked``: the task attempt's id and the folders whose markers the
    caller wrote for it already (the fast path writes the table root's while its probe
    job runs); by default a fresh id and no marker yet."""
    stager = PartitionStager(cfg, snapshot_id, token, partition, schema, attempt, marked)
    try:
        for batch in batches:
            stager.add(batch)
        return stager.finish()
    finally:
        stager.close()
