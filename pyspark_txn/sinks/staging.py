"""Phase 1 for Delta targets: stage a partition's rows as parquet files.

Staged files live inside the table directory under
``txn-staged/<sink id>/<snapshot id>-<token>/``: invisible to readers until phase 2
adds them to the Delta log, removable by anyone who knows the snapshot id,
and (no leading underscore) cleaned by VACUUM if ever left behind.

Throughput: the task's thread keeps receiving rows from the JVM while one
encoder thread per partition writes the previous row group (pyarrow encodes
without the GIL), so encoding overlaps the transfer instead of following it.
Memory: one filling row group per open file plus one row group being encoded;
files roll over at ``target_file_rows``. Dictionary encoding is
used only for string and binary columns: for numbers it costs half the
encoding time and rarely pays off.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import date
from typing import Any

from .. import _fs
from ..state import TxnHandle

log = logging.getLogger(__name__)

STAGING_ROOT = "txn-staged"
PARQUET_CODECS = ("snappy", "zstd", "lz4", "gzip", "none")


def snapshot_dir(sink_id: str, snapshot_id: int, token: str) -> str:
    """Relative to the table root: one folder per allocation (id zero-padded so names sort,
    token so that two sinks sharing an id never share a folder)."""
    name = f"{snapshot_id:012d}-{token}" if token else f"{snapshot_id:012d}"
    return f"{STAGING_ROOT}/{sink_id}/{name}"


def parse_snapshot_dir(name: str) -> tuple[int, str] | None:
    """``(snapshot id, token)`` of a folder made by :func:`snapshot_dir`, else None."""
    base = name.rstrip("/").rsplit("/", 1)[-1]
    sid, _, token = base.partition("-")
    if not sid.isdigit() or not (token.isalnum() or token == ""):
        return None
    return int(sid), token


@dataclass(frozen=True)
class StagingConfig:
    """Everything an executor needs to stage; plain data, pickled into every task."""

    table_uri: str
    sink_id: str
    partition_by: tuple[str, ...] = ()
    fs_options: tuple[tuple[str, Any], ...] = ()
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


def _partition_value(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, date):
        return v.isoformat()
    return str(v)


def _stat_value(field_type, v: Any) -> Any:
    import pyarrow as pa

    t = field_type
    if pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t):
        return v
    if pa.types.is_floating(t):
        return None if v != v else v  # NaN bounds are useless for skipping
    if pa.types.is_date32(t):
        return v.isoformat()
    return None  # timestamps, decimals, binary...: no min/max rather than a wrong one


def delta_stats(metadata, schema) -> str:
    """Delta ``stats`` JSON from a parquet footer: numRecords, nullCount, safe min/max."""
    mins: dict[str, Any] = {}
    maxs: dict[str, Any] = {}
    nulls: dict[str, int] = {}
    by_name = {f.name: f for f in schema}
    for rg_index in range(metadata.num_row_groups):
        rg = metadata.row_group(rg_index)
        for ci in range(rg.num_columns):
            col = rg.column(ci)
            name = col.path_in_schema
            field = by_name.get(name)
            if field is None:  # nested leaf
                continue
            st = col.statistics
            if st is None:
                nulls.pop(name, None)
                by_name.pop(name)  # unknown for one row group: unknown for the file
                mins.pop(name, None)
                maxs.pop(name, None)
                continue
            nulls[name] = nulls.get(name, 0) + st.null_count
            if st.has_min_max:
                lo = _stat_value(field.type, st.min)
                hi = _stat_value(field.type, st.max)
                if lo is not None and hi is not None:
                    mins[name] = lo if name not in mins else min(mins[name], lo)
                    maxs[name] = hi if name not in maxs else max(maxs[name], hi)
    return json.dumps(
        {
            "numRecords": metadata.num_rows,
            "minValues": mins,
            "maxValues": maxs,
            "nullCount": nulls,
        },
        separators=(",", ":"),
    )


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
        self.writer = None
        self.file = None
        self.path = ""
        self.file_rows = 0

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
            self.path, raw = self.stager.open_new_file()
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


def _dictionary_columns(schema) -> list[str] | bool:
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
        self.dictionary_columns = _dictionary_columns(self.file_schema)
        self.table_root = cfg.table_uri
        self.fs, self.fs_root = _fs.filesystem(cfg.table_uri, dict(cfg.fs_options))
        self.local = _fs.is_local(cfg.table_uri)
        self.rel_dir = snapshot_dir(cfg.sink_id, snapshot_id, token)
        self.attempt = uuid.uuid4().hex[:8]
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

    def open_new_file(self):
        name = f"part-{self.partition:05d}-{self.attempt}-{self.files_opened:04d}.parquet"
        self.files_opened += 1
        rel = f"{self.rel_dir}/{name}"
        full = _fs.join(self.fs_root, rel)
        if self.local:
            os.makedirs(os.path.dirname(full), exist_ok=True)
            return rel, open(full, "wb")
        self.fs.makedirs(_fs.join(self.fs_root, self.rel_dir), exist_ok=True)
        return rel, self.fs.open(full, "wb")

    def add(self, batch) -> None:
        if batch.num_rows == 0:
            return
        if not batch.schema.equals(self.schema):
            batch = batch.cast(self.schema)
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
                    c: _partition_value(v) for c, v in zip(self.cfg.partition_by, key, strict=True)
                }
                out = self.outputs[key] = _RollingFile(self, values)
            out.add(part.select([f.name for f in self.file_schema]))

    def finish(self) -> list[TxnHandle]:
        for out in self.outputs.values():
            out.finish()
        self.wait()
        if self.local and self.handles:
            _fs.fsync_dir(_fs.join(self.fs_root, self.rel_dir))
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
