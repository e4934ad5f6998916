""":func:`verify` (every mismatch between an export and its registry entry) and
:func:`delete` (a name and, when asked, its copy)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import unquote

from ...errors import ConfigError, TxnError
from ...state import SinkState, fold_sink
from ...state.core import (
    NamedSnapshot,
    delete_named,
)
from ...storage import fs as _fs
from ...storage.delta_tables import count_rows, read_rows
from ...storage.options import StorageOptions, current, takes_storage_options
from ..verify import byte_progress, crc32_of
from .copy import TableCopy
from .location import _EXPORT_PARTS, _read_marker, _relation, _remove_export
from .registry import Progress, _open, backup_of_part, show


@dataclass(frozen=True)
class ExportCheck:
    """``verify``'s answer: every mismatch between an export and its registry entry."""

    name: str
    location: str
    rows: int | None
    files: int
    problems: tuple[str, ...] = field(default_factory=tuple)
    readable: bool = True  # False: the data table could not be read at all

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "location": self.location,
            "ok": self.ok,
            "readable": self.readable,
            "rows": self.rows if self.readable else "unreadable",
            "files": self.files if self.readable else "unreadable",
            "problems": list(self.problems),
        }


@takes_storage_options
def verify(
    location: str,
    name: str,
    sink: str | None = None,
    progress: Progress | None = None,
    *,
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> ExportCheck:
    """Re-read the export and compare it with the registry entry: the data table's
    files with the same sizes and CRC32s and the same row count in their footers,
    every row of the manifest table, and each state table's files (sizes and CRC32s;
    entries written before those were recorded: the row count)."""
    sink_id = _open(location, sink, "snapshots verify").sink_id
    return verify_entry(show(location, name, sink, command="snapshots verify"), sink_id, progress)


def verify_entry(
    entry: NamedSnapshot, sink_id: str, progress: Progress | None = None
) -> ExportCheck:
    """:func:`verify` of an entry known without its sink (a backup's catalog holds its
    parts' entries). An entry without per-file CRC32s (a legacy backup's part read back
    from its manifest) has them derived from the files and checked, as a set, against the
    manifest's data checksum."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from deltalake import DeltaTable

    data_uri = _fs.join(entry.location, "data")
    problems: list[str] = []
    try:
        adds = pa.table(
            DeltaTable(data_uri, storage_options=current().for_delta()).get_add_actions(
                flatten=False
            )
        ).to_pylist()
    except Exception as e:
        problems = [f"{data_uri}: unreadable: {e}"]
        problems += _check_manifest(entry, sink_id)
        problems += _check_state_tables(entry)
        return ExportCheck(entry.name, entry.location, None, 0, tuple(problems), readable=False)
    fs, root = _fs.filesystem(data_uri)
    known = entry.details.get("files")
    derived: dict[str, str] = {}
    if known is None:  # derived: each file's size from the log, its CRC32 from its bytes
        for a in adds:
            try:
                derived[a["path"]] = crc32_of(fs, _fs.join(root, unquote(a["path"])), _no_progress)
            except FileNotFoundError:
                derived[a["path"]] = "missing"
        known = [[a["path"], a["size_bytes"], derived[a["path"]]] for a in adds]
        checksum = TableCopy(known, 0, 0).checksum
        if checksum != entry.details.get("data_checksum"):
            problems.append(
                f"{data_uri}: its files' checksum is {checksum}, the manifest says "
                f"{entry.details.get('data_checksum')}"
            )
    expected = {path: (size, crc) for path, size, crc in known}
    listed = {a["path"] for a in adds}
    for path in sorted(set(expected) - listed):
        problems.append(f"{path}: missing from the exported table's log")
    for path in sorted(listed - set(expected)):
        problems.append(f"{path}: in the exported table but not in the snapshot")
    advance = byte_progress(sum(size for size, _ in expected.values()), progress)
    rows = 0

    for path in sorted(set(expected) & listed):
        size, crc = expected[path]
        full = _fs.join(root, unquote(path))
        try:
            got_size = fs.info(full)["size"]
        except FileNotFoundError:
            problems.append(f"{path}: file is missing")
            advance(size)
            continue
        if got_size != size:
            problems.append(f"{path}: {got_size} bytes, the snapshot says {size}")
            advance(size)
            continue
        if path in derived:
            advance(size)
            got = derived[path]
        else:
            got = crc32_of(fs, full, advance)
        if got != crc:
            problems.append(f"{path}: CRC32 {got}, the snapshot says {crc}")
            continue
        with fs.open(full, "rb") as f:
            rows += pq.ParquetFile(f).metadata.num_rows
    if not problems and rows != entry.details.get("rows"):
        problems.append(f"{rows} rows in the files, the snapshot says {entry.details.get('rows')}")
    problems.extend(_check_manifest(entry, sink_id))
    problems.extend(_check_state_tables(entry))
    problems.extend(_check_tombstones(entry))
    return ExportCheck(entry.name, entry.location, rows, len(listed), tuple(problems))


def _check_tombstones(entry: NamedSnapshot) -> list[str]:
    """An upserting sink's tombstones exported with the snapshot: every file, size, CRC32."""
    kept = entry.details.get("tombstones")
    if not kept:
        return []
    return _check_files(_fs.join(entry.location, kept["path"]), kept["path"], kept["files"])


def _no_progress(_n: int) -> None:
    pass


def _check_manifest(entry: NamedSnapshot, sink_id: str) -> list[str]:
    """Every row of ``<to>/manifest`` says what the registry entry says."""
    uri = _fs.join(entry.location, "manifest")
    try:
        rows = read_rows(uri)
    except Exception as e:
        return [f"{uri}: unreadable manifest: {e}"]
    d = entry.details
    offsets = list(d.get("source_offsets") or []) or [None]
    problems = []
    if len(rows) != len(offsets):
        problems.append(
            f"manifest: {len(rows)} rows, the snapshot has {len(offsets)} source(s) (one row each)"
        )
    state_tables = list(d.get("state_tables") or [])
    expected_all = {
        "name": entry.name,
        "snapshot_id": entry.snapshot_id,
        "of_snapshot_id": entry.of_snapshot_id,
        "batch_id": entry.batch_id,
        "sink_id": sink_id,
        "query_id": d.get("query_id"),
        "table_version": entry.target_version,
        "rows": d.get("rows"),
        "files": len(d["files"]) if "files" in d else d.get("file_count"),
        "bytes": d.get("bytes"),
        "data_checksum": d.get("data_checksum"),
    }
    for row in sorted(rows, key=lambda r: (r.get("source_index") is None, r.get("source_index"))):
        i = row.get("source_index")
        where = f"manifest row of source {i}"
        if not isinstance(i, int) or not 0 <= i < len(offsets):
            problems.append(f"manifest: a row names source {i!r}, the snapshot has {len(offsets)}")
            continue
        expected = {
            **expected_all,
            "source_offset": json.dumps(offsets[i], sort_keys=True),
        }
        for key, want in expected.items():
            if row.get(key) != want:
                problems.append(f"{where}: {key} is {row.get(key)!r}, the snapshot says {want!r}")
        try:
            got_state = json.loads(row.get("state_tables") or "[]")
        except ValueError:
            got_state = row.get("state_tables")
        if got_state != state_tables:
            problems.append(f"{where}: state_tables differ from the snapshot's")
    return problems


def _check_files(uri: str, label: str, files: list[list[Any]]) -> list[str]:
    """The table at ``uri`` lists exactly ``files``, each with its recorded size and CRC32."""
    import pyarrow as pa
    from deltalake import DeltaTable

    try:
        listed = set(
            pa.table(
                DeltaTable(uri, storage_options=current().for_delta()).get_add_actions(
                    flatten=False
                )
            ).column("path")
        )
        listed = {str(p) for p in listed}
    except Exception as e:
        return [f"{label}: unreadable table: {e}"]
    fs, root = _fs.filesystem(uri)
    expected = {path: (size, crc) for path, size, crc in files}
    problems = [
        f"{label}/{p}: missing from the table's log" for p in sorted(set(expected) - listed)
    ]
    problems += [
        f"{label}/{p}: in the table but not in the snapshot" for p in sorted(listed - set(expected))
    ]
    for path in sorted(set(expected) & listed):
        size, crc = expected[path]
        full = _fs.join(root, unquote(path))
        try:
            got_size = fs.info(full)["size"]
        except FileNotFoundError:
            problems.append(f"{label}/{path}: file is missing")
            continue
        if got_size != size:
            problems.append(f"{label}/{path}: {got_size} bytes, the snapshot says {size}")
            continue
        got = crc32_of(fs, full, lambda _n: None)
        if got != crc:
            problems.append(f"{label}/{path}: CRC32 {got}, the snapshot says {crc}")
    return problems


def _check_state_tables(entry: NamedSnapshot) -> list[str]:
    """Each exported state table still reads, with the row count recorded at export."""
    problems = []
    for table in entry.details.get("state_tables", []):
        uri = _fs.join(entry.location, table["path"])
        if table.get("files") is not None:
            problems.extend(_check_files(uri, table["path"], table["files"]))
        try:  # counting reads every file's footer: a missing or truncated file fails here
            rows = count_rows(uri)
        except Exception as e:
            problems.append(f"{table['path']}: unreadable state table: {e}")
            continue
        if rows != table["rows"]:
            problems.append(f"{table['path']}: {rows} rows, the snapshot says {table['rows']}")
    return problems


@takes_storage_options
def delete(
    location: str,
    name: str,
    sink: str | None = None,
    *,
    force: bool = False,
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> NamedSnapshot:
    """Remove the export's files, then its name: a delete that fails half way leaves the
    name registered, and running it again finishes both. A backup's part is refused
    unless ``force``: that backup would no longer restore."""
    handle = _open(location, sink, "snapshots delete")
    entry = show(location, name, sink)
    _refuse_enclosing(handle.load(), entry)
    if not force:
        backup = backup_of_part(name, entry.location)
        if backup is not None:
            backup_id, to = backup
            raise ConfigError(
                f"snapshot {name!r} is this query's part of backup {backup_id} in {to}: "
                "deleting it makes that backup unrestorable. Delete the whole backup "
                f"(`pyspark-txn backups delete {backup_id} --to {to}`), or pass --force "
                "(force=True) to delete this part anyway (nothing was deleted)"
            )
    left = _remove_files(entry)

    def deleted(s: SinkState) -> Any:
        _refuse_enclosing(s, entry)  # registered meanwhile
        return delete_named(s, name)

    handle.record_store().update(handle.sink_id, fold_sink, deleted)
    if left:
        raise TxnError(
            f"snapshot {name!r} is unregistered, but {entry.location} does not carry its "
            "export marker any more; it was left in place: remove it yourself"
        )
    return replace(entry)


def _refuse_enclosing(state: SinkState, entry: NamedSnapshot) -> None:
    """An older entry may sit inside this one's folder (registered before the checks)."""
    for other in state.named.values():
        if other.name != entry.name and _relation(other.location, entry.location) in (
            "is",
            "is inside",
        ):
            raise ConfigError(
                f"snapshot {entry.name!r}: its folder {entry.location} holds the location of "
                f"snapshot {other.name!r} ({other.location}); delete {other.name!r} "
                "first (nothing was deleted)"
            )


def _remove_files(entry: NamedSnapshot) -> bool:
    """Remove what the export wrote; True when its folder holds something else that
    carries no marker of this export (left in place)."""
    location = entry.location
    link = _fs.is_local(location) and os.path.islink(location)
    if link:  # the copy, not only the link
        location = os.path.realpath(location)
    fs, root = _fs.filesystem(location)
    marker = _read_marker(fs, root) if fs.exists(root) else None
    if marker is not None and marker.get("snapshot_id") == entry.snapshot_id:
        _remove_export(fs, root, location)
    elif marker is not None or any(fs.exists(_fs.join(root, p)) for p in _EXPORT_PARTS):
        return True  # another export's, or files without a marker: not ours to remove
    elif fs.exists(root) and not fs.ls(root, detail=False):
        fs.rmdir(root)  # what a removal killed after its last file left
    if link:
        os.unlink(entry.location)
    return False
