"""Copying a committed snapshot: pin the record and the Delta version that holds its data,
then copy the target table as of that version into a standalone Delta table."""

from __future__ import annotations

import json
import os
import shutil
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import unquote

from ...errors import ConfigError, CorruptSnapshotError, StorageError
from ...state import SinkState, SnapshotRecord
from ...storage import fs as _fs
from ...storage.options import (
    StorageOptions,
    current,
    describe_store_error,
    takes_storage_options,
)
from ..handle import SinkHandle
from ..state_export import has_state
from ..verify import byte_progress, crc32_of
from .location import STATE_CHOICES, _check_name_free, _check_to, _inspect_location
from .registry import CHUNK_BYTES, Progress, _open


def _pin(state: SinkState, target: Any, snapshot: int | None) -> tuple[SnapshotRecord, int]:
    """The committed record to export and the target version that holds its data.

    A batch that wrote no rows is a snapshot too (its offsets and operator
    state moved on): it pins the version of the newest earlier batch that
    made a commit, since the table did not change in between.
    """
    records = sorted(state.records.values(), key=lambda r: r.snapshot_id, reverse=True)
    if snapshot is not None:
        ids = [r.snapshot_id for r in records]
        if snapshot not in ids:
            raise ConfigError(
                f"sink {state.sink_id!r} has no kept record of snapshot {snapshot} (it was "
                "never recorded, was abandoned, or retention summarized it away)"
            )
        records = records[ids.index(snapshot) :]
    pinned: SnapshotRecord | None = None
    for rec in records:
        version = state.committed.get(rec.snapshot_id)
        if version is None:  # not confirmed yet: its commit stamp in the target (an empty
            # first batch's commit creates the table)
            version = target.committed_version(rec)
        if pinned is None:
            if version is None and rec.txns:  # its phase 2 has not landed (yet)
                if snapshot is not None:
                    raise ConfigError(
                        f"snapshot {snapshot} of sink {state.sink_id!r} is not committed"
                    )
                continue
            pinned = rec
        if version is not None:
            return pinned, version
    if pinned is not None:
        raise ConfigError(
            f"sink {state.sink_id!r}: batch {pinned.batch_id} (snapshot {pinned.snapshot_id}) "
            "and every kept batch before it wrote no rows: there is no table version to "
            "export yet"
        )
    raise ConfigError(f"sink {state.sink_id!r} has no committed snapshot to export yet")


def _state_session(handle: SinkHandle, state: str, spark: Any) -> Any:
    """The SparkSession that reads the query's state, or None when no state is exported."""
    if state not in STATE_CHOICES:
        raise ConfigError(f"state={state!r}: choose one of {', '.join(STATE_CHOICES)}")
    if state == "skip":
        return None
    checkpoint = handle.checkpoint
    stateful = checkpoint is not None and has_state(checkpoint, handle.storage)
    if not stateful:
        if state == "include":
            raise ConfigError(
                "state=include: "
                + (
                    f"the checkpoint {checkpoint} holds no operator state"
                    if checkpoint
                    else "give the query's checkpoint location, not its record table"
                )
            )
        return None
    if spark is None:
        from pyspark.sql import SparkSession

        spark = SparkSession.getActiveSession()
    if spark is None:
        raise ConfigError(
            f"the query at {checkpoint} is stateful: exporting its state tables needs a "
            "SparkSession (pass spark=...; the CLI starts a local one), or pass state='skip' "
            "(--state skip) to export the data and manifest only"
        )
    return spark


