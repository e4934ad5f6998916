"""The fast path's phase 1 after Spark's write: the attempt's folder, its data files and
their partition values as ``txn-delta`` spells them, each file measured (size, CRC32,
rows, Delta stats) a chunk at a time, as staged transactions."""

from __future__ import annotations

import logging
import os
import re
import time
import zlib
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import date
from typing import Any

from ..errors import ProtocolViolation, TxnError
from ..state import TxnHandle
from ..storage import fs as _fs
from .delta_stats import delta_stats
from .staging import (
    HIVE_NULL,
    data_file_prefix,
    fsync_folders,
    partition_value,
)

log = logging.getLogger(__name__)

# Spark writes a string partition value as this letter and the value: Spark writes
# the empty string and the text __HIVE_DEFAULT_PARTITION__ into null's folder, so
# without it they could not be told from null.
_TAG = "v"
# Spark's escape of a character in a folder name (ExternalCatalogUtils.escapePathName)
_ESCAPE = re.compile(r"%([0-9A-Fa-f]{2})")


def _is_string(t) -> bool:
    import pyarrow as pa

    return pa.types.is_string(t) or pa.types.is_large_string(t)


def spark_folder(sink_id: str, snapshot_id: int, token: str, attempt: str) -> str:
    """The folder of the table (relative to its root) Spark writes one attempt into.
    Its name starts with the attempt's data file prefix and is the attempt's alone:
    every file under it is the attempt's (``DeltaTarget`` lists it whole, through the
    marker that names it)."""
    return f"{data_file_prefix(sink_id, snapshot_id, token)}00000-{attempt}"


def _is_data_file(folders: Sequence[str], name: str) -> bool:
    return (
        name.startswith("part-")
        and name.endswith(".parquet")
        and not any(f.startswith(("_", ".")) for f in folders)
    )


def _spark_output(
    fs, out: str, columns: Sequence[tuple[str, Any]]
) -> tuple[list[tuple[str, dict[str, str | None], int]], list[str]]:
    """Spark's data files under ``out`` (sorted, each with its partition values as
    ``txn-delta`` spells them, and its size), and everything else there: Spark's own
    files (``_SUCCESS``, ``.crc``, ``_temporary/``), which are no data files."""
    if not fs.exists(out):
        return [], []
    top = out.rstrip("/") + "/"
    data, other = [], []
    for path, info in sorted(fs.find(out, detail=True).items()):
        rel = path[len(top) :] if path.startswith(top) else path
        *folders, name = rel.split("/")
        if not _is_data_file(folders, name):
            other.append(path)
            continue
        if len(folders) != len(columns):
            raise ProtocolViolation(
                f"Spark's output file {rel} is not in one folder per partition column "
                f"{[c for c, _ in columns]}"
            )
        values: dict[str, str | None] = {}
        for folder, (column, t) in zip(folders, columns, strict=True):
            key, sep, raw = folder.partition("=")
            if not sep or _unescape(key) != column:
                raise ProtocolViolation(
                    f"Spark's output folder {folder!r} is not one of partition column {column!r}"
                )
            values[column] = _folder_value(column, raw, t)
        data.append((path, values, int(info.get("size") or 0)))
    return data, other


def collect_spark_output(
    fs, root: str, out_rel: str, columns: Sequence[tuple[str, Any]], file_schema, local: bool
) -> list[TxnHandle]:
    """The handles of the files Spark's write left in the table's folder ``out_rel``
    (relative to ``root``), files written in place: nothing is copied or renamed.

    Whatever else Spark left there (``_temporary/``, ``.crc``, ``_SUCCESS``) and the
    schema-only file of an empty batch are removed first, so once the batch is
    committed its folder holds exactly its committed files; a crash before that leaves
    them in the attempt's folder, which its marker names. Each file is read once for
    its CRC32 and footer (rows, Delta stats), in parallel, and fsynced with its folders
    (local disks)."""
    out = _fs.join(root, out_rel)
    found, other = _spark_output(fs, out, columns)
    if other:
        log.debug("removing Spark's files that are no data files: %s", other)
        fs.rm(other)  # (files only: find lists no folders)
        _fs.remove_tree(fs, _fs.join(out, "_temporary"))
    top = root.rstrip("/") + "/"
    moves = [
        _Move(p[len(top) :] if p.startswith(top) else p, values, _spark_partition(p))
        for p, values, _ in found
    ]
    with ThreadPoolExecutor(min(8, max(1, 2 * len(moves) if local else len(moves)))) as pool:
        # Local disks: each file's fsync (waiting for the disk to take Spark's dirty
        # pages) runs beside its read for CRC32 (from the page cache), not after it;
        # both are done before any handle is returned.
        synced = [pool.submit(_fsync_file, _fs.join(root, m.rel)) for m in moves] if local else []
        measured = [pool.submit(_measure, fs, root, m, local, file_schema, False) for m in moves]
        handles = [f.result() for f in measured]
        for f in synced:
            f.result()
    empty = [h for h in handles if h.rows == 0]
    if empty:  # Spark writes a schema-only file for an empty batch: never committed
        fs.rm([_fs.join(root, h.handle) for h in empty])
    handles = [h for h in handles if h.rows > 0]
    if not handles:
        _fs.remove_tree(fs, out)
        return []
    if local:
        fsync_folders(root, {os.path.dirname(h.handle) for h in handles})
    return handles