def _partition_string(value: Any) -> str | None:
    """A typed partition value as the Delta log writes it."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S.%f")
    return value.isoformat() if hasattr(value, "isoformat") else str(value)


def _copy(
    src_fs: Any, src: str, dst_fs: Any, dst: str, advance: Callable[[int], None]
) -> tuple[int, str]:
    """Copy one file; its size and the CRC32 of the bytes written."""
    from fsspec.implementations.local import LocalFileSystem

    crc = size = 0
    dst_fs.makedirs(dst.rsplit("/", 1)[0], exist_ok=True)
    if isinstance(src_fs, LocalFileSystem) and isinstance(dst_fs, LocalFileSystem):
        # the kernel copies (copy_file_range); the checksum reads the copy back
        shutil.copyfile(src, dst)
        return os.path.getsize(dst), crc32_of(dst_fs, dst, advance)
    with src_fs.open(src, "rb") as fin, dst_fs.open(dst, "wb") as fout:
        while chunk := fin.read(CHUNK_BYTES):
            fout.write(chunk)
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
            advance(len(chunk))
    return size, f"crc32:{crc:08x}"


@dataclass(frozen=True)
class TableCopy:
    """What :func:`copy_table` copied: every file with its size and CRC32."""

    files: list[list[Any]]  # [path, size, "crc32:…"]
    rows: int
    bytes: int

    @property
    def checksum(self) -> str:
        return f"crc32:{zlib.crc32(json.dumps(sorted(self.files)).encode()):08x}"


def copy_table(
    source_uri: str,
    version: int | None,
    dest_uri: str,
    *,
    storage_options: Mapping[str, str] | None = None,
    name: str | None = None,
    description: str | None = None,
    progress: Progress | None = None,
    check_owner: Callable[[], None] | None = None,
) -> TableCopy:
    """Copy a Delta table as of ``version`` into a new table at ``dest_uri``: the same
    files (checked against the log's sizes), partition values and schema, with
    statistics recomputed from the footers. The new log is written after every file.
    ``storage_options``: delta-rs options for both tables (default: those in effect).

    ``check_owner`` runs before each file and before the log, and raises when the
    destination is no longer this copy's (an export replaced meanwhile stops there
    instead of overwriting its replacement's files)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError
    from deltalake.transaction import AddAction, create_table_with_add_actions

    from ...sinks.staging import delta_stats

    options = dict(storage_options or {}) or current().for_delta()
    try:
        source = DeltaTable(source_uri, version=version, storage_options=options)
    except Exception as e:
        problem = describe_store_error(e) or f"{type(e).__name__}: {e}"
        if not isinstance(e, TableNotFoundError) and not problem.startswith("the store failed"):
            # credentials, endpoint, permissions: the table may be intact
            raise StorageError(f"{source_uri}: {problem}") from None
        at = "its latest version" if version is None else f"version {version}"
        raise CorruptSnapshotError(
            f"the table {source_uri} cannot be read at {at}: {problem}"
        ) from e
    adds = pa.table(source.get_add_actions(flatten=False)).to_pylist()
    if any(a.get("deletionVector") or a.get("deletion_vector") for a in adds):
        raise ConfigError(
            f"{source_uri} at version {version} has deletion vectors: copying them is not "
            "supported yet"
        )
    total = sum(a["size_bytes"] for a in adds)
    advance = byte_progress(total, progress)
    src_fs, src_root = _fs.filesystem(source_uri)
    fs, root = _fs.filesystem(dest_uri)
    files, actions, rows = [], [], 0
    for a in adds:
        if check_owner is not None:
            check_owner()
        rel = unquote(a["path"])
        try:
            size, crc = _copy(src_fs, _fs.join(src_root, rel), fs, _fs.join(root, rel), advance)
        except FileNotFoundError as e:
            raise CorruptSnapshotError(
                f"{source_uri} at version {version}: its file {rel} is gone (a VACUUM with a "
                "retention shorter than the snapshot's age removes the files of older "
                "versions; OPTIMIZE rewrites them first): this version can no longer be "
                "copied. Export a newer snapshot, and keep VACUUM's retention longer than "
                "the exports you may still want"
            ) from e
        if size != a["size_bytes"]:
            raise CorruptSnapshotError(
                f"{rel}: the log says {a['size_bytes']} bytes, the file has {size}"
            )
        with fs.open(_fs.join(root, rel), "rb") as f:
            footer = pq.ParquetFile(f)
            stats = delta_stats(footer.metadata, footer.schema_arrow)
            rows += footer.metadata.num_rows
        files.append([a["path"], size, crc])
        actions.append(
            AddAction(
                rel,  # delta-rs percent-encodes it into the log, as the source log has it
                size,
                {k: _partition_string(v) for k, v in (a.get("partition") or {}).items()},
                int(a["modification_time"]),
                True,
                stats,
            )
        )
    if check_owner is not None:
        check_owner()
    # the table's properties go with it (a restored upsert target must still record its
    # change data feed: its sink and its readers say so), but for column mapping, which
    # the copy does not carry (its files are read back by name)
    properties = {
        k: v
        for k, v in (source.metadata().configuration or {}).items()
        if not k.startswith("delta.columnMapping.")
    }
    create_table_with_add_actions(
        dest_uri,
        source.schema(),
        actions,
        mode="error",
        partition_by=list(source.metadata().partition_columns) or None,
        name=name,
        description=description,
        configuration=properties or None,
        storage_options=options,
    )
    return TableCopy(files, rows, total)


def _check_destination(
    handle: SinkHandle, sink_state: SinkState, name: str, to: str, replace_unfinished: bool
) -> None:
    """The name is free and ``to`` is a place of its own: new, empty or a dead export's
    partial copy (writes nothing)."""
    _check_name_free(sink_state, name)
    uri = _check_to(handle, to, sink_state)
    fs, root = _fs.filesystem(uri)
    _inspect_location(fs, root, handle, uri, replace_unfinished)


@takes_storage_options
def check_export(
    location: str,
    name: str,
    to: str,
    snapshot: int | None = None,
    *,
    sink: str | None = None,
    replace_unfinished: bool = False,
    batch: int | None = None,
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> tuple[SnapshotRecord, int]:
    """Every check of :func:`export` that needs no Spark and writes nothing: the name
    is free, ``to`` is a place of its own that is new, empty or a dead export's
    partial copy, and there is a committed snapshot. Returns what it pins."""
    handle = _open(location, sink, "snapshots export")
    sink_state = handle.load()
    _check_destination(handle, sink_state, name, to, replace_unfinished)
    if batch is not None:
        if snapshot is not None:
            raise ConfigError("snapshot= and batch= exclude each other: give one")
        snapshot = _snapshot_of_batch(sink_state, batch)
    return _pin(sink_state, handle.target(), snapshot)


def _snapshot_of_batch(state: SinkState, batch: int) -> int:
    """The snapshot id of the kept record of Spark's batch ``batch`` (the last, if the
    batch was recorded more than once)."""
    ids = [r.snapshot_id for r in state.records.values() if r.batch_id == batch]
    if not ids:
        kept = sorted(r.batch_id for r in state.records.values())
        raise ConfigError(
            f"sink {state.sink_id!r} has no kept record of batch {batch}"
            + (f" (kept: batches {kept[0]} to {kept[-1]})" if kept else " (no batch recorded)")
        )
    return max(ids)