def _unescape(text: str) -> str:
    """Spark's ``unescapePathName``: ``%XX`` is the character XX (Spark escapes only
    ASCII characters, and every ``%``; others are in the name as they are)."""
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), text)


def _folder_value(column: str, raw: str, t) -> str | None:
    """A partition value of a Spark folder name, spelled by ``partition_value`` from the
    Python value txn-delta would have (so both write the same string)."""
    if raw == HIVE_NULL:  # null (and the empty string: Spark writes it as null)
        return None
    import pyarrow as pa

    text = _unescape(raw)
    value: Any
    if _is_string(t):
        if not text.startswith(_TAG):
            raise ProtocolViolation(f"Spark's folder value {raw!r} of {column!r} lacks its tag")
        value = text[len(_TAG) :]
    elif pa.types.is_boolean(t):
        if text not in ("true", "false"):
            raise ProtocolViolation(f"Spark's folder value {raw!r} of {column!r} is no boolean")
        value = text == "true"
    elif pa.types.is_date32(t):
        try:
            value = date.fromisoformat(text)
        except ValueError:  # txn-delta fails on such a date as well (no Python date)
            raise TxnError(
                f"column {column!r}: Spark wrote the partition value {text!r}, which is not "
                "a date of the years 1 to 9999 that the Delta log can hold; filter such "
                "rows out before the sink"
            ) from None
    else:
        value = int(text)
    return partition_value(value)


def _spark_partition(path: str) -> int:
    """The task partition in Spark's file name ``part-00003-<uuid>-c000...``."""
    parts = os.path.basename(path).split("-")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


@dataclass(frozen=True)
class _Move:
    """One of Spark's files in the table (relative to the root)."""

    rel: str
    values: Mapping[str, str | None]
    partition: int


# Bytes read at a time for a staged file's CRC32: a file is never whole in the driver's
# memory (Spark's files reach 8M rows; up to 8 are measured at once).
_CHUNK = 4 << 20


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _measure(fs, root: str, move: _Move, local: bool, schema, fsync: bool = True) -> TxnHandle:
    """Size, CRC32, rows and Delta stats of one staged file: the CRC32 over the bytes
    read a chunk at a time (into one buffer), the footer read by itself (its end of the
    file only). On local disks ``fsync`` syncs the file too; the caller that passes False
    syncs it itself."""
    import pyarrow.parquet as pq

    path = _fs.join(root, move.rel)
    crc, size = 0, 0
    with open(path, "rb", buffering=0) if local else fs.open(path, "rb") as f:
        if local:  # one buffer for every chunk: no fresh 4 MiB per read
            buffer = bytearray(max(1, min(_CHUNK, os.fstat(f.fileno()).st_size)))
            view = memoryview(buffer)
            while n := f.readinto(buffer):
                crc = zlib.crc32(view[:n], crc)
                size += n
            if fsync:
                os.fsync(f.fileno())
        else:
            while chunk := f.read(_CHUNK):
                crc = zlib.crc32(chunk, crc)
                size += len(chunk)
        f.seek(0)
        metadata = pq.ParquetFile(f).metadata
    return TxnHandle(
        partition=move.partition,
        handle=move.rel,
        rows=metadata.num_rows,
        bytes=size,
        checksum=f"crc32:{crc:08x}",
        meta={
            "partition_values": dict(move.values),
            "stats": delta_stats(metadata, schema),
            "mtime": int(time.time() * 1000),
        },
    )
